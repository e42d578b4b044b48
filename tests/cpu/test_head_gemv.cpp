// Per-head products of one row (k3/cpu_linear.hpp: head_gemv_bf16, MLA's absorbed decode):
// the reference against FP64, every ISA level and thread count against the reference bit for bit,
// and the argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "k3/cpu_linear.hpp"
#include "k3/formats.hpp"
#include "k3/system.hpp"

namespace k3::cpu {
namespace {

struct Case {
  int64_t h, k, n;
  std::vector<uint16_t> w;
  std::vector<float> x;
};

Case make(int64_t h, int64_t k, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Case c{h, k, n, std::vector<uint16_t>(static_cast<size_t>(h * k * n)), std::vector<float>(static_cast<size_t>(h * k))};
  for (auto& v : c.w) v = bf16_from_f32(nd(rng));
  for (auto& v : c.x) v = nd(rng);
  return c;
}

HeadGemvArgs args(const Case& c, std::vector<float>& y) { return {c.h, c.k, c.n, c.w, c.x, y}; }

TEST(HeadGemv, ReferenceAgreesWithFp64) {
  const Case c = make(3, 70, 37, 1);
  std::vector<float> y(static_cast<size_t>(c.h * c.n));
  ASSERT_TRUE(head_gemv_reference(args(c, y)).is_ok());
  for (int64_t h = 0; h < c.h; ++h) {
    for (int64_t j = 0; j < c.n; ++j) {
      double s = 0.0, mag = 0.0;
      for (int64_t k = 0; k < c.k; ++k) {
        const double p = double(c.x[h * c.k + k]) * bf16_to_f32(c.w[(h * c.k + k) * c.n + j]);
        s += p;
        mag += std::fabs(p);
      }
      EXPECT_NEAR(y[h * c.n + j], s, 1e-6 * mag + 1e-30) << h << " " << j;
    }
  }
}

TEST(HeadGemv, EveryLevelAndThreadCountGivesTheReferenceBits) {
  // MLA's two products at Kimi-Linear's widths (q_nope . W_uk, ctx . W_uv), and ragged shapes.
  const int64_t shapes[][3] = {{32, 128, 512}, {32, 512, 128}, {3, 70, 37}, {1, 1, 1}, {5, 1, 17}};
  for (const auto& s : shapes) {
    Case c = make(s[0], s[1], s[2], 7 + static_cast<uint64_t>(s[2]));
    c.w[0] = bf16_from_f32(0.0f);  // a zero, a subnormal and a huge weight among the normal ones
    if (c.w.size() > 2) c.w[1] = 0x0001, c.w[2] = bf16_from_f32(1.0e30f);
    std::vector<float> want(static_cast<size_t>(c.h * c.n)), got(want.size());
    ASSERT_TRUE(head_gemv_reference(args(c, want)).is_ok());
    for (int l = 0; l <= static_cast<int>(best_isa_level()); ++l) {
      for (int threads : {1, 2, 3}) {
        std::fill(got.begin(), got.end(), -1.0f);
        ASSERT_TRUE(head_gemv_bf16(args(c, got), threads, static_cast<IsaLevel>(l)).is_ok());
        EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)))
            << isa_level_name(static_cast<IsaLevel>(l)) << " threads " << threads << " shape " << s[0] << "x" << s[1]
            << "x" << s[2];
      }
    }
  }
}

TEST(HeadGemv, NonFiniteInputsPropagate) {
  Case c = make(2, 4, 3, 3);
  c.x[1] = std::nanf("");                      // head 0: every output NaN
  c.w[(1 * 4 + 2) * 3 + 1] = 0x7F80;           // head 1, k 2, n 1: +Inf weight
  std::vector<float> y(6), want(6);
  ASSERT_TRUE(head_gemv_bf16(args(c, y), 2).is_ok());
  ASSERT_TRUE(head_gemv_reference(args(c, want)).is_ok());
  for (int j = 0; j < 3; ++j) EXPECT_TRUE(std::isnan(y[j]));
  EXPECT_TRUE(std::isinf(y[3 + 1]) || std::isnan(y[3 + 1]));
  EXPECT_EQ(std::isinf(y[4]), std::isinf(want[4]));
  EXPECT_TRUE(std::isfinite(y[3]) && std::isfinite(y[5]));
}

TEST(HeadGemv, RefusesBadArgumentsByName) {
  const Case c = make(2, 4, 3, 5);
  std::vector<float> y(6);
  auto msg = [&](HeadGemvArgs a, int threads = 1) { return head_gemv_bf16(a, threads).message(); };
  HeadGemvArgs a = args(c, y);
  a.heads = 0;
  EXPECT_NE(msg(a).find("heads = 0 must be in [1, "), std::string::npos) << msg(a);
  a = args(c, y);
  a.n = -3;
  EXPECT_NE(msg(a).find("n = -3"), std::string::npos);
  a = args(c, y);
  a.w = std::span<const uint16_t>(c.w).first(5);
  EXPECT_NE(msg(a).find("w has 5 values, heads * k * n = 24"), std::string::npos) << msg(a);
  a = args(c, y);
  a.x = std::span<const float>(c.x).first(7);
  EXPECT_NE(msg(a).find("x has 7 values, heads * k = 8"), std::string::npos) << msg(a);
  std::vector<float> small(5);
  a = args(c, small);
  EXPECT_NE(msg(a).find("y has 5 values, heads * n = 6"), std::string::npos) << msg(a);
  EXPECT_NE(msg(args(c, y), -1).find("threads = -1 must be in [0, 256]"), std::string::npos);
  EXPECT_TRUE(head_gemv_reference(a).message().find("y has 5 values") != std::string::npos);
  if (best_isa_level() != IsaLevel::kAvx512Bf16) {
    const Status s = head_gemv_bf16(args(c, y), 1, IsaLevel::kAvx512Bf16);
    EXPECT_NE(s.message().find("is above this CPU's"), std::string::npos) << s.message();
  }
}

}  // namespace
}  // namespace k3::cpu
