// exp_f32 / sigmoid_f32: accuracy against FP64 and the special values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "k3/portable_math.hpp"

namespace k3 {
namespace {

TEST(PortableMath, ExpWithinTwoUlpOverItsRange) {
  double worst = 0;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 4093) {
    const float x = bits_to_f32(static_cast<uint32_t>(u));
    if (!std::isfinite(x) || x > 88.72f || x < -87.3f) continue;  // results stay normal
    const double ref = std::exp(static_cast<double>(x));
    const double ulp = std::ldexp(1.0, std::ilogb(ref) - 23);
    worst = std::max(worst, std::fabs(exp_f32(x) - ref) / ulp);
  }
  EXPECT_LT(worst, 2.0);
}

TEST(PortableMath, SpecialValues) {
  EXPECT_EQ(exp_f32(0.0f), 1.0f);
  EXPECT_TRUE(std::isnan(exp_f32(NAN)));
  EXPECT_EQ(exp_f32(INFINITY), INFINITY);
  EXPECT_EQ(exp_f32(-INFINITY), 0.0f);
  EXPECT_EQ(exp_f32(100.0f), INFINITY);
  EXPECT_GT(exp_f32(-100.0f), 0.0f);  // subnormal result, not flushed
  EXPECT_NEAR(exp_f32(-100.0f), std::exp(-100.0), 2e-45);
  EXPECT_EQ(sigmoid_f32(INFINITY), 1.0f);
  EXPECT_EQ(sigmoid_f32(-INFINITY), 0.0f);
  EXPECT_EQ(sigmoid_f32(0.0f), 0.5f);
  EXPECT_TRUE(std::isnan(sigmoid_f32(NAN)));
  for (float x = -20.f; x <= 20.f; x += 0.37f) {
    EXPECT_NEAR(sigmoid_f32(x), 1.0 / (1.0 + std::exp(-static_cast<double>(x))), 2e-7) << x;
  }
}

}  // namespace
}  // namespace k3
