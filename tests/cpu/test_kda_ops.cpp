// Small KDA ops: causal conv + SiLU with rolling state, gated RMSNorm; references and CPU ops.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "k3/formats.hpp"
#include "k3/kda_ops.hpp"

namespace k3::kda {
namespace {

std::vector<float> randn(size_t n, uint64_t seed, float s = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, s);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

double silu(double z) { return z / (1.0 + std::exp(-z)); }

TEST(KdaConv, TinyCaseByHand) {
  // D = 1, W = 4, weights 1..4, inputs 1, 2, 3 after a state (10, 20, 30).
  const std::vector<float> x = {1, 2, 3}, w = {1, 2, 3, 4}, b = {0.5f};
  std::vector<float> state = {10, 20, 30}, y(3);
  for (bool use_ref : {true, false}) {
    std::vector<float> st = state;
    ConvArgs a{1, 4, true, x, w, b, {}, st, y};
    ASSERT_TRUE((use_ref ? causal_conv1d_reference(a) : causal_conv1d(a, 1)).is_ok());
    EXPECT_NEAR(y[0], silu(0.5 + 1 * 10 + 2 * 20 + 3 * 30 + 4 * 1), 1e-4);
    EXPECT_NEAR(y[1], silu(0.5 + 1 * 20 + 2 * 30 + 3 * 1 + 4 * 2), 1e-4);
    EXPECT_NEAR(y[2], silu(0.5 + 1 * 30 + 2 * 1 + 3 * 2 + 4 * 3), 1e-4);
    EXPECT_EQ(st, (std::vector<float>{1, 2, 3}));
  }
  // A one-token sequence keeps two of the old state entries.
  std::vector<float> st = state, y1(1);
  const std::vector<float> x1 = {7};
  ConvArgs a{1, 4, false, x1, w, {}, {}, st, y1};
  ASSERT_TRUE(causal_conv1d(a, 1).is_ok());
  EXPECT_FLOAT_EQ(y1[0], 1 * 10 + 2 * 20 + 3 * 30 + 4 * 7);
  EXPECT_EQ(st, (std::vector<float>{20, 30, 7}));
}

TEST(KdaConv, MatchesReferenceWithVarlenAndIsBitIdenticalOverThreads) {
  const int64_t D = 137, W = 4;
  const std::vector<int64_t> cu = {0, 15, 16, 16, 36};
  const int64_t T = 36, N = 4;
  const auto x = randn(T * D, 1), w = randn(D * W, 2, 0.5f), b = randn(D, 3);
  const auto st0 = randn(N * D * (W - 1), 4);
  for (bool silu_on : {true, false}) {
    std::vector<float> yr(T * D), sr = st0;
    ASSERT_TRUE(causal_conv1d_reference({D, W, silu_on, x, w, b, cu, sr, yr}).is_ok());
    std::vector<float> y1, s1;
    for (int threads : {1, 2, 3}) {
      std::vector<float> y(T * D), s = st0;
      ASSERT_TRUE(causal_conv1d({D, W, silu_on, x, w, b, cu, s, y}, threads).is_ok());
      EXPECT_EQ(s, sr);  // the state is a copy of inputs: exact
      for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y[i], yr[i], 1e-5 * (1 + std::fabs(yr[i]))) << i;
      if (threads == 1) {
        y1 = y;
        s1 = s;
      } else {
        EXPECT_EQ(y, y1);
        EXPECT_EQ(s, s1);
      }
    }
  }
}

TEST(KdaConv, DecodeStepsEqualOnePrefill) {
  // Rolling state: token-by-token calls give the same bits as one call over the sequence.
  const int64_t D = 40, W = 4, T = 9;
  const auto x = randn(T * D, 5), w = randn(D * W, 6), b = randn(D, 7);
  const auto st0 = randn(D * (W - 1), 8);
  std::vector<float> y(T * D), s = st0;
  ASSERT_TRUE(causal_conv1d({D, W, true, x, w, b, {}, s, y}, 2).is_ok());
  std::vector<float> s2 = st0, y2(T * D);
  for (int64_t t = 0; t < T; ++t) {
    ASSERT_TRUE(causal_conv1d({D, W, true, std::span<const float>(x).subspan(t * D, D), w, b, {}, s2,
                               std::span<float>(y2).subspan(t * D, D)},
                              1)
                    .is_ok());
  }
  EXPECT_EQ(y, y2);
  EXPECT_EQ(s, s2);
}

TEST(KdaConv, Errors) {
  const std::vector<float> x(12), w(12), b(3);
  std::vector<float> y(12), st(9);
  auto msg = [](const ConvArgs& a) { return causal_conv1d(a).message(); };
  EXPECT_NE(msg({3, 9, true, x, w, b, {}, st, y}).find("width = 9 must be in [2, 8]"), std::string::npos);
  EXPECT_NE(msg({0, 4, true, x, w, b, {}, st, y}).find("channels = 0"), std::string::npos);
  EXPECT_NE(msg({5, 4, true, x, w, b, {}, st, y}).find("not a multiple of D = 5"), std::string::npos);
  EXPECT_NE(msg({3, 4, true, x, std::span<const float>(w).first(5), b, {}, st, y}).find("weight has 5 elements"),
            std::string::npos);
  EXPECT_NE(msg({3, 4, true, x, w, std::span<const float>(b).first(2), {}, st, y}).find("bias has 2"), std::string::npos);
  EXPECT_NE(msg({3, 4, true, x, w, b, {}, std::span<float>(st).first(4), y}).find("conv_state has 4 elements, expected 9"),
            std::string::npos);
  EXPECT_NE(msg({3, 4, true, x, w, b, {}, st, std::span<float>(y).first(3)}).find("y has 3"), std::string::npos);
  const std::vector<int64_t> cu = {0, 3, 2, 4};
  EXPECT_NE(msg({3, 4, true, x, w, b, cu, {}, y}).find("cu_seqlens[2] = 2 is below"), std::string::npos);
  const std::vector<int64_t> cu_end = {0, 3};
  EXPECT_NE(msg({3, 4, true, x, w, b, cu_end, {}, y}).find("cu_seqlens[1] (the last entry) = 3 must equal the token count T = 4"), std::string::npos);
  EXPECT_NE(causal_conv1d({3, 4, true, x, w, b, {}, st, y}, -2).message().find("threads = -2"), std::string::npos);
}

TEST(KdaConv, LongerStateByHand) {
  // transformers' cache layout: S = W entries per channel, the oldest unused by the window.
  const std::vector<float> w = {1, 2, 3, 4}, x1 = {7};
  std::vector<float> st = {5, 10, 20, 30}, y1(1);
  ConvArgs a{1, 4, false, x1, w, {}, {}, st, y1, 4};
  ASSERT_TRUE(causal_conv1d(a, 1).is_ok());
  EXPECT_FLOAT_EQ(y1[0], 1 * 10 + 2 * 20 + 3 * 30 + 4 * 7);
  EXPECT_EQ(st, (std::vector<float>{10, 20, 30, 7}));
  // S = 6, two tokens: the four newest old entries shift down, then the tokens.
  std::vector<float> st6 = {1, 2, 3, 4, 5, 6}, y2(2);
  const std::vector<float> x2 = {8, 9};
  ASSERT_TRUE(causal_conv1d({1, 4, false, x2, w, {}, {}, st6, y2, 6}, 1).is_ok());
  EXPECT_FLOAT_EQ(y2[0], 1 * 4 + 2 * 5 + 3 * 6 + 4 * 8);
  EXPECT_FLOAT_EQ(y2[1], 1 * 5 + 2 * 6 + 3 * 8 + 4 * 9);
  EXPECT_EQ(st6, (std::vector<float>{3, 4, 5, 6, 8, 9}));
}

TEST(KdaConv, LongerStateMatchesReferenceAndTheShortStateOutputs) {
  // Sequences longer, shorter and empty against S: the reference's state and outputs, every
  // thread count; the outputs equal those of S = W - 1 fed the newest W - 1 state entries.
  const int64_t D = 70, W = 4;
  const std::vector<int64_t> cu = {0, 9, 10, 10, 13};
  const int64_t T = 13, N = 4;
  const auto x = randn(T * D, 11), w = randn(D * W, 12, 0.5f), b = randn(D, 13);
  for (int64_t S : {4, 6}) {
    const auto st0 = randn(N * D * S, 14);
    std::vector<float> yr(T * D), sr = st0;
    ASSERT_TRUE(causal_conv1d_reference({D, W, true, x, w, b, cu, sr, yr, S}).is_ok());
    std::vector<float> short_state(N * D * (W - 1)), ys(T * D);
    for (int64_t r = 0; r < N * D; ++r) {
      for (int64_t j = 0; j < W - 1; ++j) short_state[r * (W - 1) + j] = st0[r * S + S - (W - 1) + j];
    }
    ASSERT_TRUE(causal_conv1d({D, W, true, x, w, b, cu, short_state, ys}, 1).is_ok());
    for (int threads : {1, 2, 3}) {
      std::vector<float> y(T * D), s = st0;
      ASSERT_TRUE(causal_conv1d({D, W, true, x, w, b, cu, s, y, S}, threads).is_ok());
      EXPECT_EQ(s, sr) << "S " << S;  // inputs only: exact
      EXPECT_EQ(y, ys) << "S " << S;
      for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y[i], yr[i], 1e-5 * (1 + std::fabs(yr[i]))) << i;
    }
  }
}

