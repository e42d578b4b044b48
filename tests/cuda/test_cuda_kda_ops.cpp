// The small KDA ops on the device (k3/cuda_kda_ops.hpp) against the CPU ops and the FP64
// references (k3/kda_ops.hpp). The CudaKdaOps tests need a CUDA device and skip without one; the
// CudaKdaOpsChecks tests run anywhere (the size checks come before the device is touched).
// Ran on an H200 (2026-12-04): pass.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "k3/harness/kda_case.hpp"
#include "k3/cuda.hpp"
#include "k3/cuda_kda_ops.hpp"
#include "k3/kda_ops.hpp"

namespace k3 {
namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

std::vector<float> randn(size_t n, uint64_t seed, float s = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, s);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// Device copy of a host vector, freed on scope exit.
template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(const std::vector<T>& h) : n(h.size()) {
    if (cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(T) + 1) == cudaSuccess && n > 0) {
      cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice);
    }
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  std::vector<T> get() const {
    std::vector<T> h(n);
    if (n > 0) cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
  std::span<T> span() const { return {p, n}; }
};

class CudaKdaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    auto devs = cuda::devices();
    if (!devs.is_ok()) GTEST_SKIP() << "no CUDA device: " << devs.status().message();
    if (!devs.value()[0].runnable) GTEST_SKIP() << "device 0 is not among the compiled architectures " << cuda::compiled_archs();
  }
};

// Varlen batch with an empty sequence, a length-1 and a length-2 one (shorter than W - 1 for
// W = 4: the new state mixes old state and inputs); D = 137 spans two channel blocks and a tail.
TEST_F(CudaKdaOps, ConvMatchesTheCpuOpAndTheFp64Reference) {
  const int64_t D = 137;
  const std::vector<int64_t> cu = {0, 15, 16, 16, 18, 40};
  const int64_t T = 40, N = 5;
  const auto x = randn(T * D, 1), b = randn(D, 3);
  for (int64_t W = 2; W <= 4; ++W) {
    const auto w = randn(D * W, 2 + W, 0.5f), st0 = randn(N * D * (W - 1), 4 + W);
    for (bool with_bias : {false, true}) {
      for (bool with_state : {false, true}) {
        for (bool silu : {true, false}) {
          SCOPED_TRACE("W = " + std::to_string(W) + (with_bias ? ", bias" : ", no bias") +
                       (with_state ? ", conv_state" : ", no conv_state") + (silu ? ", SiLU" : ", no SiLU"));
          const std::span<const float> bias = with_bias ? std::span<const float>(b) : std::span<const float>();
          std::vector<float> y_ref(T * D), s_ref = st0, y_cpu(T * D), s_cpu = st0, y_gpu(T * D), s_gpu = st0;
          auto st = [&](std::vector<float>& s) { return with_state ? std::span<float>(s) : std::span<float>(); };
          ASSERT_TRUE(kda::causal_conv1d_reference({D, W, silu, x, w, bias, cu, st(s_ref), y_ref}).is_ok());
          ASSERT_TRUE(kda::causal_conv1d({D, W, silu, x, w, bias, cu, st(s_cpu), y_cpu}, 1).is_ok());
          const Status s = cuda::causal_conv1d_host({D, W, silu, x, w, bias, cu, st(s_gpu), y_gpu});
          ASSERT_TRUE(s.is_ok()) << s.to_string();
          EXPECT_EQ(s_gpu, s_cpu);  // copies of inputs: exact
          if (with_state) {
            EXPECT_NE(s_gpu, st0);
          }
          if (!silu) {
            EXPECT_EQ(y_gpu, y_cpu);  // the same roundings in the same order
          } else {
            for (size_t i = 0; i < y_gpu.size(); ++i) {
              ASSERT_NEAR(y_gpu[i], y_cpu[i], 2e-6 * std::max(1.0f, std::fabs(y_cpu[i]))) << "element " << i;
            }
          }
          const auto e = kda::compare(y_gpu, y_ref);
          EXPECT_LE(e.err_ratio, kda::kTolFp32);
        }
      }
    }
  }
}

