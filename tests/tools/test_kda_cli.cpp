// `k3 validate --op kda` and `k3 bench kda` end to end (small sizes; the full matrix and the
// real sweeps are for users to run).
#include <gtest/gtest.h>

#include "tools/cli_run.hpp"

#include <array>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace {

using k3::test::CliRun;
using k3::test::run_cli;

TEST(KdaCli, ValidateSmokePassesAndCoversTheMatrix) {
  const auto r = run_cli("validate --op kda --suite smoke");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
  for (const char* text : {"chunked/fp32 T=63 D=60", "softplus vf", "varlen 15/", "decode: 36 unnamed slots bit-identical",
                           "verify/fp32", "1/2/3 threads x 2 runs chunked", "isa scalar", "conv1d+silu", "gated rmsnorm"}) {
    EXPECT_NE(r.out.find(text), std::string::npos) << text << "\n" << r.out;
  }
}

TEST(KdaCli, ValidateCudaBackendFailsWithoutAKdaCudaBackend) {
  const auto r = run_cli("validate --op kda --backend cuda");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("KDA has no CUDA backend yet"), std::string::npos) << r.out;
}

TEST(KdaCli, BenchPrintsBothSweepsAndWritesJson) {
  const std::string path = ::testing::TempDir() + "k3_bench_kda.json";
  const auto r = run_cli("bench kda --threads 2 --heads 2 --head-dim 32 --prefill-t 5 40 --decode-n 1 3 --iters 2 "
                         "--pool-mib 1 --bw-mib 16 --output " + path);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("rec/chk"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("of read bw"), std::string::npos) << r.out;
  std::ifstream f(path);
  const auto j = nlohmann::json::parse(f);
  ASSERT_EQ(j["records"].size(), 4u);
  EXPECT_EQ(j["records"][0]["kind"], "prefill");
  EXPECT_EQ(j["records"][1]["T"], 40);
  EXPECT_GT(j["records"][1]["chunked"]["median_s"].get<double>(), 0.0);
  EXPECT_EQ(j["records"][3]["kind"], "decode");
  EXPECT_EQ(j["records"][3]["state_bytes_read_written"].get<double>(), 2.0 * 3 * 2 * 32 * 32 * 4);
  EXPECT_GT(j["fp32_fma_peak_flops"]["value"].get<double>(), 0.0);
  std::remove(path.c_str());
}

TEST(KdaCli, BenchRejectsBadOptions) {
  EXPECT_NE(run_cli("bench kda --heads 0").code, 0);
  EXPECT_NE(run_cli("bench kda --iters 0").code, 0);
  const auto r = run_cli("bench kda --isa avx3");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("--isa: ISA level 'avx3' is unknown"), std::string::npos) << r.out;
}

TEST(KdaCli, BenchIsaOptionNamesTheLevelAndMeasuresItsPeak) {
  const std::string path = ::testing::TempDir() + "k3_bench_kda_isa.json";
  const auto r = run_cli("bench kda --isa scalar --threads 1 --heads 2 --head-dim 16 --prefill-t 17 --decode-n 1 "
                         "--iters 1 --pool-mib 1 --bw-mib 16 --output " + path);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("isa scalar"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("scalar FP32 multiply + add"), std::string::npos) << r.out;
  std::ifstream f(path);
  const auto j = nlohmann::json::parse(f);
  EXPECT_EQ(j["machine"]["isa"], "scalar");
  for (const auto& rec : j["records"]) EXPECT_EQ(rec["isa"], "scalar");
  std::remove(path.c_str());
}

}  // namespace
