// The KDA gate on the device agrees with the host definition the CPU backend uses
// (kda::detail::log_decay) within a few FP32 ulp, NaN and +-Inf included. Needs a CUDA device;
// without one every test skips with the reason. Ran on an H200 (2026-12-04): pass.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/kda/kda_math.hpp"
#include "k3/cuda.hpp"
#include "k3/cuda_kda.hpp"

namespace k3 {
namespace {

class CudaKdaGate : public ::testing::Test {
 protected:
  void SetUp() override {
    auto devs = cuda::devices();
    if (!devs.is_ok()) GTEST_SKIP() << "no CUDA device: " << devs.status().message();
    if (!devs.value()[0].runnable) GTEST_SKIP() << "device 0 is not among the compiled architectures " << cuda::compiled_archs();
  }
};

TEST_F(CudaKdaGate, EveryModeMatchesTheHostDefinition) {
  const int64_t t = 37, h = 3, k = 64;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd(0.f, 4.f);
  std::vector<float> f(static_cast<size_t>(t * h * k)), a_log = {-1.5f, 0.3f, 1.2f}, dt_bias(static_cast<size_t>(h * k));
  for (auto& v : f) v = nd(rng);
  for (auto& v : dt_bias) v = nd(rng) * 0.25f;
  f[3] = NAN;
  f[10] = INFINITY;
  f[11] = -INFINITY;
  f[12] = 30.0f;  // softplus shortcut
  f[13] = -3e4f;  // below the clamp for log_decay
  for (kda::GateMode mode : {kda::GateMode::kLogDecay, kda::GateMode::kSafe, kda::GateMode::kSoftplus}) {
    for (bool with_bias : {false, true}) {
      if (mode == kda::GateMode::kLogDecay && with_bias) continue;
      SCOPED_TRACE(std::string(kda::gate_mode_name(mode)) + (with_bias ? " + dt_bias" : ""));
      kda::KdaConfig cfg;
      cfg.num_heads = h;
      cfg.head_k = k;
      cfg.head_v = k;
      cfg.gate = mode;
      const bool gated = mode != kda::GateMode::kLogDecay;
      const std::span<const float> al = gated ? std::span<const float>(a_log) : std::span<const float>();
      const std::span<const float> db = with_bias ? std::span<const float>(dt_bias) : std::span<const float>();
      std::vector<float> g(f.size());
      const Status st = cuda::kda_log_decay(cfg, t, f, al, db, g);
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      for (int64_t i = 0; i < t * h * k; ++i) {
        const int64_t d = i % k, hh = (i / k) % h;
        const float a = gated ? std::exp(a_log[static_cast<size_t>(hh)]) : 0.0f;
        const float b = with_bias ? dt_bias[static_cast<size_t>(hh * k + d)] : 0.0f;
        const float want = kda::detail::log_decay<float>(mode, f[static_cast<size_t>(i)], a, b, cfg.gate_lower_bound);
        const float got = g[static_cast<size_t>(i)];
        if (std::isnan(want)) {
          EXPECT_TRUE(std::isnan(got)) << "element " << i;
        } else if (std::isinf(want)) {
          EXPECT_EQ(got, want) << "element " << i;
        } else {
          EXPECT_NEAR(got, want, 4e-6f * std::max(1.0f, std::fabs(want))) << "element " << i;
        }
      }
    }
  }
}

// Runs without a device: the checks come before the device is touched.
TEST(CudaKdaGateChecks, BadInputsAreRefusedBeforeTheDevice) {
  kda::KdaConfig cfg;
  cfg.num_heads = 2;
  cfg.head_k = 16;
  cfg.head_v = 16;
  std::vector<float> f(2 * 2 * 16), g(f.size()), a_log = {0.f, 100.f};
  Status st = cuda::kda_log_decay(cfg, 2, f, a_log, {}, g);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("a_log[1] = 100"), std::string::npos) << st.message();
  a_log[1] = 0.f;
  st = cuda::kda_log_decay(cfg, 3, f, a_log, {}, g);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("[T, H, K] = 96"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace k3
