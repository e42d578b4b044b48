// `k3 checkpoint synth` -> `k3 checkpoint inspect` end to end, and the CLI's error paths.
#include <gtest/gtest.h>

#include "tools/cli_run.hpp"

#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "core/st_test_util.hpp"
#include "k3/checkpoint.hpp"

namespace {

using k3::test::CliRun;
using k3::test::run_cli;

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "output: " << (msg)

const char* kSmall = "--hidden 64 --expert-hidden 64 --intermediate 32 --num-experts 8 --top-k 3";

TEST(CheckpointCli, SynthThenInspectJson) {
  k3::test::TempDir dir("cli_synth");
  const std::string out = dir.file("ck");
  auto r = run_cli("checkpoint synth --output " + out + " --layers 1,3 --experts 2:6 --seed 5 " + kSmall);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_HAS(r.out, "experts [2, 6) of 8");
  r = run_cli("checkpoint inspect " + out + " --json", false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["num_tensors"], 2 * (2 + 4 * 6));
  const int64_t per_expert = 2 * (32 * 32 + 32 * 2) + 64 * 16 + 64;
  EXPECT_EQ(j["total_bytes"], 2 * (8 * 64 * 2 + 8 * 2 + 4 * per_expert));
  EXPECT_EQ(j["moe_layers"]["1"]["experts"], "2-5");
  EXPECT_EQ(j["moe_layers"]["3"]["num_experts"], 4);
  EXPECT_EQ(j["moe_layers"]["3"]["router_bias"], true);
  EXPECT_EQ(j["config"]["model_type"], "kimi_k3");
  EXPECT_EQ(j["config"]["num_experts"], 8);
  bool found = false;
  for (const auto& t : j["tensors"]) {
    if (t["name"] == "language_model.model.layers.3.block_sparse_moe.experts.5.w2.weight_scale") {
      found = true;
      EXPECT_EQ(t["dtype"], "U8");
      EXPECT_EQ(t["shape"], nlohmann::json::array({64, 1}));
      EXPECT_EQ(t["bytes"], 64);
      EXPECT_EQ(t["file"], "model.safetensors");
    }
  }
  EXPECT_TRUE(found);
  // The same seed and experts written again through the library give identical weights.
  auto w = k3::load_moe_layer(out, 3, 2, 0);
  ASSERT_FALSE(w);  // rank 0 of 2 needs experts 0-3; the checkpoint holds 2-5
  EXPECT_HAS(w.status().message(), "experts 0-1");
  EXPECT_HAS(w.status().message(), "holds experts 2-5");
}

TEST(CheckpointCli, ShardedEpRankAndTextInspect) {
  k3::test::TempDir dir("cli_sharded");
  const std::string out = dir.file("ck");
  auto r = run_cli("checkpoint synth -o " + out + " --ep-size 4 --ep-rank 3 --shard-size 3KB " + kSmall);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_HAS(r.out, "model.safetensors.index.json");
  r = run_cli("checkpoint inspect " + out + " --layer 1 --ep-size 4 --ep-rank 3");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_HAS(r.out, "language_model.model.layers.1.block_sparse_moe.experts.7.w3.weight_packed");
  EXPECT_HAS(r.out, "moe layer 1: 2 experts (6-7), router weight + bias");
  EXPECT_HAS(r.out, "loaded layer 1 for EP rank 3 of 4: experts [6, 8)");
  EXPECT_HAS(r.out, "config: kimi_k3, hidden 64, experts K 64 x N 32, E 8, top-3");
  r = run_cli("checkpoint inspect " + out + " --summary --layer 1 --ep-size 4 --ep-rank 0");
  EXPECT_EQ(r.code, 2);  // an error, not a failed check
  EXPECT_HAS(r.out, "lacks 2 of the 2 experts that layer 1 needs on EP rank 0 of 4");
  EXPECT_HAS(r.out, "k3 checkpoint synth --layers 1 --ep-size 4 --ep-rank 0");
  EXPECT_EQ(r.out.find("weight_packed  "), std::string::npos) << "--summary lists no tensors";
  // An uneven partition (docs/distributed.md): 8 experts over 3 ranks hold 3, 3 and 2.
  const std::string odd = dir.file("ck3");
  r = run_cli("checkpoint synth -o " + odd + " --ep-size 3 --ep-rank 1 " + kSmall);
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_cli("checkpoint inspect " + odd + " --summary --layer 1 --ep-size 3 --ep-rank 1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_HAS(r.out, "moe layer 1: 3 experts (3-5), router weight + bias");
  EXPECT_HAS(r.out, "loaded layer 1 for EP rank 1 of 3: experts [3, 6)");
  r = run_cli("checkpoint inspect " + odd + " --summary --layer 1 --ep-size 3 --ep-rank 2");
  EXPECT_EQ(r.code, 2);
  EXPECT_HAS(r.out, "lacks 2 of the 2 experts that layer 1 needs on EP rank 2 of 3 (global experts [6, 8))");
}

TEST(CheckpointCli, Errors) {
  k3::test::TempDir dir("cli_errors");
  const std::string out = dir.file("ck");
  EXPECT_NE(run_cli("checkpoint synth").code, 0);  // --output is required
  auto r = run_cli("checkpoint synth -o " + out + " --experts 7:3 " + std::string(kSmall));
  EXPECT_EQ(r.code, 2);
  EXPECT_HAS(r.out, "experts [7, 3) must be a non-empty range within [0, 8)");
  r = run_cli("checkpoint synth -o " + out + " --experts 1-3 " + std::string(kSmall));
  EXPECT_HAS(r.out, "--experts '1-3' must be BEGIN:END");
  r = run_cli("checkpoint synth -o " + out + " --layers 0 " + std::string(kSmall));
  EXPECT_HAS(r.out, "layer 0 is not an MoE layer");
  r = run_cli("checkpoint synth -o " + out + " --layers 1,,2 " + std::string(kSmall));
  EXPECT_HAS(r.out, "--layers '1,,2' must be a comma-separated list");
  r = run_cli("checkpoint synth -o " + out + " --ep-size 9 --ep-rank 0 " + std::string(kSmall));
  EXPECT_HAS(r.out, "--ep-size 9 --ep-rank 0: ep-size must be at most --num-experts 8");
  r = run_cli("checkpoint synth -o " + out + " --shard-size 5XB " + std::string(kSmall));
  EXPECT_HAS(r.out, "--shard-size '5XB' must be a byte count");
  EXPECT_NE(run_cli("checkpoint synth -o " + out + " --experts 0:4 --ep-size 2 --ep-rank 0").code, 0);
  ASSERT_EQ(run_cli("checkpoint synth -o " + out + " " + kSmall).code, 0);
  r = run_cli("checkpoint synth -o " + out + " " + kSmall);
  EXPECT_EQ(r.code, 2);
  EXPECT_HAS(r.out, "already holds a checkpoint");
  EXPECT_EQ(run_cli("checkpoint synth -o " + out + " --force --seed 9 " + kSmall).code, 0);
  r = run_cli("checkpoint inspect " + dir.file("nothing"));
  EXPECT_EQ(r.code, 2);
  EXPECT_HAS(r.out, "no such file or directory");
  k3::test::write_bytes(dir.file("bad.safetensors"), k3::test::st_image("{\"w\": 3}"));
  r = run_cli("checkpoint inspect " + dir.file("bad.safetensors"));
  EXPECT_EQ(r.code, 2);
  EXPECT_HAS(r.out, "bad.safetensors: tensor 'w': entry must be a JSON object");
}

}  // namespace
