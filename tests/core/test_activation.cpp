// The activation formulas' one definition (k3/activation.hpp) against the formulas written out
// independently here, and the NaN rules every backend inherits from it.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "k3/activation.hpp"
#include "k3/moe_ref.hpp"

namespace k3 {
namespace {

struct LibMath {
  static double exp(double x) { return std::exp(x); }
  static double tanh(double x) { return std::tanh(x); }
  static float exp(float x) { return std::exp(x); }
  static float tanh(float x) { return std::tanh(x); }
};

TEST(Activation, FormulasAreTheContracts) {
  for (double g : {-40.0, -6.5, -1.0, -0.1, 0.0, 0.3, 2.0, 7.5, 30.0}) {
    for (double u : {-50.0, -8.0, -0.7, 0.0, 0.9, 6.0, 9.0}) {
      const double sg = 1.0 / (1.0 + std::exp(-g));
      EXPECT_NEAR(act::situ<LibMath>(g, u, 4.0, 25.0), 4.0 * std::tanh(g / 4.0) * sg * 25.0 * std::tanh(u / 25.0),
                  1e-12);
      const double gc = std::min(g, 7.0), uc = std::max(-7.0, std::min(u, 7.0));
      EXPECT_NEAR(act::swiglu<LibMath>(g, u, 1.702, 1.0, 7.0), gc / (1.0 + std::exp(-1.702 * gc)) * (uc + 1.0), 1e-12);
      EXPECT_NEAR(act::silu_mul<LibMath>(g, u), g * sg * u, 1e-12);
      // The oracle is the FP64 instance of the same definition.
      Activation a;
      for (ActivationKind k : {ActivationKind::kSiTU, ActivationKind::kSwiGLU, ActivationKind::kSiLU}) {
        a.kind = k;
        EXPECT_EQ(activation_ref(a, g, u, 4.0, 25.0),
                  act::gated<LibMath>(k, g, u, 4.0, 25.0, static_cast<double>(a.swiglu_alpha),
                                      static_cast<double>(a.swiglu_beta), static_cast<double>(a.swiglu_limit)));
      }
    }
  }
}

TEST(Activation, NanPropagatesThroughEveryActivationAndClamp) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (ActivationKind k : {ActivationKind::kSiTU, ActivationKind::kSwiGLU, ActivationKind::kSiLU}) {
    EXPECT_TRUE(std::isnan(act::gated<LibMath>(k, nan, 1.0f, 4.0f, 25.0f, 1.702f, 1.0f, 7.0f)));
    EXPECT_TRUE(std::isnan(act::gated<LibMath>(k, 1.0f, nan, 4.0f, 25.0f, 1.702f, 1.0f, 7.0f)));
  }
  EXPECT_TRUE(std::isnan(act::min_keep_nan(nan, 7.0f)));
  EXPECT_TRUE(std::isnan(act::clamp_keep_nan(nan, -7.0f, 7.0f)));
  EXPECT_EQ(act::min_keep_nan(inf, 7.0f), 7.0f);
  EXPECT_EQ(act::clamp_keep_nan(-inf, -7.0f, 7.0f), -7.0f);
  // SwiGLU's clamps make +-Inf inputs finite; SiTU's tanh bounds them.
  EXPECT_TRUE(std::isfinite(act::swiglu<LibMath>(inf, -inf, 1.702f, 1.0f, 7.0f)));
  EXPECT_FLOAT_EQ(act::situ<LibMath>(inf, inf, 4.0f, 25.0f), 100.0f);
}

}  // namespace
}  // namespace k3
