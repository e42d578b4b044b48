// End-to-end checks of the `k3` command line (exit codes, JSON, error messages).
#include <gtest/gtest.h>

#include "k3/cuda_moe.hpp"
#include "k3/cuda_sm120.hpp"
#include "k3/memory.hpp"
#include "tools/cli_run.hpp"

#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

namespace {

using k3::test::CliRun;
using k3::test::run_cli;

TEST(Cli, InfoJsonHasTheFacts) {
  const auto r = run_cli("info --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_FALSE(j["version"].get<std::string>().empty());
  EXPECT_TRUE(j["cpu"]["features"].contains("avx512_bf16"));
  EXPECT_TRUE(j["cpu"]["features"].contains("avx2"));
  EXPECT_GE(j["threads"].get<int>(), 1);
  EXPECT_EQ(j["huge_pages"].get<std::string>(), std::string(k3::huge_page_mode()));  // the kernel's THP mode
  EXPECT_TRUE(j["cuda"].contains("devices"));
  // A build with CUDA says, per op, where its kernels have run: sm_90 on one H200, sm_120 never.
  if (j["cuda"]["compiled"].get<bool>()) {
    for (const char* op : {"moe_status", "kda_status"}) {
      const std::string st = j["cuda"][op].get<std::string>();
      EXPECT_NE(st.find("H200"), std::string::npos) << op << ": " << st;
      EXPECT_NE(st.find("sm_120 never run on a GPU"), std::string::npos) << op << ": " << st;
    }
    // The MoE paths of the build, prefill-sm90 present exactly when its CUTLASS GEMM was built.
    const std::string paths = j["cuda"]["moe_paths"].get<std::string>();
    EXPECT_EQ(paths.rfind("decode-splitk (auto", 0), 0u) << paths;  // the one decode path (no forced-only "decode")
    EXPECT_NE(paths.find("the sm_90 paths ran on an H200 (2026-12-04), the sm_120 one never ran"), std::string::npos)
        << paths;
    EXPECT_EQ(paths.find("prefill-sm90 (CUTLASS") != std::string::npos, k3::cuda::has_sm90_grouped_gemm()) << paths;
    EXPECT_EQ(paths.find("w4a8-sm120-cutlass") != std::string::npos, k3::cuda::has_sm120_blockscaled_gemm()) << paths;
    // The CUTLASS sm_120a block-scaled GEMM: present or not, and UNVERIFIED when present.
    const std::string bs = j["cuda"]["sm120_blockscaled_gemm"].get<std::string>();
    const bool with_sm120 = j["cuda"]["archs"].get<std::string>().find("120a") != std::string::npos;
#if defined(K3_HAVE_CUTLASS)
    EXPECT_EQ(bs.rfind("compiled", 0) == 0, with_sm120) << bs;
#else
    (void)with_sm120;
#endif
    if (bs.rfind("compiled", 0) == 0) {
      EXPECT_NE(bs.find("UNVERIFIED: never run on a GPU"), std::string::npos) << bs;
    } else {
      EXPECT_NE(bs.find("not built"), std::string::npos) << bs;
    }
  } else {
    EXPECT_FALSE(j["cuda"].contains("kda_status"));
    EXPECT_FALSE(j["cuda"].contains("sm120_blockscaled_gemm"));
  }
  // Transports of the multi-rank ops: each ok or the reason it is missing.
  const std::string mpi = j["transports"]["mpi"].get<std::string>();
#ifdef K3_WITH_MPI
  EXPECT_EQ(mpi.rfind("ok (", 0), 0u) << mpi;
#else
  EXPECT_NE(mpi.find("built without MPI"), std::string::npos) << mpi;
#endif
  const std::string nccl = j["transports"]["nccl"].get<std::string>();
  EXPECT_TRUE(nccl.rfind("ok (unverified", 0) == 0 || nccl.find("NCCL could not be opened") != std::string::npos ||
              nccl.find("no CUDA device") != std::string::npos || nccl.find("without the CUDA backend") != std::string::npos)
      << nccl;
}

TEST(Cli, StartsWithoutLoadingCublas) {
  // cuBLAS (hundreds of MB) is opened only by the CUDA bench baseline, never at start-up: the
  // binary must not list it (or cuBLASLt) as a needed library.
  const auto r = k3::test::run_sh(std::string("readelf -d ") + K3_CLI_PATH);
  ASSERT_EQ(r.code, 0) << r.out;
  ASSERT_NE(r.out.find("(NEEDED)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("libcublas"), std::string::npos) << r.out;
  const auto v = run_cli("--version");
  EXPECT_EQ(v.code, 0) << v.out;
}

TEST(Cli, InfoTextNamesCudaDevicesOrTheirAbsence) {
  const auto r = run_cli("info");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("cuda device"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("simd:"), std::string::npos);
}

TEST(Cli, ValidateFormatsPasses) {
  const auto r = run_cli("validate --op formats");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("e4m3 codes"), std::string::npos) << r.out;
}

TEST(Cli, UnknownOpAndMissingRequirementFail) {
  auto r = run_cli("validate --op nosuchop");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("--op nosuchop is not known"), std::string::npos) << r.out;
  r = run_cli("validate --op formats --backend cuda");
  // Without a usable device, asking for the CUDA backend must fail (not pass as "missing").
  const auto info = nlohmann::json::parse(run_cli("info --json").out);
  if (info["cuda"]["devices"].empty()) {
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_NE(r.out.find("FAIL"), std::string::npos) << r.out;
  } else {
    EXPECT_EQ(r.code, 0) << r.out;
  }
}

TEST(Cli, BadUsageExitsNonZero) {
  EXPECT_NE(run_cli("").code, 0);
  EXPECT_NE(run_cli("validate --no-such-flag").code, 0);
}

}  // namespace

namespace {

TEST(Cli, BenchMoeBackendErrorsAreNamed) {
  auto r = run_cli("bench moe --backend tpu --m 1");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("--backend tpu is not known"), std::string::npos) << r.out;
  const auto info = nlohmann::json::parse(run_cli("info --json").out);
  if (info["cuda"]["devices"].empty()) {
    r = run_cli("bench moe --backend cuda --m 1");
    EXPECT_EQ(r.code, 2);
    EXPECT_NE(r.out.find("--backend cuda"), std::string::npos) << r.out;
  }
}

TEST(Cli, ValidateMoeCudaWithoutDeviceFails) {
  const auto info = nlohmann::json::parse(run_cli("info --json").out);
  if (!info["cuda"]["devices"].empty()) GTEST_SKIP() << "a CUDA device is present: this checks the no-device error";
  const auto r = run_cli("validate --op moe --suite smoke --backend cuda");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("FAIL"), std::string::npos) << r.out;
}

}  // namespace