// Decode: one token per sequence through the device API, conv_state staying on the device across
// calls, gives the bits of one varlen prefill over the same tokens.
TEST_F(CudaKdaOps, DecodeChainedAcrossCallsEqualsOnePrefill) {
  const int64_t D = 96, W = 4, N = 3, L = 7;  // 3 sequences of 7 tokens
  const auto x = randn(N * L * D, 11), w = randn(D * W, 12), b = randn(D, 13), st0 = randn(N * D * (W - 1), 14);
  std::vector<int64_t> cu_prefill(N + 1);
  for (int64_t n = 0; n <= N; ++n) cu_prefill[n] = n * L;
  std::vector<float> y_pre(N * L * D), s_pre = st0;
  ASSERT_TRUE(cuda::causal_conv1d_host({D, W, true, x, w, b, cu_prefill, s_pre, y_pre}).is_ok());

  std::vector<int64_t> cu_decode(N + 1);
  for (int64_t n = 0; n <= N; ++n) cu_decode[n] = n;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  Dev<float> dw(w), db(b), ds(st0);
  Dev<int64_t> dcu(cu_decode);
  std::vector<float> y_dec(N * L * D);
  for (int64_t t = 0; t < L; ++t) {
    std::vector<float> xt(N * D);  // token t of every sequence
    for (int64_t n = 0; n < N; ++n) {
      std::copy_n(x.begin() + (n * L + t) * D, D, xt.begin() + n * D);
    }
    Dev<float> dx(xt), dy(std::vector<float>(N * D));
    const Status s = cuda::causal_conv1d({D, W, true, dx.span(), dw.span(), db.span(), dcu.span(), ds.span(), dy.span()},
                                         stream);
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    CUDA_OK(cudaStreamSynchronize(stream));
    const auto yt = dy.get();
    for (int64_t n = 0; n < N; ++n) std::copy_n(yt.begin() + n * D, D, y_dec.begin() + (n * L + t) * D);
  }
  CUDA_OK(cudaStreamDestroy(stream));
  EXPECT_EQ(y_dec, y_pre);
  EXPECT_EQ(ds.get(), s_pre);
}

// cu_seqlens' entries are device data: out-of-range and out-of-order values are clamped to [0, T],
// never read or written out of bounds, and give the results documented in k3/cuda_kda_ops.hpp.
TEST_F(CudaKdaOps, MalformedCuSeqlensAreClampedOnTheDevice) {
  const int64_t D = 5, W = 3, T = 4;
  const auto x = randn(T * D, 21), w = randn(D * W, 22);
  const float sentinel = -12345.0f;
  // {0, -5, 100, 3} clamps to {0, 0, 4, 3}: sequence 0 empty, 1 = [0, 4), 2 reversed (empty).
  {
    const std::vector<int64_t> bad = {0, -5, 100, 3}, good = {0, 0, 4, 4};
    const int64_t N = 3;
    const auto st0 = randn(N * D * (W - 1), 23);
    std::vector<float> y_cpu(T * D), s_cpu = st0;
    ASSERT_TRUE(kda::causal_conv1d({D, W, false, x, w, {}, good, s_cpu, y_cpu}, 1).is_ok());
    std::vector<float> y_pad(T * D + 64, sentinel), s_pad = st0;
    s_pad.resize(st0.size() + 64, sentinel);
    Dev<float> dx(x), dw(w), dy(y_pad), ds(s_pad);
    Dev<int64_t> dcu(bad);
    const Status s = cuda::causal_conv1d(
        {D, W, false, dx.span(), dw.span(), {}, dcu.span(), ds.span().first(st0.size()), dy.span().first(T * D)}, nullptr);
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    CUDA_OK(cudaDeviceSynchronize());
    const auto y = dy.get(), st = ds.get();
    EXPECT_EQ(std::vector<float>(y.begin(), y.begin() + T * D), y_cpu);
    EXPECT_EQ(std::vector<float>(st.begin(), st.begin() + st0.size()), s_cpu);
    for (size_t i = T * D; i < y.size(); ++i) ASSERT_EQ(y[i], sentinel) << "write past y at " << i;
    for (size_t i = st0.size(); i < st.size(); ++i) ASSERT_EQ(st[i], sentinel) << "write past conv_state at " << i;
  }
  // Extreme values: clamped {2, 3, 0, 4}: sequence 0 = [2, 3), 1 = [3, 0) reversed (empty),
  // 2 = [0, 4). The state rows depend on the clamped bounds alone; nothing is written past y or
  // conv_state.
  {
    const std::vector<int64_t> bad = {2, 3, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()};
    const int64_t N = 3;
    const auto st0 = randn(N * D * (W - 1), 24);
    std::vector<float> y_pad(T * D + 64, sentinel), s_pad = st0;
    s_pad.resize(st0.size() + 64, sentinel);
    Dev<float> dx(x), dw(w), dy(y_pad), ds(s_pad);
    Dev<int64_t> dcu(bad);
    const Status s = cuda::causal_conv1d(
        {D, W, true, dx.span(), dw.span(), {}, dcu.span(), ds.span().first(st0.size()), dy.span().first(T * D)}, nullptr);
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    CUDA_OK(cudaDeviceSynchronize());
    const auto y = dy.get(), st = ds.get();
    for (int64_t c = 0; c < D; ++c) {
      const int64_t r0 = (0 * D + c) * (W - 1), r1 = (1 * D + c) * (W - 1), r2 = (2 * D + c) * (W - 1);
      EXPECT_EQ(st[r0], st0[r0 + 1]) << c;  // one token: the old latest entry, then x[2]
      EXPECT_EQ(st[r0 + 1], x[2 * D + c]) << c;
      EXPECT_EQ(st[r1], st0[r1]) << c;  // empty: kept
      EXPECT_EQ(st[r1 + 1], st0[r1 + 1]) << c;
      EXPECT_EQ(st[r2], x[2 * D + c]) << c;  // four tokens: x[2], x[3]
      EXPECT_EQ(st[r2 + 1], x[3 * D + c]) << c;
    }
    for (size_t i = T * D; i < y.size(); ++i) ASSERT_EQ(y[i], sentinel) << "write past y at " << i;
    for (size_t i = st0.size(); i < st.size(); ++i) ASSERT_EQ(st[i], sentinel) << "write past conv_state at " << i;
  }
  {
    const std::vector<int64_t> bad = {2, 3};  // one sequence [2, 3): tokens 0, 1 and 3 are outside
    std::vector<float> y_pad(T * D + 64, sentinel);
    Dev<float> dx(x), dw(w), dy(y_pad);
    Dev<int64_t> dcu(bad);
    ASSERT_TRUE(cuda::causal_conv1d({D, W, false, dx.span(), dw.span(), {}, dcu.span(), {}, dy.span().first(T * D)},
                                    nullptr)
                    .is_ok());
    CUDA_OK(cudaDeviceSynchronize());
    const auto y = dy.get();
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t c = 0; c < D; ++c) {
        const float v = y[t * D + c];
        if (t == 2) {  // the first token of the sequence, no state: weight[c, W - 1] * x
          EXPECT_EQ(v, w[c * W + W - 1] * x[t * D + c]) << "t " << t << " c " << c;
        } else {
          EXPECT_TRUE(std::isnan(v)) << "t " << t << " c " << c << " = " << v;
        }
      }
    }
    for (size_t i = T * D; i < y.size(); ++i) ASSERT_EQ(y[i], sentinel) << "write past y at " << i;
  }
}

