// The device MX kernels agree bit for bit with the host codec. Needs a CUDA device; without one
// every test skips with the reason.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "k3/cuda.hpp"
#include "k3/mx.hpp"

namespace k3 {
namespace {

class CudaMx : public ::testing::Test {
 protected:
  void SetUp() override {
    auto devs = cuda::devices();
    if (!devs.is_ok()) GTEST_SKIP() << "no CUDA device: " << devs.status().message();
    if (!devs.value()[0].runnable) GTEST_SKIP() << "device 0 is not among the compiled architectures " << cuda::compiled_archs();
  }
};

std::vector<float> data(int64_t n) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng) * std::ldexp(1.f, static_cast<int>(rng() % 80) - 40);
  x[3] = INFINITY;
  x[100] = -INFINITY;
  x[777] = NAN;
  x[1000] = 1e-41f;
  return x;
}

TEST_F(CudaMx, QuantizeMatchesHostBitForBit) {
  const int64_t rows = 333, cols = 3584;
  const auto x = data(rows * cols);
  for (MxElement el : {MxElement::kE2M1, MxElement::kE4M3}) {
    for (ScaleRule rule : {ScaleRule::kRceil, ScaleRule::kFloor}) {
      std::vector<uint8_t> qh(rows * mx_row_bytes(el, cols)), sh(rows * cols / 32), qd(qh.size()), sd(sh.size());
      ASSERT_TRUE(mx_quantize(x, rows, cols, el, rule, qh, sh).is_ok());
      const Status st = cuda::mx_quantize(x, rows, cols, el, rule, qd, sd);
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      EXPECT_EQ(qh, qd) << mx_element_name(el) << " " << scale_rule_name(rule);
      EXPECT_EQ(sh, sd) << mx_element_name(el) << " " << scale_rule_name(rule);
    }
  }
}

TEST_F(CudaMx, DequantizeMatchesHostBitForBit) {
  const int64_t rows = 65, cols = 1024;
  const auto x = data(rows * cols);
  for (MxElement el : {MxElement::kE2M1, MxElement::kE4M3}) {
    std::vector<uint8_t> q(rows * mx_row_bytes(el, cols)), s(rows * cols / 32);
    ASSERT_TRUE(mx_quantize(x, rows, cols, el, ScaleRule::kRceil, q, s).is_ok());
    std::vector<float> h(rows * cols), d(rows * cols);
    ASSERT_TRUE(mx_dequantize(q, s, rows, cols, el, h).is_ok());
    ASSERT_TRUE(cuda::mx_dequantize(q, s, rows, cols, el, d).is_ok());
    for (size_t i = 0; i < h.size(); ++i) {
      ASSERT_EQ(f32_to_bits(h[i]), f32_to_bits(d[i])) << i;
    }
  }
}

TEST(CudaMxErrors, BadShapeIsRejectedBeforeTouchingTheDevice) {
  std::vector<float> x(40);
  std::vector<uint8_t> q(40), s(2);
  const Status st = cuda::mx_quantize(x, 1, 40, MxElement::kE4M3, ScaleRule::kRceil, q, s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("cols = 40"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace k3