TEST(KdaConv, Bf16StorageIsTheFp32OpOnWidenedValuesRoundedOnce) {
  const int64_t D = 150, W = 4, S = 4;
  const std::vector<int64_t> cu = {0, 1, 2, 7};  // two decode rows and a 5-token sequence
  const int64_t T = 7, N = 3;
  auto bf = [](const std::vector<float>& v) {
    std::vector<uint16_t> o(v.size());
    for (size_t i = 0; i < v.size(); ++i) o[i] = bf16_from_f32(v[i]);
    return o;
  };
  auto widen = [](const std::vector<uint16_t>& v) {
    std::vector<float> o(v.size());
    for (size_t i = 0; i < v.size(); ++i) o[i] = bf16_to_f32(v[i]);
    return o;
  };
  const auto xb = bf(randn(T * D, 21)), wb = bf(randn(D * W, 22, 0.5f)), sb0 = bf(randn(N * D * S, 23));
  const auto b = randn(D, 24);
  const auto xf = widen(xb), wf = widen(wb);
  std::vector<float> yf(T * D), sf = widen(sb0);
  ASSERT_TRUE(causal_conv1d({D, W, true, xf, wf, b, cu, sf, yf, S}, 1).is_ok());
  for (int threads : {1, 2, 3}) {
    std::vector<uint16_t> y(T * D), s = sb0;
    ASSERT_TRUE(causal_conv1d_bf16({D, W, true, xb, wb, b, cu, s, y, S}, threads).is_ok());
    for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], bf16_from_f32(yf[i])) << i;
    EXPECT_EQ(widen(s), sf);
  }
  std::vector<uint16_t> y(T * D), s(5);
  EXPECT_EQ(causal_conv1d_bf16({D, W, true, xb, wb, b, cu, s, y, S}).message(),
            "conv_state has 5 elements, expected 1800 ([N, D, state_len])");
}