TEST_F(CudaKdaOps, RmsNormMatchesTheCpuOpAndTheFp64ReferenceAndIsDeterministic) {
  for (int64_t D : {1, 33, 60, 128, 300}) {
    SCOPED_TRACE("D = " + std::to_string(D));
    const int64_t rows = 3 * 19;
    const auto x = randn(rows * D, 1 + D, 3.0f), g = randn(rows * D, 2 + D, 4.0f), w = randn(D, 3 + D);
    std::vector<float> y_ref(rows * D), y_cpu(rows * D), y_gpu(rows * D), y_again(rows * D);
    ASSERT_TRUE(kda::gated_rmsnorm_reference({D, 1e-5f, x, g, w, y_ref}).is_ok());
    ASSERT_TRUE(kda::gated_rmsnorm({D, 1e-5f, x, g, w, y_cpu}, 1).is_ok());
    const Status s = cuda::gated_rmsnorm_host({D, 1e-5f, x, g, w, y_gpu});
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    ASSERT_TRUE(cuda::gated_rmsnorm_host({D, 1e-5f, x, g, w, y_again}).is_ok());
    EXPECT_EQ(y_gpu, y_again);
    for (size_t i = 0; i < y_gpu.size(); ++i) {
      ASSERT_NEAR(y_gpu[i], y_cpu[i], 4e-6 * std::max(1.0f, std::fabs(y_cpu[i]))) << "element " << i;
    }
    EXPECT_LE(kda::compare(y_gpu, y_ref).err_ratio, kda::kTolFp32);
  }
}

// ---- without a device --------------------------------------------------------------------------

