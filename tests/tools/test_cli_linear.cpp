// `k3 validate --op linear` and `k3 bench linear` end to end at tiny shapes: the table, the JSON
// records with limit fractions, and the errors.
#include <gtest/gtest.h>

#include "tools/cli_run.hpp"

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace {

using k3::test::run_cli;

TEST(CliLinear, ValidateSmokePassesEveryRow) {
  const std::string json = testing::TempDir() + "k3_validate_linear.json";
  const auto r = run_cli("validate --op linear --suite smoke --output " + json);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("0 failed"), std::string::npos) << r.out;
  std::ifstream f(json);
  const auto j = nlohmann::json::parse(f);
  ASSERT_GE(j["records"].size(), 8u);  // 4 cases x (cpu, reference)
  for (const auto& rec : j["records"]) {
    EXPECT_EQ(rec["op"], "linear");
    EXPECT_TRUE(rec["pass"].get<bool>()) << rec.dump();
  }
  const auto d = run_cli("validate --op linear --suite determinism");
  ASSERT_EQ(d.code, 0) << d.out;
  EXPECT_NE(d.out.find("one digest on every level"), std::string::npos) << d.out;
}

TEST(CliLinear, BenchWritesRecordsWithBothLimitFractions) {
  const std::string json = testing::TempDir() + "k3_bench_linear.json";
  const auto r = run_cli("bench linear --shapes 96x40 --m 1 17 --rounds 1 --iters 1 --pool-mib 1 --bw-mib 16 "
                         "--threads 2 --output " + json);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("limits (same run): read bandwidth"), std::string::npos) << r.out;
  std::ifstream f(json);
  const auto j = nlohmann::json::parse(f);
  ASSERT_EQ(j["records"].size(), 4u);  // 2 recipes x 2 M
  for (const auto& rec : j["records"]) {
    EXPECT_GT(rec["time"]["median_s"].get<double>(), 0);
    EXPECT_GT(rec["fraction_of_read_bandwidth"].get<double>(), 0);
    EXPECT_GT(rec["fraction_of_peak"].get<double>(), 0);
  }
  EXPECT_GT(j["read_bandwidth_Bps"]["value"].get<double>(), 0);
  EXPECT_GE(j["read_bandwidth_Bps"]["value"].get<double>(), j["read_bandwidth_Bps"]["median"].get<double>());
}

// Decode M (<= 8) is also measured against the read bandwidth probed right before and after each
// round's calls: per record the median of those probes and of the per-round fractions; M = 17 has
// none.
TEST(CliLinear, BenchDecodeRecordsCarryTheBandwidthProbedBesideThem) {
  const std::string json = testing::TempDir() + "k3_bench_linear_adj.json";
  const auto r = run_cli("bench linear --shapes 96x40 --m 1 17 --recipes w8a16 --rounds 3 --iters 2 --pool-mib 1 "
                         "--bw-mib 16 --threads 2 --torch-python off --output " + json);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("of bwadj"), std::string::npos) << r.out;
  std::ifstream f(json);
  const auto j = nlohmann::json::parse(f);
  ASSERT_EQ(j["records"].size(), 2u);
  for (const auto& rec : j["records"]) {
    if (rec["m"] == 17) {
      EXPECT_FALSE(rec.contains("fraction_of_adjacent_read_bandwidth"));
      continue;
    }
    const auto& adj = rec["adjacent_read_bandwidth_Bps"];
    EXPECT_GT(adj["min"].get<double>(), 0);
    EXPECT_LE(adj["min"].get<double>(), adj["median"].get<double>());
    EXPECT_LE(adj["median"].get<double>(), adj["max"].get<double>());
    EXPECT_NE(adj["what"].get<std::string>().find("16 MiB"), std::string::npos) << adj;
    // The median of three per-round fractions lies between the fractions of the extreme probes,
    // each against a round median inside the [min, max] of all calls.
    const double frac = rec["fraction_of_adjacent_read_bandwidth"].get<double>(), bytes = rec["bytes"].get<double>();
    EXPECT_GE(frac, bytes / rec["time"]["max_s"].get<double>() / adj["max"].get<double>());
    EXPECT_LE(frac, bytes / rec["time"]["min_s"].get<double>() / adj["min"].get<double>());
  }
}

// Without a Python that imports torch the bench runs k3 alone and says why (the torch side is
// tested with the real torch in python/tests/test_k3.py).
TEST(CliLinear, BenchWithoutTorchSaysWhyAndStillMeasures) {
  const std::string json = testing::TempDir() + "k3_bench_linear_notorch.json";
  auto r = run_cli("bench linear --shapes 96x40 --m 1 --recipes w16a16 --rounds 1 --iters 1 --pool-mib 1 --bw-mib 16 "
                   "--torch-python /nonexistent/python3 --output " + json);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("torch baseline: not run (/nonexistent/python3 was not found)"), std::string::npos) << r.out;
  std::ifstream f(json);
  const auto j = nlohmann::json::parse(f);
  EXPECT_EQ(j["torch"]["not_run"], "/nonexistent/python3 was not found");
  ASSERT_EQ(j["records"].size(), 1u);
  EXPECT_TRUE(j["records"][0]["torch_bf16"].is_null());
  r = run_cli("bench linear --shapes 96x40 --m 1 --rounds 1 --iters 1 --pool-mib 1 --bw-mib 16 --torch-python off");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("torch baseline: not run (--torch-python off)"), std::string::npos) << r.out;
  r = run_cli("bench linear --shapes 96x40 --m 1 --rounds 1 --iters 1 --pool-mib 1 --bw-mib 16 --torch-python "
              "/bin/false");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("torch baseline: not run (/bin/false cannot import torch)"), std::string::npos) << r.out;
  // The default python3: where it has no torch, one line says so and the probe prints no traceback.
  r = run_cli("bench linear --shapes 96x40 --m 1 --rounds 1 --iters 1 --pool-mib 1 --bw-mib 16");
  ASSERT_EQ(r.code, 0) << r.out;
  if (r.out.find("python3 cannot import torch") != std::string::npos) {
    EXPECT_EQ(r.out.find("Traceback"), std::string::npos) << r.out;
  }
}

TEST(CliLinear, BenchRefusesBadShapesAndRecipes) {
  auto r = run_cli("bench linear --shapes 96by40 --pool-mib 1");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--shapes: '96by40' is not KxN"), std::string::npos) << r.out;
  r = run_cli("bench linear --shapes 100x40 --pool-mib 1");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("k = 100 must be a positive multiple of 32"), std::string::npos) << r.out;
  r = run_cli("bench linear --shapes 96x40 --recipes w4a8 --pool-mib 1");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--recipes: recipe 'w4a8' is not a linear recipe"), std::string::npos) << r.out;
  r = run_cli("validate --op linear --backend gpu");
  EXPECT_NE(r.out.find("linear backend 'gpu' is not known"), std::string::npos) << r.out;
}

}  // namespace