TEST(KdaConv, StateLenOutOfRangeIsRefusedByName) {
  const std::vector<float> x(12), w(12);
  std::vector<float> y(12), st(30);
  EXPECT_EQ(causal_conv1d({3, 4, true, x, w, {}, {}, st, y, 2}).message(),
            "state_len = 2 must be 0 (W - 1) or in [W - 1 = 3, 64]");
  EXPECT_EQ(causal_conv1d({3, 4, true, x, w, {}, {}, st, y, 65}).message(),
            "state_len = 65 must be 0 (W - 1) or in [W - 1 = 3, 64]");
  EXPECT_EQ(causal_conv1d({3, 4, true, x, w, {}, {}, st, y, 4}).message(),
            "conv_state has 30 elements, expected 12 ([N, D, state_len])");
}

TEST(KdaConv, SizesOnlyCheckReadsNoCuSeqlensEntry) {
  // validate_conv_sizes (for device spans) checks everything validate_conv checks except the
  // entries of cu_seqlens, with the same messages.
  const std::vector<float> x(12), w(12), b(3);
  std::vector<float> y(12), st(27);
  int64_t T = 0, N = 0;
  const std::vector<int64_t> bad = {0, 3, 2, 4};  // N = 3, entries out of order
  const ConvArgs a{3, 4, true, x, w, b, bad, st, y};
  EXPECT_EQ(detail::validate_conv(a, &T, &N).message(),
            "cu_seqlens[2] = 2 is below cu_seqlens[1] = 3 (must be non-decreasing)");
  ASSERT_TRUE(detail::validate_conv_sizes(a, &T, &N).is_ok());
  EXPECT_EQ(T, 4);
  EXPECT_EQ(N, 3);
  // conv_state is sized from cu_seqlens' size: N = 3 rows of D (W - 1) = 9.
  EXPECT_EQ(detail::validate_conv_sizes({3, 4, true, x, w, b, bad, std::span<float>(st).first(9), y}, &T, &N).message(),
            "conv_state has 9 elements, expected 27 ([N, D, W - 1])");
  const std::vector<int64_t> one = {0};
  for (auto* check : {&detail::validate_conv, &detail::validate_conv_sizes}) {
    EXPECT_EQ(check({3, 4, true, x, w, b, one, {}, y}, &T, &N).message(),
              "cu_seqlens has 1 entries, needs at least 2 ([N + 1], N >= 1)");
    EXPECT_EQ(check({3, 4, true, x, w, b, {}, st, y}, &T, &N).message(),
              "conv_state has 27 elements, expected 9 ([N, D, W - 1])");
    EXPECT_EQ(check({3, 4, true, x, w, b, {}, {}, std::span<float>(y).first(3)}, &T, &N).message(),
              "y has 3 elements, expected 12 ([T, D])");
    EXPECT_EQ(check({3, 1, true, x, w, b, {}, {}, y}, &T, &N).message(), "width = 1 must be in [2, 8]");
  }
}

