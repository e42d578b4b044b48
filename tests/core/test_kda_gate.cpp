// The KDA gate's one definition (src/core/kda/kda_math.hpp, host + device): each mode against its
// formula in FP64, the clamp, the non-finite rules, and check_gate_inputs's errors.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/kda/kda_math.hpp"

namespace k3::kda {
namespace {

TEST(KdaGate, EachModeIsItsFormula) {
  const double lb = -5.0;
  for (double f : {-30.0, -4.0, -0.5, 0.0, 0.7, 3.0, 19.0, 21.0, 60.0}) {
    for (double a : {0.2, 1.0, 3.3}) {
      for (double b : {0.0, -0.4, 1.1}) {
        const double x = f + b;
        EXPECT_DOUBLE_EQ(detail::log_decay<double>(GateMode::kSafe, f, a, b, lb), lb / (1.0 + std::exp(-a * x)));
        const double sp = x > 20 ? x : std::log1p(std::exp(x));
        EXPECT_DOUBLE_EQ(detail::log_decay<double>(GateMode::kSoftplus, f, a, b, lb),
                         std::max(-a * sp, static_cast<double>(kMinLogDecay)));
        EXPECT_DOUBLE_EQ(detail::log_decay<double>(GateMode::kLogDecay, f, a, b, lb),
                         std::max(f, static_cast<double>(kMinLogDecay)));
      }
    }
  }
  // FP32 follows FP64 within rounding.
  EXPECT_NEAR(detail::log_decay<float>(GateMode::kSafe, 0.7f, 1.0f, 0.1f, -5.0f),
              detail::log_decay<double>(GateMode::kSafe, 0.7, 1.0, 0.1, -5.0), 1e-6);
}

TEST(KdaGate, ClampAndNonFiniteRules) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(detail::log_decay<float>(GateMode::kLogDecay, -1e9f, 0, 0, -5), kMinLogDecay);
  EXPECT_EQ(detail::log_decay<float>(GateMode::kLogDecay, -inf, 0, 0, -5), kMinLogDecay);
  EXPECT_TRUE(std::isnan(detail::log_decay<float>(GateMode::kLogDecay, nan, 0, 0, -5)));
  EXPECT_TRUE(std::isnan(detail::log_decay<float>(GateMode::kSafe, nan, 1, 0, -5)));
  EXPECT_EQ(detail::log_decay<float>(GateMode::kSoftplus, inf, 1, 0, -5), kMinLogDecay);  // -inf clamped
  EXPECT_FALSE(detail::decay_poisons(detail::log_decay<float>(GateMode::kSafe, inf, 1, 0, -5)));
  EXPECT_TRUE(detail::decay_poisons(nan));
  EXPECT_TRUE(detail::decay_poisons(inf));
  EXPECT_TRUE(detail::decay_poisons(kMaxLogDecay * 1.01f));
  EXPECT_FALSE(detail::decay_poisons(kMaxLogDecay));
}

TEST(KdaGate, GateInputsAreCheckedWithTheReason) {
  KdaConfig c;
  c.num_heads = 2;
  c.head_k = 4;
  const std::vector<float> a = {0.f, 1.f}, bias(8), short_bias(7);
  EXPECT_TRUE(check_gate_inputs(c, a, {}).is_ok());
  EXPECT_TRUE(check_gate_inputs(c, a, bias).is_ok());
  auto msg = [&](std::span<const float> al, std::span<const float> db) { return check_gate_inputs(c, al, db).message(); };
  EXPECT_NE(msg(std::vector<float>{0.f}, {}).find("a_log has 1 elements, gate = safe needs at least H = 2"),
            std::string::npos);
  EXPECT_NE(msg(a, short_bias).find("dt_bias has 7 elements, expected 8"), std::string::npos) << msg(a, short_bias);
  EXPECT_NE(msg(std::vector<float>{0.f, NAN}, {}).find("a_log[1] = nan is outside"), std::string::npos)
      << msg(std::vector<float>{0.f, NAN}, {});
  c.gate = GateMode::kLogDecay;
  EXPECT_TRUE(check_gate_inputs(c, {}, {}).is_ok());
  EXPECT_NE(msg(a, {}).find("gate = log_decay takes the decay g directly"), std::string::npos);
}

}  // namespace
}  // namespace k3::kda
