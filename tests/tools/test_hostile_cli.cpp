// Hostile command-line inputs: environment (K3_ISA), flag values and files that must give a clear
// error naming the argument, the limit and the value (never a silent fallback or a crash).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "core/st_test_util.hpp"
#include "core/synth_test_util.hpp"
#include "k3/harness/checkpoint_synth.hpp"
#include "k3/cuda.hpp"
#include "k3/safetensors.hpp"
#include "k3/system.hpp"
#include "scoped_env.hpp"
#include "tools/cli_run.hpp"

namespace {

using k3::test::run_cli;
using k3::test::ScopedEnv;

TEST(HostileCli, UnknownK3IsaIsAnErrorNamingTheChoices) {
  ScopedEnv env("K3_ISA", "garbage");
  for (const char* args : {"validate --op formats", "info", "kda run --input /nonexistent.st --output /tmp/x.st"}) {
    const auto r = run_cli(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_NE(r.out.find("K3_ISA=garbage"), std::string::npos) << args << "\n" << r.out;
    EXPECT_NE(r.out.find("allowed: scalar, avx2, avx512, avx512bf16"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("this CPU has: scalar"), std::string::npos) << r.out;
  }
}

TEST(HostileCli, K3IsaAboveTheCpuIsAnError) {
  if (k3::best_isa_level() >= k3::IsaLevel::kAvx512Bf16) GTEST_SKIP() << "this CPU has every level";
  const char* level = k3::best_isa_level() >= k3::IsaLevel::kAvx512 ? "avx512bf16" : "avx512";
  ScopedEnv env("K3_ISA", level);
  const auto r = run_cli("validate --op formats");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find(std::string("K3_ISA=") + level), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("not supported by this CPU"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(std::string("this CPU has: scalar")), std::string::npos) << r.out;
}

TEST(HostileCli, ValidK3IsaStillWorks) {
  ScopedEnv env("K3_ISA", "scalar");
  const auto r = run_cli("validate --op formats");
  EXPECT_EQ(r.code, 0) << r.out;
}

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "output: " << (msg)

template <typename T>
std::span<const uint8_t> bytes_of(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

// A `kda run` input: q, k, g [T, H, K], v [T, H, V], beta [T, H] (FP32, deterministic values),
// cu_seqlens when given (`cu_count` entries of `cu_fill`, last = T unless told otherwise).
void write_kda_input(const std::string& path, int64_t T, int64_t H, int64_t K, int64_t V,
                     const std::vector<int64_t>* cu = nullptr) {
  k3::st::Writer w;
  std::vector<float> qk(static_cast<size_t>(T * H * K), 0.25f), vv(static_cast<size_t>(T * H * V), 0.5f),
      g(static_cast<size_t>(T * H * K), -0.1f), beta(static_cast<size_t>(T * H), 0.5f);
  ASSERT_TRUE(w.add("q", k3::st::DType::kF32, {T, H, K}, bytes_of(qk)).is_ok());
  ASSERT_TRUE(w.add("k", k3::st::DType::kF32, {T, H, K}, bytes_of(qk)).is_ok());
  ASSERT_TRUE(w.add("v", k3::st::DType::kF32, {T, H, V}, bytes_of(vv)).is_ok());
  ASSERT_TRUE(w.add("g", k3::st::DType::kF32, {T, H, K}, bytes_of(g)).is_ok());
  ASSERT_TRUE(w.add("beta", k3::st::DType::kF32, {T, H}, bytes_of(beta)).is_ok());
  if (cu != nullptr) {
    ASSERT_TRUE(w.add("cu_seqlens", k3::st::DType::kI64, {static_cast<int64_t>(cu->size())}, bytes_of(*cu)).is_ok());
  }
  ASSERT_TRUE(w.write(path).is_ok());
}

// `kda run` with g = +inf, a NaN gate and an Inf v: every backend, algorithm and SIMD level gives the
// same NaN pattern in o and final_state (docs/kda.md, "Non-finite values") and no +-Inf. Before
// the policy, the cpu and fp32-reference backends put NaN and Inf in different places.
TEST(HostileCli, KdaRunNonfiniteInputsGiveTheSameNanPatternOnEveryBackend) {
  k3::test::TempDir dir("hostile_nonfinite");
  const std::string in = dir.file("in.safetensors");
  const int64_t T = 40, H = 2, K = 16, V = 16;
  std::vector<float> q(T * H * K), k(T * H * K), v(T * H * V), g(T * H * K), beta(T * H);
  for (size_t i = 0; i < q.size(); ++i) {
    q[i] = static_cast<float>(static_cast<int>(i * 37 % 11) - 5) * 0.1f;
    k[i] = static_cast<float>(static_cast<int>(i * 53 % 13) - 6) * 0.1f;
    g[i] = -0.05f * static_cast<float>(i % 7 + 1);
  }
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(static_cast<int>(i * 29 % 9) - 4) * 0.25f;
  for (size_t i = 0; i < beta.size(); ++i) beta[i] = 0.3f + 0.05f * static_cast<float>(i % 5);
  const float inf = std::numeric_limits<float>::infinity();
  g[(21 * H + 1) * K + 2] = inf;                                  // head 1 from token 21: all NaN
  g[(30 * H + 0) * K + 5] = std::numeric_limits<float>::quiet_NaN();  // head 0 from token 30
  v[(9 * H + 0) * V + 3] = -inf;                                  // head 0, column 3 from token 9
  k3::st::Writer w;
  ASSERT_TRUE(w.add("q", k3::st::DType::kF32, {T, H, K}, bytes_of(q)).is_ok());
  ASSERT_TRUE(w.add("k", k3::st::DType::kF32, {T, H, K}, bytes_of(k)).is_ok());
  ASSERT_TRUE(w.add("v", k3::st::DType::kF32, {T, H, V}, bytes_of(v)).is_ok());
  ASSERT_TRUE(w.add("g", k3::st::DType::kF32, {T, H, K}, bytes_of(g)).is_ok());
  ASSERT_TRUE(w.add("beta", k3::st::DType::kF32, {T, H}, bytes_of(beta)).is_ok());
  ASSERT_TRUE(w.write(in).is_ok());
  struct Run {
    const char* args;
    const char* isa;
  };
  const Run runs[] = {{"--backend fp64-reference", nullptr}, {"--backend fp32-reference", nullptr},
                      {"--backend cpu --algorithm chunked", nullptr}, {"--backend cpu --algorithm recurrent", nullptr},
                      {"--backend cpu --algorithm chunked", "scalar"}, {"--backend cpu --algorithm recurrent", "scalar"}};
  std::vector<char> want_o, want_s;
  for (const Run& r : runs) {
    std::optional<ScopedEnv> env;
    if (r.isa != nullptr) env.emplace("K3_ISA", r.isa);
    const std::string out = dir.file("out.safetensors");
    const auto res = run_cli(std::string("kda run ") + r.args + " --input " + in + " --output " + out);
    ASSERT_EQ(res.code, 0) << r.args << "\n" << res.out;
    auto f = k3::st::File::open(out);
    ASSERT_TRUE(f.is_ok()) << f.status().to_string();
    auto nan_pattern = [&](const char* name) {
      const k3::st::TensorInfo* t = f->find(name);
      std::vector<char> nan;
      const auto b = f->bytes(*t);
      for (int64_t i = 0; i < t->numel(); ++i) {
        double x;
        if (t->dtype == k3::st::DType::kF64) {
          std::memcpy(&x, b.data() + 8 * i, 8);
        } else {
          float y;
          std::memcpy(&y, b.data() + 4 * i, 4);
          x = y;
        }
        EXPECT_FALSE(std::isinf(x)) << r.args << " " << name << "[" << i << "]";
        nan.push_back(std::isnan(x) ? 1 : 0);
      }
      return nan;
    };
    const auto o = nan_pattern("o"), s = nan_pattern("final_state");
    if (want_o.empty()) {
      want_o = o, want_s = s;
      // The policy's pattern: head 1 from token 21, head 0 column 3 from token 9, head 0 from 30.
      auto at = [&](int64_t t, int64_t h, int64_t j) { return want_o[(t * H + h) * V + j]; };
      EXPECT_EQ(at(20, 1, 0), 0);
      EXPECT_EQ(at(21, 1, 0), 1);
      EXPECT_EQ(at(8, 0, 3), 0);
      EXPECT_EQ(at(9, 0, 3), 1);
      EXPECT_EQ(at(29, 0, 4), 0);
      EXPECT_EQ(at(30, 0, 4), 1);
      for (char x : want_s) EXPECT_EQ(x, 1);
    } else {
      EXPECT_EQ(o, want_o) << r.args << (r.isa ? " K3_ISA=scalar" : "");
      EXPECT_EQ(s, want_s) << r.args << (r.isa ? " K3_ISA=scalar" : "");
    }
  }
}

TEST(HostileCli, KdaRunCuSeqlensIsCheckedWithIndexAndValues) {
  k3::test::TempDir dir("hostile_cu");
  const std::string in = dir.file("in.safetensors"), out = dir.file("out.safetensors");
  std::vector<int64_t> cu = {};  // present but empty: not "one sequence"
  write_kda_input(in, 4, 2, 8, 8, &cu);
  auto r = run_cli("kda run --input " + in + " --output " + out);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_HAS(r.out, "tensor cu_seqlens has 0 entries, needs at least 2");
  cu = {0};
  write_kda_input(in, 4, 2, 8, 8, &cu);
  EXPECT_HAS(run_cli("kda run --input " + in + " --output " + out).out, "cu_seqlens has 1 entries, needs at least 2");
  cu = {1, 4};
  write_kda_input(in, 4, 2, 8, 8, &cu);
  EXPECT_HAS(run_cli("kda run --input " + in + " --output " + out).out, "cu_seqlens[0] = 1 must be 0");
  cu = {0, 3, 2, 4};
  write_kda_input(in, 4, 2, 8, 8, &cu);
  EXPECT_HAS(run_cli("kda run --input " + in + " --output " + out).out,
             "cu_seqlens[2] = 2 is below cu_seqlens[1] = 3 (must be non-decreasing)");
  cu = {0, 2, 5};
  write_kda_input(in, 4, 2, 8, 8, &cu);
  EXPECT_HAS(run_cli("kda run --input " + in + " --output " + out).out,
             "cu_seqlens[2] (the last entry) = 5 must equal the token count T = 4");
  cu = {0, 0, 4, 4};  // empty sequences are allowed
  write_kda_input(in, 4, 2, 8, 8, &cu);
  r = run_cli("kda run --input " + in + " --output " + out);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_HAS(r.out, "N = 3");
}

TEST(HostileCli, KdaRunWithNoTokens) {
  // T = 0: empty tensors (whose data pointers may be null) are not copied; o is [0, H, V].
  k3::test::TempDir dir("hostile_t0");
  const std::string in = dir.file("in.safetensors"), out = dir.file("out.safetensors");
  write_kda_input(in, 0, 2, 8, 8);
  const auto r = run_cli("kda run --input " + in + " --output " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  auto f = k3::st::File::open(out);
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  ASSERT_NE(f->find("o"), nullptr);
  EXPECT_EQ(f->find("o")->shape, (std::vector<int64_t>{0, 2, 8}));
  EXPECT_EQ(f->find("final_state")->shape, (std::vector<int64_t>{1, 2, 8, 8}));
}

TEST(HostileCli, KdaRunRefusesHugeShapesBeforeAllocating) {
  k3::test::TempDir dir("hostile_huge");
  const std::string in = dir.file("in.safetensors"), out = dir.file("out.safetensors");
  // [0, 2^40, 2^40] holds no bytes but its H and K are absurd: refused before any product.
  write_kda_input(in, 0, int64_t{1} << 40, int64_t{1} << 40, 8);
  auto r = run_cli("kda run --input " + in + " --output " + out);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_HAS(r.out, "num_heads = 1099511627776 must be in [1, 1024]");
  // 300 empty sequences of H 1024 x K 512 x V 512 FP32 states: 322 GB of final_state, from a
  // 2.4 KB file. Refused naming the tensor, the bytes and the limit (was std::bad_alloc).
  std::vector<int64_t> cu(300, 0);
  write_kda_input(in, 0, 1024, 512, 512, &cu);
  r = run_cli("kda run --input " + in + " --output " + out);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_HAS(r.out, "output 'final_state' [N, H, K, V] = [299, 1024, 512, 512] needs 321048805376 bytes");
  EXPECT_HAS(r.out, "limit of 68719476736 bytes");
  EXPECT_EQ(r.out.find("bad_alloc"), std::string::npos) << r.out;
}

TEST(HostileCli, InspectEscapesControlCharactersInNames) {
  k3::test::TempDir dir("hostile_names");
  const std::string path = dir.file("m.safetensors");
  k3::st::Writer w;
  const std::vector<uint8_t> b = {1};
  ASSERT_TRUE(w.add("evil\x1b[2J\rname\n", k3::st::DType::kU8, {1}, b).is_ok());
  ASSERT_TRUE(w.write(path).is_ok());
  const auto r = run_cli("checkpoint inspect " + path);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_HAS(r.out, "evil\\x1b[2J\\x0dname\\x0a");
  EXPECT_EQ(r.out.find('\x1b'), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find('\r'), std::string::npos) << r.out;
  // JSON output escapes them the JSON way.
  const auto j = run_cli("checkpoint inspect --json " + path, false);
  EXPECT_EQ(j.out.find('\x1b'), std::string::npos) << j.out;
  EXPECT_HAS(j.out, "evil\\u001b[2J");
}

class HostileEpFlags : public ::testing::Test {
 protected:
  void SetUp() override {
    const k3::SynthOptions o = k3::test::small_synth_options(dir_.str());
    ASSERT_TRUE(k3::write_synthetic_checkpoint(o).is_ok());
  }
  k3::test::TempDir dir_{"hostile_ep"};
};

TEST_F(HostileEpFlags, ErrorsNameTheFlagNotTheConfig) {
  const std::string ck = dir_.str();
  struct Case {
    const char* flags;
    const char* want;
  };
  const Case cases[] = {
      {"--ep-size 2 --ep-rank 2", "--ep-size 2 --ep-rank 2: --ep-rank must be in [0, 2) (below --ep-size), got 2"},
      {"--ep-size 0 --ep-rank 0", "--ep-size 0 --ep-rank 0: --ep-size must be >= 1, got 0"},
      {"--ep-size 9 --ep-rank 0", "--ep-size 9 --ep-rank 0: --ep-size must be at most the checkpoint's 8 experts"},
      {"--ep-size 16 --ep-rank 1", "--ep-size 16 --ep-rank 1: --ep-size must be at most the checkpoint's 8 experts"},
  };
  for (const auto& c : cases) {
    auto r = run_cli("checkpoint inspect " + ck + " --summary --layer 1 " + c.flags);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_HAS(r.out, c.want);
    EXPECT_EQ(r.out.find("config.json: ep_"), std::string::npos) << r.out;
    r = run_cli("moe run --checkpoint " + ck + " --layer 1 --input " + dir_.file("none.st") + " --output " +
                dir_.file("o.st") + " " + c.flags);
    EXPECT_NE(r.code, 0) << r.out;
    r = run_cli("validate --op moe --suite smoke --backend reference --checkpoint " + ck + " --layer 1 " + c.flags);
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_HAS(r.out, c.want);
  }
}

TEST(HostileCli, SynthLayerRangeTooLargeNamesTheLimit) {
  k3::test::TempDir dir("hostile_layers");
  auto r = run_cli("checkpoint synth --output " + dir.file("ck") + " --layers 1-1000000");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_HAS(r.out, "--layers '1-1000000': the range 1-1000000 is too large (1000000 values, limit 4096 per range)");
  r = run_cli("checkpoint synth --output " + dir.file("ck") + " --layers 99999999999");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_HAS(r.out, "--layers '99999999999': 99999999999 is above the limit of 16777215");
}

TEST(HostileCli, BenchKdaRejectsNonPositiveSizesAsFlagErrors) {
  auto r = run_cli("bench kda --prefill-t -5");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_HAS(r.out, "--prefill-t");
  EXPECT_HAS(r.out, "-5");
  EXPECT_HAS(r.out, "not in range");
  r = run_cli("bench kda --prefill-t 0 --decode-n 1");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_HAS(r.out, "--prefill-t");
  r = run_cli("bench kda --prefill-t 8 --decode-n -1");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_HAS(r.out, "--decode-n");
}

TEST(HostileCli, BenchKdaBackendIsCheckedAndCudaSaysWhyItCannotRun) {
  auto r = run_cli("bench kda --backend gpu --prefill-t 8 --decode-n 1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_HAS(r.out, "--backend gpu is not known (cpu or cuda)");
  r = run_cli("bench kda --backend cuda --heads 1024 --head-dim 512 --prefill-t 1048576 --decode-n 1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_HAS(r.out, "--backend cuda: --prefill-t 1048576: the case's q, k, v, g, o needs");
  if (!k3::cuda::devices().is_ok()) {  // every CI machine: no device, the reason
    r = run_cli("bench kda --backend cuda --prefill-t 8 --decode-n 1");
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_HAS(r.out, "--backend cuda: ");
  }
}

TEST(HostileCli, BenchKdaRefusesCasesAboveTheMemoryLimitBeforeRunning) {
  // Checked before the limits are measured or anything is allocated (was std::bad_alloc).
  auto r = run_cli("bench kda --heads 1024 --head-dim 512 --prefill-t 1048576 --decode-n 1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_HAS(r.out, "--prefill-t 1048576: the case's q, k, v, g, o needs 10995116277760 bytes");
  r = run_cli("bench kda --heads 1024 --head-dim 512 --prefill-t 8 --decode-n 65536");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_HAS(r.out, "--decode-n 65536: the state pool of 131072 slots needs 140737488355328 bytes");
  EXPECT_EQ(r.out.find("bad_alloc"), std::string::npos) << r.out;
}

// Hardening, part 3 (items 10, 13, 14).

TEST(HostileCli, ValidateLinearFailsOnAnUnusableOrUnknownBackendAndAMissingRequirement) {
  // Was: one SKIP row and exit 0 (the other ops fail on the same flags).
  auto r = run_cli("validate --op linear --suite smoke --backend gpu");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_HAS(r.out, "linear backend 'gpu' is not known");
  EXPECT_HAS(r.out, "it runs on: ");
  r = run_cli("validate --op linear --suite smoke --backend cuda");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_HAS(r.out, "FAIL");
  if (!k3::cuda::devices().is_ok()) {  // every CI machine: no device
    r = run_cli("validate --op linear --suite smoke --require cuda");
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_HAS(r.out, "CUDA is not usable here");
  }
  r = run_cli("validate --op linear --suite smoke --require cpu");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_HAS(r.out, "require cpu");
}

TEST(HostileCli, BenchLinearRefusesWhatItCouldNotAllocateBeforeAllocating) {
  // Was: "INTERNAL: uncaught exception: std::bad_alloc", or tens of GiB allocated first.
  auto r = run_cli("bench linear --shapes 1048576x1048576 --pool-mib 1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_HAS(r.out, "k3 bench linear at these --shapes");
  EXPECT_HAS(r.out, "use smaller --shapes or --pool-mib");
  r = run_cli("bench linear --shapes 96x40 --pool-mib 65536 --bw-mib 65536");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_HAS(r.out, "--pool-mib 65536");
  EXPECT_EQ(r.out.find("bad_alloc"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("INTERNAL"), std::string::npos) << r.out;
}

TEST(HostileCli, K3NumThreadsMustBeAPlainCount) {
  // Was atoi: "1e3" ran 1 thread, "abc" all CPUs, an overflow wrapped.
  for (const char* bad : {"1e3", "abc", "-1", "99999999999", "4x", " 4", "0"}) {
    ScopedEnv env("K3_NUM_THREADS", bad);
    const auto r = run_cli("validate --op formats");
    EXPECT_EQ(r.code, 2) << bad << "\n" << r.out;
    EXPECT_HAS(r.out, std::string("K3_NUM_THREADS = '") + bad + "' is not a thread count");
    EXPECT_HAS(r.out, "[1, 256]");
  }
  for (const char* good : {"1", "+2", "256"}) {
    ScopedEnv env("K3_NUM_THREADS", good);
    EXPECT_EQ(run_cli("validate --op formats").code, 0) << good;
  }
  ScopedEnv empty("K3_NUM_THREADS", "");  // empty: as if unset
  EXPECT_EQ(run_cli("validate --op formats").code, 0);
}

TEST(HostileCli, ThreadsFlagsAreBoundedByTheLibraryLimit) {
  for (const char* cmd : {"bench moe --threads -1", "bench linear --threads 257", "bench kda --threads -1",
                          "kda run --threads 100000 --input /x.st --output /y.st"}) {
    const auto r = run_cli(cmd);
    EXPECT_NE(r.code, 0) << cmd << "\n" << r.out;
    EXPECT_HAS(r.out, "--threads");
    EXPECT_HAS(r.out, "256");
  }
  EXPECT_TRUE(k3::check_thread_count(k3::kMaxThreadCount).is_ok());
  EXPECT_TRUE(k3::check_thread_count(0).is_ok());
  const auto st = k3::check_thread_count(int64_t{1} << 40, "threads");
  ASSERT_FALSE(st.is_ok());
  EXPECT_HAS(st.message(), "threads = 1099511627776 must be in [0, 256]");
}

}  // namespace
