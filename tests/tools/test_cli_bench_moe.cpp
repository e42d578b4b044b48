// `k3 bench moe` end to end at a tiny shape: table, JSON records, routing replay files, errors.
#include <gtest/gtest.h>

#include "tools/cli_run.hpp"

#include <array>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "k3/system.hpp"

namespace {

using k3::test::CliRun;
using k3::test::run_cli;

const std::string kBase =
    "bench moe --hidden 64 --intermediate 96 --experts 16 --iters 1 --warmup 0 --bandwidth-mib 64 --threads 2 ";
const std::string kTiny = kBase + "--ep-size 2 --ep-rank 1 --top-k 4 ";

// Any host backend of the registry is benchmarked through its prepared layer: the FP64 oracle
// (reference) too, with the same traffic model, so its record differs from cpu's only in the
// backend, kernel and time.
TEST(CliBenchMoe, AnyHostBackendOfTheRegistryIsBenchmarkedThroughItsPreparedLayer) {
  const std::string json = testing::TempDir() + "k3_bench_moe_ref.json";
  const std::string cpu_json = testing::TempDir() + "k3_bench_moe_cpu.json";
  const auto r = run_cli(kTiny + "--m 3 --recipe w4a16 --backend reference --output " + json);
  ASSERT_EQ(r.code, 0) << r.out;
  ASSERT_EQ(run_cli(kTiny + "--m 3 --recipe w4a16 --backend cpu --output " + cpu_json).code, 0);
  std::ifstream f(json), g(cpu_json);
  const auto j = nlohmann::json::parse(f), jc = nlohmann::json::parse(g);
  ASSERT_EQ(j["records"].size(), 1u);
  const auto& rec = j["records"][0];
  EXPECT_EQ(rec["backend"], "reference");
  EXPECT_EQ(jc["records"][0]["backend"], "cpu");
  EXPECT_GT(rec["timing"]["median_s"].get<double>(), 0);
  EXPECT_EQ(rec["weight_bytes_per_call"], jc["records"][0]["weight_bytes_per_call"]);
  EXPECT_EQ(rec["histogram"], jc["records"][0]["histogram"]);
  const auto bad = run_cli(kTiny + "--m 3 --backend tpu");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.out.find("--backend tpu is not known (known: cpu, "), std::string::npos) << bad.out;
}