// Host buffers stand in for device ones: every call below fails its size check before any launch.
TEST(CudaKdaOpsChecks, ConvSizesAreCheckedBeforeTheDevice) {
  const std::vector<float> x(12), w(12), b(3);
  std::vector<float> y(12), st(9);
  const std::vector<int64_t> cu = {0, 1, 4};  // N = 2
  auto device = [](const kda::ConvArgs& a) { return cuda::causal_conv1d(a, nullptr); };
  auto host = [](const kda::ConvArgs& a) { return cuda::causal_conv1d_host(a); };
  struct Case {
    kda::ConvArgs a;
    const char* message;
  };
  const Case cases[] = {
      {{3, 4, true, x, w, b, {}, std::span<float>(st).first(4), y}, "conv_state has 4 elements, expected 9 ([N, D, W - 1])"},
      {{3, 4, true, x, w, b, cu, st, y}, "conv_state has 9 elements, expected 18 ([N, D, W - 1])"},
      {{3, 4, true, x, w, b, {}, st, std::span<float>(y).first(3)}, "y has 3 elements, expected 12 ([T, D])"},
      {{3, 9, true, x, w, b, {}, st, y}, "width = 9 must be in [2, 8]"},
      {{3, 1, true, x, w, b, {}, st, y}, "width = 1 must be in [2, 8]"},
      {{0, 4, true, x, w, b, {}, st, y}, "channels = 0 must be >= 1"},
      {{5, 4, true, x, w, b, {}, st, y}, "x has 12 elements, not a multiple of D = 5 ([T, D])"},
      {{3, 4, true, x, std::span<const float>(w).first(5), b, {}, st, y}, "weight has 5 elements, expected 12 ([D, W])"},
      {{3, 4, true, x, w, std::span<const float>(b).first(2), {}, st, y}, "bias has 2 elements, expected 3 ([D])"},
      {{3, 4, true, x, w, b, std::span<const int64_t>(cu).first(1), {}, y},
       "cu_seqlens has 1 entries, needs at least 2 ([N + 1], N >= 1)"},
  };
  for (const Case& c : cases) {
    const Status d = device(c.a), h = host(c.a);
    EXPECT_EQ(d.code(), StatusCode::kInvalidArgument) << d.to_string();
    EXPECT_EQ(d.message(), std::string("cuda::causal_conv1d: ") + c.message);
    EXPECT_EQ(h.code(), StatusCode::kInvalidArgument) << h.to_string();
    EXPECT_EQ(h.message(), std::string("cuda::causal_conv1d_host: ") + c.message);
  }
  // The host call also checks cu_seqlens' entries (host data there).
  const std::vector<int64_t> bad = {0, 3, 2, 4};
  std::vector<float> st3(27);
  EXPECT_EQ(host({3, 4, true, x, w, b, bad, st3, y}).message(),
            "cuda::causal_conv1d_host: cu_seqlens[2] = 2 is below cu_seqlens[1] = 3 (must be non-decreasing)");
  const std::vector<int64_t> short_end = {0, 3};
  EXPECT_EQ(host({3, 4, true, x, w, b, short_end, {}, y}).message(),
            "cuda::causal_conv1d_host: cu_seqlens[1] (the last entry) = 3 must equal the token count T = 4");
}

TEST(CudaKdaOpsChecks, RmsNormSizesAreCheckedBeforeTheDevice) {
  const std::vector<float> x(8), g(8), w(4);
  std::vector<float> y(8);
  struct Case {
    kda::GatedRmsNormArgs a;
    const char* message;
  };
  const Case cases[] = {
      {{0, 1e-5f, x, g, w, y}, "dim = 0 must be >= 1"},
      {{3, 1e-5f, x, g, w, y}, "x has 8 elements, not a multiple of D = 3 ([rows, D])"},
      {{4, 1e-5f, x, std::span<const float>(g).first(4), w, y}, "gate has 4 elements, expected 8 ([rows, D])"},
      {{4, 1e-5f, x, g, std::span<const float>(w).first(2), y}, "weight has 2 elements, expected 4 ([D])"},
      {{4, 1e-5f, x, g, w, std::span<float>(y).first(4)}, "y has 4 elements, expected 8 ([rows, D])"},
  };
  for (const Case& c : cases) {
    const Status d = cuda::gated_rmsnorm(c.a, nullptr), h = cuda::gated_rmsnorm_host(c.a);
    EXPECT_EQ(d.code(), StatusCode::kInvalidArgument) << d.to_string();
    EXPECT_EQ(d.message(), std::string("cuda::gated_rmsnorm: ") + c.message);
    EXPECT_EQ(h.code(), StatusCode::kInvalidArgument) << h.to_string();
    EXPECT_EQ(h.message(), std::string("cuda::gated_rmsnorm_host: ") + c.message);
  }
  const Status eps = cuda::gated_rmsnorm({4, 0.0f, x, g, w, y}, nullptr);
  EXPECT_NE(eps.message().find("cuda::gated_rmsnorm: eps = 0.000000 must be finite and > 0"), std::string::npos)
      << eps.message();
}

// Valid host calls without a device: kUnavailable from the device check (with one: they run).
TEST(CudaKdaOpsChecks, ValidHostCallsWithoutADeviceAreUnavailable) {
  if (cuda::devices().is_ok()) GTEST_SKIP() << "a CUDA device is present: the CudaKdaOps tests run the ops";
  const std::vector<float> x(12), w(12), g(12), wn(3);
  std::vector<float> y(12), st(9);
  const Status c = cuda::causal_conv1d_host({3, 4, true, x, w, {}, {}, st, y});
  EXPECT_EQ(c.code(), StatusCode::kUnavailable) << c.to_string();
  const Status r = cuda::gated_rmsnorm_host({3, 1e-5f, x, g, wn, y});
  EXPECT_EQ(r.code(), StatusCode::kUnavailable) << r.to_string();
}

}  // namespace
}  // namespace k3
