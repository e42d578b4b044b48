// `k3 validate --op kda` and `k3 bench kda` end to end (small sizes; the full matrix and the
// real sweeps are for users to run).
#include <gtest/gtest.h>

#include "scoped_env.hpp"
#include "tools/cli_run.hpp"
#include "k3/backend.hpp"

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
                           "verify/fp32", "replay: commit = decode token by token, bit for bit",
                           "replay: non-finite k / v follow decode's policy", "replay: refusals",
                           "1/2/3 threads x 2 runs chunked", "isa scalar", "conv1d+silu", "gated rmsnorm"}) {
    EXPECT_NE(r.out.find(text), std::string::npos) << text << "\n" << r.out;
  }
  EXPECT_NE(r.out.find("prefill/fp32 T=63 D=60"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("prefill/fp64 T=63 D=60"), std::string::npos) << r.out;
}

TEST(KdaCli, ValidateCudaBackendFailsWithoutAUsableDevice) {
  const k3::KdaBackend& cuda = *k3::find_kda_backend("cuda").value();
  if (cuda.available().is_ok()) GTEST_SKIP() << "a CUDA device is usable here: the device check covers this";
  const auto r = run_cli("validate --op kda --backend cuda");
  EXPECT_EQ(r.code, 1) << r.out;
  // The registry's reason, in one FAIL row; nothing else runs (no silent CPU rows).
  EXPECT_NE(r.out.find("backend cuda usable"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(cuda.available().message()), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("1 checks, 1 failed"), std::string::npos) << r.out;
}

// --backend reference: the rows run through the reference backend's registry entries; its
// missing decode / verify entries are SKIP rows naming the reason; the CPU-only rows do not run.
TEST(KdaCli, ValidateReferenceBackendRunsItsOwnEntries) {
  const std::string path = ::testing::TempDir() + "k3_validate_kda_ref.json";
  const auto r = run_cli("validate --op kda --suite smoke --backend reference --output " + path);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("SKIP  skipped: kda backend 'reference' has no decode entry (it implements: prefill, conv, rmsnorm)"),
            std::string::npos) << r.out;
  EXPECT_NE(r.out.find("failed, 3 skipped"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("SKIP  skipped: kda backend 'reference' has no verify_replay entry"), std::string::npos) << r.out;
  std::ifstream f(path);
  const auto j = nlohmann::json::parse(f);
  int prefill = 0, skipped = 0, determinism = 0;
  for (const auto& rec : j["records"]) {
    const std::string c = rec["case"];
    EXPECT_EQ(rec["backend"], "reference") << rec.dump();
    EXPECT_EQ(c.find("chunked"), std::string::npos) << c;  // CPU algorithm / ISA / ops rows: cpu only
    EXPECT_EQ(c.find("isa "), std::string::npos) << c;
    EXPECT_EQ(c.find("conv1d"), std::string::npos) << c;
    if (c.rfind("prefill/fp", 0) == 0) {
      ++prefill;
      EXPECT_TRUE(rec["pass"].get<bool>()) << rec.dump();
      EXPECT_FALSE(rec["skipped"].get<bool>()) << rec.dump();
    }
    if (rec["skipped"].get<bool>()) {
      ++skipped;
      EXPECT_TRUE(c.rfind("decode ", 0) == 0 || c.rfind("verify ", 0) == 0 || c.rfind("replay ", 0) == 0) << c;
    }
    if (c == "1/2/3 threads x 2 runs auto") ++determinism;
  }
  EXPECT_EQ(prefill, 6);  // 3 smoke cases x (FP32, FP64)
  EXPECT_EQ(skipped, 3);
  EXPECT_EQ(determinism, 1);
  std::remove(path.c_str());
}

TEST(KdaCli, ValidateDefaultBackendIsTheRegistrysAndUnknownNamesListTheKnown) {
  const std::string path = ::testing::TempDir() + "k3_validate_kda_cpu.json";
  auto r = run_cli("validate --op kda --suite smoke --output " + path);
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream f(path);
  const auto j = nlohmann::json::parse(f);
  int cpu_prefill = 0;
  for (const auto& rec : j["records"]) {
    const std::string c = rec["case"];
    if (c.rfind("prefill/fp", 0) == 0 || c.rfind("decode/", 0) == 0 || c.rfind("verify/", 0) == 0) {
      EXPECT_EQ(rec["backend"], "cpu") << rec.dump();
      ++cpu_prefill;
    }
    if (c.rfind("fp32/fp64", 0) == 0) {
      EXPECT_EQ(rec["backend"], "reference") << rec.dump();
    }
  }
  EXPECT_EQ(cpu_prefill, 8);  // 3 cases x (FP32, FP64) + decode + verify
  std::remove(path.c_str());
  r = run_cli("validate --op kda --backend gpu");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("kda backend 'gpu' is not known (known: cpu, cuda, reference)"), std::string::npos) << r.out;
}

TEST(KdaCli, BenchPrintsBothSweepsAndWritesJson) {
  const std::string path = ::testing::TempDir() + "k3_bench_kda.json";
  const auto r = run_cli("bench kda --threads 2 --heads 2 --head-dim 32 --prefill-t 5 40 --decode-n 1 3 --iters 2 "
                         "--pool-mib 1 --bw-mib 16 --verify-n 2 --draft-tokens 3 --output " + path);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("rec/chk"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("of read bw"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("speculative verify H=2 K=V=32, T=3 draft tokens per request"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("total/snap"), std::string::npos) << r.out;
  std::ifstream f(path);
  const auto j = nlohmann::json::parse(f);
  ASSERT_EQ(j["records"].size(), 5u);
  // Speculative verify: T states per request (snapshots) against one state + its replay window
  // (T H (2K + V + 2) + 1 floats).
  const auto& ver = j["records"][4];
  EXPECT_EQ(ver["kind"], "verify");
  EXPECT_EQ(ver["snapshot_bytes_per_request"].get<double>(), 3.0 * 2 * 32 * 32 * 4);
  EXPECT_EQ(ver["replay_bytes_per_request"].get<double>(), 2.0 * 32 * 32 * 4 + (3.0 * 2 * (2 * 32 + 32 + 2) + 1) * 4);
  EXPECT_GT(ver["commit"]["median_s"].get<double>(), 0.0);
  EXPECT_GT(ver["snapshot_verify"]["median_s"].get<double>(), 0.0);
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
  EXPECT_NE(run_cli("bench kda --draft-tokens 65").code, 0);
  const auto v = run_cli("bench kda --prefill-t 8 --decode-n 1 --verify-n 4 0");
  EXPECT_EQ(v.code, 2) << v.out;
  EXPECT_NE(v.out.find("--verify-n 0 must be >= 1 (or a single 0: no verify section)"), std::string::npos) << v.out;
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

TEST(KdaCli, BenchHonoursK3IsaFromTheEnvironment) {
  k3::test::ScopedEnv env("K3_ISA", "scalar");
  const auto r = run_cli("bench kda --threads 1 --heads 2 --head-dim 16 --prefill-t 17 --decode-n 1 --iters 1 "
                         "--pool-mib 1 --bw-mib 16");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("isa scalar"), std::string::npos) << r.out;
}

}  // namespace
