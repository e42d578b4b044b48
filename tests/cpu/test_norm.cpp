// RMSNorm of rows (k3/norm.hpp): against the FP64 oracle, thread counts, in place, errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "k3/formats.hpp"
#include "k3/norm.hpp"

namespace k3 {
namespace {

template <typename T>
std::vector<T> random_values(size_t n, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<T> v(n);
  for (auto& x : v) {
    if constexpr (std::is_same_v<T, float>) {
      x = nd(rng);
    } else {
      x = bf16_from_f32(nd(rng));
    }
  }
  return v;
}

float as_float(float v) { return v; }
float as_float(uint16_t v) { return bf16_to_f32(v); }

// The largest distance from the oracle in units of the storage type's last place at the value.
template <typename T>
double max_ulps(const std::vector<T>& got, const std::vector<T>& want) {
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float g = as_float(got[i]), w = as_float(want[i]);
    const int e = w == 0.0f ? -126 : std::ilogb(w);
    const double ulp = std::ldexp(1.0, e - (std::is_same_v<T, float> ? 23 : 7));
    worst = std::max(worst, std::fabs(double(g) - w) / ulp);
  }
  return worst;
}

template <typename T>
void check_against_oracle(double bound) {
  for (int64_t D : {2304, 64, 37, 1}) {
    const int64_t rows = 9;
    const auto x = random_values<T>(static_cast<size_t>(rows * D), 11 + D, 3.0f);
    const auto w = random_values<T>(static_cast<size_t>(D), 5 + D, 1.0f);
    std::vector<T> want(x.size()), got(x.size());
    ASSERT_TRUE(rms_norm_oracle(RmsNormArgs<T>{D, 1e-6f, x, w, want}).is_ok());
    ASSERT_TRUE(rms_norm(RmsNormArgs<T>{D, 1e-6f, x, w, got}, 1).is_ok());
    EXPECT_LE(max_ulps(got, want), bound) << "D " << D;
    for (int threads : {2, 3, 0}) {  // the same bits on every thread count
      std::vector<T> again(x.size());
      ASSERT_TRUE(rms_norm(RmsNormArgs<T>{D, 1e-6f, x, w, again}, threads).is_ok());
      EXPECT_EQ(0, std::memcmp(again.data(), got.data(), got.size() * sizeof(T))) << threads;
    }
    std::vector<T> inplace = x;  // y may be x
    ASSERT_TRUE(rms_norm(RmsNormArgs<T>{D, 1e-6f, inplace, w, inplace}, 2).is_ok());
    EXPECT_EQ(0, std::memcmp(inplace.data(), got.data(), got.size() * sizeof(T)));
  }
}

// Two roundings to the storage type (h, then w * h), each within half a unit; a last-bit
// difference of S moves h by at most one more unit of FP32 before its rounding.
TEST(RmsNorm, Bf16AgreesWithTheOracleWithinTheRoundings) { check_against_oracle<uint16_t>(2.0); }
TEST(RmsNorm, Fp32AgreesWithTheOracleWithinTheRoundings) { check_against_oracle<float>(4.0); }

template <typename T>
void check_gated_against_oracle(double bound) {
  for (int64_t D : {128, 64, 37, 1}) {
    const int64_t rows = 33;  // one decode step's heads, and one more
    const auto x = random_values<T>(static_cast<size_t>(rows * D), 21 + D, 2.0f);
    const auto g = random_values<T>(x.size(), 31 + D, 3.0f);
    const auto w = random_values<T>(static_cast<size_t>(D), 41 + D, 1.0f);
    std::vector<T> want(x.size()), got(x.size());
    ASSERT_TRUE(rms_norm_gated_oracle(GatedRmsNormRowsArgs<T>{D, 1e-5f, x, g, w, want}).is_ok());
    ASSERT_TRUE(rms_norm_gated(GatedRmsNormRowsArgs<T>{D, 1e-5f, x, g, w, got}, 1).is_ok());
    EXPECT_LE(max_ulps(got, want), bound) << "D " << D;
    for (int threads : {2, 3, 0}) {
      std::vector<T> again(x.size());
      ASSERT_TRUE(rms_norm_gated(GatedRmsNormRowsArgs<T>{D, 1e-5f, x, g, w, again}, threads).is_ok());
      EXPECT_EQ(0, std::memcmp(again.data(), got.data(), got.size() * sizeof(T))) << threads;
    }
    std::vector<T> inplace = x;
    ASSERT_TRUE(rms_norm_gated(GatedRmsNormRowsArgs<T>{D, 1e-5f, inplace, g, w, inplace}, 2).is_ok());
    EXPECT_EQ(0, std::memcmp(inplace.data(), got.data(), got.size() * sizeof(T)));
  }
}

// One rounding to the storage type after FP32 steps (r, three products, the sigmoid's exp and
// division: a few FP32 ulps, far below a BF16 step).
TEST(RmsNormGated, Bf16AgreesWithTheOracleWithinOneRounding) { check_gated_against_oracle<uint16_t>(1.0); }
TEST(RmsNormGated, Fp32AgreesWithTheOracleWithinTheFp32Steps) { check_gated_against_oracle<float>(8.0); }

TEST(RmsNormGated, RefusesAGateOfAnotherSize) {
  const std::vector<float> x(6, 1.0f), g(5, 1.0f), w(3, 1.0f);
  std::vector<float> y(6);
  EXPECT_NE(rms_norm_gated(GatedRmsNormRowsArgs<float>{3, 1e-6f, x, g, w, y}).message().find(
                "gate has 5 values, x has 6"),
            std::string::npos);
  EXPECT_NE(rms_norm_gated(GatedRmsNormRowsArgs<float>{3, 1e-6f, x, x, w, y}, 300).message().find("threads = 300"),
            std::string::npos);
  EXPECT_NE(rms_norm_gated_oracle(GatedRmsNormRowsArgs<float>{0, 1e-6f, x, x, w, y}).message().find("dim = 0"),
            std::string::npos);
}

TEST(RmsNorm, ByHand) {
  // x = (3, 4): mean square 12.5, r = 1 / sqrt(12.5); weights 2 and 1.
  const std::vector<float> x = {3, 4}, w = {2, 1};
  std::vector<float> y(2);
  ASSERT_TRUE(rms_norm(RmsNormArgs<float>{2, 0.0f, x, w, y}, 1).is_ok());
  EXPECT_FLOAT_EQ(y[0], 2 * 3 / std::sqrt(12.5f));
  EXPECT_FLOAT_EQ(y[1], 4 / std::sqrt(12.5f));
}

TEST(RmsNorm, RefusesBadArgumentsByName) {
  const std::vector<float> x(6, 1.0f), w(3, 1.0f);
  std::vector<float> y(6);
  auto msg = [&](RmsNormArgs<float> a, int threads = 1) { return rms_norm(a, threads).message(); };
  EXPECT_NE(msg({0, 1e-6f, x, w, y}).find("dim = 0 must be >= 1"), std::string::npos);
  EXPECT_NE(msg({4, 1e-6f, x, std::vector<float>(4, 1.0f), y}).find("x has 6 values, not a multiple of dim = 4"),
            std::string::npos);
  EXPECT_NE(msg({3, 1e-6f, x, std::span<const float>(w).first(2), y}).find("weight has 2 values, dim = 3"),
            std::string::npos);
  EXPECT_NE(msg({3, 1e-6f, x, w, std::span<float>(y).first(3)}).find("y has 3 values, x has 6"), std::string::npos);
  EXPECT_NE(msg({3, -1.0f, x, w, y}).find("eps = -1.000000 must be finite and >= 0"), std::string::npos);
  EXPECT_NE(msg({3, 1e-6f, x, w, y}, -2).find("threads = -2 must be in [0, 256]"), std::string::npos);
  EXPECT_NE(rms_norm_oracle(RmsNormArgs<float>{0, 1e-6f, x, w, y}).message().find("dim = 0"), std::string::npos);
}

}  // namespace
}  // namespace k3