TEST(KdaRmsNorm, TinyCaseByHand) {
  const std::vector<float> x = {3, 4}, g = {0, 100}, w = {2, 0.5f};
  std::vector<float> y(2);
  for (bool use_ref : {true, false}) {
    GatedRmsNormArgs a{2, 1e-5f, x, g, w, y};
    ASSERT_TRUE((use_ref ? gated_rmsnorm_reference(a) : gated_rmsnorm(a, 1)).is_ok());
    const double inv = 1.0 / std::sqrt((9.0 + 16.0) / 2.0 + 1e-5);
    EXPECT_NEAR(y[0], 3 * inv * 2 * 0.5, 1e-6);
    EXPECT_NEAR(y[1], 4 * inv * 0.5 * 1.0, 1e-6);
  }
}

TEST(KdaRmsNorm, MatchesReferenceAndIsBitIdenticalOverThreads) {
  const int64_t D = 100, rows = 3 * 19;
  const auto x = randn(rows * D, 1, 3.0f), g = randn(rows * D, 2), w = randn(D, 3);
  std::vector<float> yr(rows * D);
  ASSERT_TRUE(gated_rmsnorm_reference({D, 1e-5f, x, g, w, yr}).is_ok());
  std::vector<float> y1;
  for (int threads : {1, 2, 3}) {
    std::vector<float> y(rows * D);
    ASSERT_TRUE(gated_rmsnorm({D, 1e-5f, x, g, w, y}, threads).is_ok());
    for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y[i], yr[i], 1e-5 * (1 + std::fabs(yr[i])));
    if (threads == 1) y1 = y;
    else EXPECT_EQ(y, y1);
  }
}

TEST(KdaRmsNorm, Errors) {
  const std::vector<float> x(8), g(8), w(4);
  std::vector<float> y(8);
  auto msg = [](const GatedRmsNormArgs& a) { return gated_rmsnorm(a).message(); };
  EXPECT_NE(msg({0, 1e-5f, x, g, w, y}).find("dim = 0"), std::string::npos);
  EXPECT_NE(msg({3, 1e-5f, x, g, w, y}).find("not a multiple of D = 3"), std::string::npos);
  EXPECT_NE(msg({4, 0.0f, x, g, w, y}).find("eps"), std::string::npos);
  EXPECT_NE(msg({4, 1e-5f, x, std::span<const float>(g).first(4), w, y}).find("gate has 4 elements, expected 8"),
            std::string::npos);
  EXPECT_NE(msg({4, 1e-5f, x, g, std::span<const float>(w).first(2), y}).find("weight has 2"), std::string::npos);
  EXPECT_NE(msg({4, 1e-5f, x, g, w, std::span<float>(y).first(4)}).find("y has 4"), std::string::npos);
  EXPECT_NE(gated_rmsnorm({4, 1e-5f, x, g, w, y}, -1).message().find("threads = -1"), std::string::npos);
}

}  // namespace
}  // namespace k3::kda
