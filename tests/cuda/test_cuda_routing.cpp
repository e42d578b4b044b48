// The GPU router against k3::route, bit for bit (ids and weights), at 896/16 with ties, NaN and
// grouped configurations. Needs a device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "k3/cuda.hpp"
#include "k3/cuda_routing.hpp"
#include "k3/routing.hpp"

namespace k3 {
namespace {

void expect_bit_identical(const RoutingConfig& cfg, int64_t m, const std::vector<float>& logits,
                          const std::vector<float>& bias) {
  std::vector<int32_t> ids_c(m * cfg.top_k), ids_g(ids_c.size());
  std::vector<float> w_c(ids_c.size()), w_g(ids_c.size());
  ASSERT_TRUE(route(cfg, m, logits, bias, ids_c, w_c).is_ok());
  const Status st = cuda::route_host(cfg, m, logits, bias, ids_g, w_g);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(ids_c, ids_g);
  EXPECT_EQ(std::memcmp(w_c.data(), w_g.data(), w_c.size() * 4), 0);
}

TEST(CudaRouting, Kimi896Top16WithTiesAndNonFinite) {
  if (auto d = cuda::devices(); !d.is_ok()) GTEST_SKIP() << "no CUDA device: " << d.status().message();
  RoutingConfig cfg;
  const int64_t m = 67;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 2.f);
  std::vector<float> logits(m * 896), bias(896);
  for (auto& v : logits) v = nd(rng);
  for (auto& v : bias) v = nd(rng) * 0.01f;
  for (int e = 0; e < 896; e += 7) logits[3 * 896 + e] = 1.25f;  // exact ties in token 3
  logits[5 * 896 + 10] = NAN;
  logits[5 * 896 + 11] = INFINITY;
  logits[6 * 896 + 12] = -INFINITY;
  for (int e = 0; e < 896; ++e) logits[7 * 896 + e] = NAN;  // all NaN: every slot masked
  expect_bit_identical(cfg, m, logits, bias);
  expect_bit_identical(cfg, m, logits, {});
}

TEST(CudaRouting, GroupedAndOddConfigs) {
  if (auto d = cuda::devices(); !d.is_ok()) GTEST_SKIP() << "no CUDA device: " << d.status().message();
  std::mt19937 rng(2);
  std::normal_distribution<float> nd;
  for (RoutingConfig cfg : {RoutingConfig{256, 8, 8, 4, true, 2.5f}, RoutingConfig{5, 3, 1, 1, false, 1.0f},
                            RoutingConfig{4096, 32, 64, 8, true, 1.0f}}) {
    const int64_t m = 19;
    std::vector<float> logits(m * cfg.num_experts), bias(cfg.num_experts);
    for (auto& v : logits) v = nd(rng);
    for (auto& v : bias) v = nd(rng) * 0.1f;
    expect_bit_identical(cfg, m, logits, bias);
  }
}

}  // namespace
}  // namespace k3