TEST(CliBenchMoe, PrintsTheTableAndWritesRecordsWithLimitsAndHistogram) {
  const std::string json = testing::TempDir() + "k3_bench_moe.json";
  const std::string ids = testing::TempDir() + "k3_bench_moe.ids";
  const auto r = run_cli(kTiny + "--m 3,40 --recipe both --routing ep_mixed --output " + json + " --save-routing " + ids);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("%peak"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("limits: read bandwidth"), std::string::npos) << r.out;
  // The one-line verdict: per recipe the decode M against bandwidth, the prefill M against peak
  // (here M = 40 is neither >= 128: only the decode part).
  EXPECT_NE(r.out.find("verdict: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("w4a8 M=3 "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("w4a16 M=3 "), std::string::npos) << r.out;
  std::ifstream f(json);
  const auto j = nlohmann::json::parse(f);
  ASSERT_EQ(j["records"].size(), 4u);
  for (const auto& rec : j["records"]) {
    EXPECT_GT(rec["timing"]["median_s"].get<double>(), 0);
    EXPECT_GT(rec["fraction_of_read_bandwidth"].get<double>(), 0);
    EXPECT_GT(rec["fraction_of_dot_peak"].get<double>(), 0);
    EXPECT_TRUE(rec["histogram"].contains("p90"));
    EXPECT_TRUE(rec["histogram"].contains("padding_fraction_block8"));
    // ep_mixed: 2 of 4 slots local.
    EXPECT_EQ(rec["histogram"]["rows_per_call"].get<double>(), 2.0 * rec["m"].get<double>());
  }
  EXPECT_GT(j["read_bandwidth_Bps"]["value"].get<double>(), 0);
  EXPECT_FALSE(j["machine"]["cpu"].get<std::string>().empty());
  // The saved ids (40 tokens, the largest M) replay; 50 tokens cycle through them.
  const auto rr = run_cli(kTiny + "--m 50 --routing replay:" + ids);
  ASSERT_EQ(rr.code, 0) << rr.out;
  EXPECT_NE(rr.out.find("replay:"), std::string::npos) << rr.out;
}

// A decode M is also measured against the read bandwidth probed right before and right after its
// calls (on a shared host the bandwidth moves within a run): both probes, the larger as the
// limit, and the fraction against it; a prefill M (compute-bound) has none.
TEST(CliBenchMoe, DecodeRecordsCarryTheBandwidthProbedBesideThem) {
  const std::string json = testing::TempDir() + "k3_bench_moe_adjacent.json";
  const auto r = run_cli(kTiny + "--m 2,128 --recipe w4a8 --output " + json);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("%bwadj"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("of the bandwidth probed beside it"), std::string::npos) << r.out;
  std::ifstream f(json);
  const auto j = nlohmann::json::parse(f);
  ASSERT_EQ(j["records"].size(), 2u);
  for (const auto& rec : j["records"]) {
    if (rec["m"] == 128) {
      EXPECT_FALSE(rec.contains("adjacent_read_bandwidth_Bps"));
      EXPECT_FALSE(rec.contains("fraction_of_adjacent_read_bandwidth"));
      continue;
    }
    const auto& adj = rec["adjacent_read_bandwidth_Bps"];
    const double before = adj["before"].get<double>(), after = adj["after"].get<double>();
    EXPECT_GT(before, 0);
    EXPECT_GT(after, 0);
    EXPECT_EQ(adj["value"].get<double>(), std::max(before, after));
    EXPECT_NE(adj["what"].get<std::string>().find("64 MiB"), std::string::npos) << adj;  // --bandwidth-mib 64
    const double want = rec["weight_bytes_per_call"].get<double>() / rec["timing"]["median_s"].get<double>() /
                        adj["value"].get<double>();
    EXPECT_NEAR(rec["fraction_of_adjacent_read_bandwidth"].get<double>(), want, 1e-9 * want);
  }
}

// The OpenMP wait policy changes the time of short calls, so the header and the JSON name it.
TEST(CliBenchMoe, HeaderAndJsonNameTheOpenMpWaitPolicy) {
  const std::string json = testing::TempDir() + "k3_bench_moe_wait.json";
  for (const std::string policy : {"passive", ""}) {
    const std::string env = policy.empty() ? "env -u OMP_WAIT_POLICY " : "env OMP_WAIT_POLICY=" + policy + " ";
    const auto r = k3::test::run_sh(env + K3_CLI_PATH + " " + kTiny + "--m 3 --isa scalar --output " + json);
    ASSERT_EQ(r.code, 0) << r.out;
    const std::string want = policy.empty() ? "unset" : policy;
    EXPECT_NE(r.out.find("OMP_WAIT_POLICY " + want), std::string::npos) << r.out;
    std::ifstream f(json);
    EXPECT_EQ(nlohmann::json::parse(f)["machine"]["omp_wait_policy"], want);
  }
}

// --isa runs the kernels of one level, measures that level's peak and names the level in the
// table header, the plan line and every record; an unknown or unsupported level is an error.
TEST(CliBenchMoe, IsaOptionSelectsTheLevelAndItsPeak) {
  const std::string json = testing::TempDir() + "k3_bench_moe_isa.json";
  auto r = run_cli(kTiny + "--m 3 --isa scalar --output " + json);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("isa scalar (kernel portable)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("scalar FP32 multiply + add"), std::string::npos) << r.out;
  std::ifstream f(json);
  const auto j = nlohmann::json::parse(f);
  EXPECT_EQ(j["machine"]["isa"], "scalar");
  ASSERT_EQ(j["records"].size(), 1u);
  EXPECT_EQ(j["records"][0]["isa"], "scalar");
  EXPECT_EQ(j["records"][0]["kernel"], "portable");
  r = run_cli(kTiny + "--m 3 --isa sse9");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("--isa: ISA level 'sse9' is unknown (allowed: scalar, avx2, avx512, avx512bf16; this CPU has: "),
            std::string::npos) << r.out;
  if (k3::best_isa_level() != k3::IsaLevel::kAvx512Bf16) {
    r = run_cli(kTiny + "--m 3 --isa avx512bf16");
    EXPECT_EQ(r.code, 2);
    EXPECT_NE(r.out.find("is not supported by this CPU (allowed: scalar, avx2, avx512, avx512bf16; this CPU has: "), std::string::npos) << r.out;
  }
  if (k3::best_isa_level() >= k3::IsaLevel::kAvx2) {
    r = run_cli(kTiny + "--m 3 --isa avx2");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(k3::cpu_info().features.avx_vnni ? "isa avx2 (kernel avx2 fma + int16 vpdpwssd (avx-vnni))"
                                                           : "isa avx2 (kernel avx2 fma + int16 madd)"),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find("AVX2 FP32 FMA peak"), std::string::npos) << r.out;
  }
  std::remove(json.c_str());
}

TEST(CliBenchMoe, BadOptionsFailWithTheReason) {
  auto r = run_cli(kTiny + "--routing zipf:0");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("zipf:S needs a finite S > 0"), std::string::npos) << r.out;
  r = run_cli(kTiny + "--m 4,x");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("'x' is not a token count"), std::string::npos) << r.out;
  r = run_cli(kTiny + "--routing replay:/nonexistent/ids.bin");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("cannot open"), std::string::npos) << r.out;
  r = run_cli("bench moe --hidden 70 --intermediate 96 --experts 16 --bandwidth-mib 64");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("hidden (K) = 70"), std::string::npos) << r.out;
  r = run_cli(kBase + "--routing uniform --ep-size 8 --top-k 4");  // 4 local slots > E_local 2
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("need at least that many local experts"), std::string::npos) << r.out;
  const std::string bad = testing::TempDir() + "k3_bad.ids";
  std::ofstream(bad) << "not a routing file at all, long enough for a header";
  r = run_cli(kTiny + "--routing replay:" + bad);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("not a routing replay file"), std::string::npos) << r.out;
  r = run_cli(kTiny + "--avx-vnni maybe");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--avx-vnni"), std::string::npos) << r.out;
}

// --avx-vnni false runs the FP32 levels' integer dots as VPMADDWD + VPADDD; true (the default)
// runs AVX-VNNI's VPDPWSSD where the CPU has it. The record names the kernel.
TEST(CliBenchMoe, AvxVnniFlagPicksTheIntegerForm) {
  if (k3::best_isa_level() < k3::IsaLevel::kAvx2) GTEST_SKIP() << "needs an AVX2 CPU";
  const std::string json = testing::TempDir() + "k3_bench_moe_vnni.json";
  for (const bool on : {false, true}) {
    const auto r = run_cli(kTiny + "--m 1 --recipe w4a8 --isa avx2 --avx-vnni " + (on ? "true" : "false") +
                           " --output " + json);
    ASSERT_EQ(r.code, 0) << r.out;
    std::ifstream f(json);
    const auto j = nlohmann::json::parse(f);
    const bool vex = on && k3::cpu_info().features.avx_vnni;
    EXPECT_EQ(j["records"][0]["kernel"], vex ? "avx2 fma + int16 vpdpwssd (avx-vnni)" : "avx2 fma + int16 madd");
  }
  std::remove(json.c_str());
}

}  // namespace
