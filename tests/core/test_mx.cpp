// MX block quantization: scale rules, worked examples, error bounds, non-finite blocks, layouts.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "k3/mx.hpp"

namespace k3 {
namespace {

TEST(MxScale, WorkedExamplesOfTheSpec) {
  // E4M3: amax 480 -> FLOOR 2^0 (480 saturates to 448), RCEIL 2^1 (480/2 = 240)
  EXPECT_EQ(mx_scale_code(480.f, MxElement::kE4M3, ScaleRule::kFloor), 127);
  EXPECT_EQ(mx_scale_code(480.f, MxElement::kE4M3, ScaleRule::kRceil), 128);
  // amax 300 -> both 2^0
  EXPECT_EQ(mx_scale_code(300.f, MxElement::kE4M3, ScaleRule::kFloor), 127);
  EXPECT_EQ(mx_scale_code(300.f, MxElement::kE4M3, ScaleRule::kRceil), 127);
  // E2M1: amax 7 -> FLOOR 2^0 (7 -> 6), RCEIL 2^1 (3.5 -> RNE -> 4, i.e. 8)
  EXPECT_EQ(mx_scale_code(7.f, MxElement::kE2M1, ScaleRule::kFloor), 127);
  EXPECT_EQ(mx_scale_code(7.f, MxElement::kE2M1, ScaleRule::kRceil), 128);

  float blk[32] = {};
  uint8_t codes[32];
  blk[7] = 480.f;
  EXPECT_EQ(mx_quantize_block(blk, MxElement::kE4M3, ScaleRule::kFloor, codes), 127);
  EXPECT_EQ(mx_decode_element(codes[7], 127, MxElement::kE4M3), 448.f);
  EXPECT_EQ(mx_quantize_block(blk, MxElement::kE4M3, ScaleRule::kRceil, codes), 128);
  EXPECT_EQ(mx_decode_element(codes[7], 128, MxElement::kE4M3), 480.f);
  blk[7] = 7.f;
  EXPECT_EQ(mx_quantize_block(blk, MxElement::kE2M1, ScaleRule::kFloor, codes), 127);
  EXPECT_EQ(mx_decode_element(codes[7], 127, MxElement::kE2M1), 6.f);
  EXPECT_EQ(mx_quantize_block(blk, MxElement::kE2M1, ScaleRule::kRceil, codes), 128);
  EXPECT_EQ(mx_decode_element(codes[7], 128, MxElement::kE2M1), 8.f);
}

TEST(MxScale, RulesAgreeBelowTheMantissaBoundary) {
  // Same exponent when m <= 1.75 (E4M3) / m <= 1.5 (E2M1); RCEIL one binade higher above.
  for (int e = -100; e <= 100; e += 7) {
    const float at = std::ldexp(1.75f, e), above = std::nextafter(at, INFINITY);
    EXPECT_EQ(mx_scale_code(at, MxElement::kE4M3, ScaleRule::kRceil), mx_scale_code(at, MxElement::kE4M3, ScaleRule::kFloor));
    EXPECT_EQ(mx_scale_code(above, MxElement::kE4M3, ScaleRule::kRceil),
              mx_scale_code(above, MxElement::kE4M3, ScaleRule::kFloor) + 1);
    const float at4 = std::ldexp(1.5f, e), above4 = std::nextafter(at4, INFINITY);
    EXPECT_EQ(mx_scale_code(at4, MxElement::kE2M1, ScaleRule::kRceil), mx_scale_code(at4, MxElement::kE2M1, ScaleRule::kFloor));
    EXPECT_EQ(mx_scale_code(above4, MxElement::kE2M1, ScaleRule::kRceil),
              mx_scale_code(above4, MxElement::kE2M1, ScaleRule::kFloor) + 1);
  }
}

TEST(MxScale, ExactQuotientMatchesFp32DivisionEverywhereTested) {
  // NVIDIA computes cvt.rp(amax * rcp(elem_max)); k3 uses the exact quotient. With a correctly
  // rounded FP32 division both agree; document that over the mantissa neighbourhood of the
  // boundary in every binade where the quotient is a normal float.
  int differ = 0;
  for (MxElement el : {MxElement::kE2M1, MxElement::kE4M3}) {
    const float emax = mx_elem_max(el);
    for (int e = -100; e <= 127; ++e) {
      const float base = std::ldexp(el == MxElement::kE2M1 ? 1.5f : 1.75f, e);
      float x = base;
      for (int i = 0; i < 64; ++i) x = std::nextafter(x, 0.f);
      for (int i = 0; i < 128 && std::isfinite(x); ++i, x = std::nextafter(x, INFINITY)) {
        differ += mx_scale_code(x, el, ScaleRule::kRceil) != e8m0_from_f32_ceil(x / emax);
      }
    }
  }
  EXPECT_EQ(differ, 0);
}

TEST(MxScale, ZeroDenormalAndHugeBlocks) {
  EXPECT_EQ(mx_scale_code(0.f, MxElement::kE4M3, ScaleRule::kRceil), 0);
  EXPECT_EQ(mx_scale_code(0.f, MxElement::kE2M1, ScaleRule::kFloor), 0);
  EXPECT_EQ(mx_scale_code(1e-45f, MxElement::kE4M3, ScaleRule::kRceil), 0);  // clamps at 2^-127
  EXPECT_EQ(mx_scale_code(3.0e38f, MxElement::kE4M3, ScaleRule::kRceil), 127 + 128 - 8);
  EXPECT_EQ(mx_scale_code(3.4e38f, MxElement::kE2M1, ScaleRule::kRceil), 127 + 126);  // 1.998*2^127 / 6
  EXPECT_EQ(mx_scale_code(INFINITY, MxElement::kE2M1, ScaleRule::kRceil), 0xFE);
  // subnormal amax: 2^-140 -> RCEIL code for 2^-140 / 448 -> clamps to 0; 2^-120 -> 2^-128 -> 0
  EXPECT_EQ(mx_scale_code(std::ldexp(1.f, -140), MxElement::kE4M3, ScaleRule::kFloor), 0);
  EXPECT_EQ(mx_scale_code(std::ldexp(1.f, -100), MxElement::kE4M3, ScaleRule::kFloor), 127 - 108);
}

TEST(MxBlock, NonFiniteDenormalZeroAndTieInputs) {
  float blk[32] = {};
  uint8_t codes[32];
  blk[0] = INFINITY;
  blk[1] = -INFINITY;
  blk[2] = 1e-40f;  // FP32 denormal
  blk[3] = -0.f;
  blk[4] = 3.0e38f;
  EXPECT_EQ(mx_quantize_block(blk, MxElement::kE4M3, ScaleRule::kRceil, codes), 0xFE);
  EXPECT_EQ(codes[0], 0x7E);  // +448
  EXPECT_EQ(codes[1], 0xFE);  // -448
  EXPECT_EQ(codes[2], 0x00);
  EXPECT_EQ(codes[3], 0x80);  // -0 keeps its sign
  EXPECT_EQ(mx_decode_element(codes[0], 0xFE, MxElement::kE4M3), INFINITY);  // 448 * 2^127 overflows FP32
  // NaN poisons the block: scale 0xFF, element codes 0, every decoded value NaN
  blk[5] = NAN;
  for (MxElement el : {MxElement::kE2M1, MxElement::kE4M3}) {
    EXPECT_EQ(mx_quantize_block(blk, el, ScaleRule::kRceil, codes), kE8M0Nan);
    for (int i = 0; i < 32; ++i) {
      EXPECT_EQ(codes[i], 0);
      EXPECT_TRUE(std::isnan(mx_decode_element(codes[i], kE8M0Nan, el)));
    }
  }
  // FP32 denormals only: the scale clamps at 2^-127; values >= 2^-136 (E4M3's smallest
  // subnormal times 2^-127) survive exactly, smaller ones underflow to zero.
  float den[32] = {};
  den[0] = std::ldexp(1.f, -130);
  den[1] = -std::ldexp(1.f, -133);
  den[2] = std::ldexp(1.f, -140);
  const uint8_t s = mx_quantize_block(den, MxElement::kE4M3, ScaleRule::kRceil, codes);
  EXPECT_EQ(s, 0);  // 2^-127
  EXPECT_EQ(mx_decode_element(codes[0], s, MxElement::kE4M3), den[0]);
  EXPECT_EQ(mx_decode_element(codes[1], s, MxElement::kE4M3), den[1]);
  EXPECT_EQ(mx_decode_element(codes[2], s, MxElement::kE4M3), 0.f);
  // ties at each E2M1 threshold inside a block with scale 2^0 (amax 6)
  float ties[32] = {6.f, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f};
  const float want[8] = {6.f, 0.f, 1.f, 1.f, 2.f, 2.f, 4.f, 4.f};
  EXPECT_EQ(mx_quantize_block(ties, MxElement::kE2M1, ScaleRule::kRceil, codes), 127);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(e2m1_to_f32(codes[i]), want[i]) << ties[i];
}

std::vector<float> random_rows(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng) * std::ldexp(1.f, static_cast<int>(rng() % 60) - 30);
  return x;
}

TEST(MxBlockAmax, AnySplitAndMergeOrderGivesTheCodecsScale) {
  // The CUDA kernels fold 8 elements per lane and merge 4 lanes; the host codec folds 32 in order.
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  const float nan = std::nanf(""), inf = std::numeric_limits<float>::infinity();
  for (int trial = 0; trial < 2000; ++trial) {
    float x[kMxBlock];
    for (float& v : x) v = nd(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 60) - 30);
    if (trial % 5 == 1) x[rng() % kMxBlock] = nan;
    if (trial % 7 == 2) x[rng() % kMxBlock] = (rng() & 1) ? inf : -inf;
    if (trial % 11 == 3) x[rng() % kMxBlock] = -0.0f;
    uint8_t codes[kMxBlock];
    for (const ScaleRule rule : {ScaleRule::kRceil, ScaleRule::kFloor}) {
      for (const MxElement e : {MxElement::kE4M3, MxElement::kE2M1}) {
        const uint8_t want = mx_quantize_block(x, e, rule, codes);
        MxBlockAmax lanes[4];
        for (int i = 0; i < kMxBlock; ++i) lanes[(i / 2) % 4].add(x[kMxBlock - 1 - i]);  // quad layout, reversed
        MxBlockAmax merged = lanes[3];
        for (int l = 2; l >= 0; --l) merged.merge(lanes[l].amax, lanes[l].nan);
        ASSERT_EQ(merged.scale_code(e, rule), want) << trial;
        EXPECT_EQ(merged.nan, want == kE8M0Nan) << trial;
      }
    }
  }
  MxBlockAmax empty;  // nothing added: amax 0, the smallest scale
  EXPECT_EQ(empty.scale_code(MxElement::kE4M3, ScaleRule::kRceil), mx_scale_code(0.0f, MxElement::kE4M3, ScaleRule::kRceil));
}

TEST(MxRows, RandomErrorWithinHalfAnElementUlp) {
  const int64_t rows = 37, cols = 96;
  const auto x = random_rows(rows * cols, 1);
  for (MxElement el : {MxElement::kE2M1, MxElement::kE4M3}) {
    for (ScaleRule rule : {ScaleRule::kRceil, ScaleRule::kFloor}) {
      std::vector<uint8_t> q(rows * mx_row_bytes(el, cols)), s(rows * cols / 32);
      std::vector<float> back(x.size());
      ASSERT_TRUE(mx_quantize(x, rows, cols, el, rule, q, s).is_ok());
      ASSERT_TRUE(mx_dequantize(q, s, rows, cols, el, back).is_ok());
      const double rel = el == MxElement::kE2M1 ? 0.25 : 1.0 / 16, sub = el == MxElement::kE2M1 ? 0.25 : 1.0 / 1024;
      for (int64_t i = 0; i < rows * cols; ++i) {
        const double scale = e8m0_to_f32(s[i / 32]);
        double bound = std::max(rel * std::fabs(x[i]), sub * scale);
        if (rule == ScaleRule::kFloor) {  // FLOOR may clip the block maximum to elem_max
          bound = std::max(bound, std::fabs(x[i]) - mx_elem_max(el) * scale);
        }
        ASSERT_LE(std::fabs(static_cast<double>(back[i]) - x[i]), bound)
            << mx_element_name(el) << " " << scale_rule_name(rule) << " i=" << i;
      }
    }
  }
}

TEST(MxRows, PackingLowNibbleIsEvenElement) {
  std::vector<float> x(32, 0.f);
  x[0] = 1.f;  // code 2 at scale 2^0 with amax 6 below
  x[1] = 6.f;  // code 7
  std::vector<uint8_t> q(16), s(1);
  ASSERT_TRUE(mx_quantize(x, 1, 32, MxElement::kE2M1, ScaleRule::kRceil, q, s).is_ok());
  EXPECT_EQ(s[0], 127);
  EXPECT_EQ(q[0], 0x72);
}

TEST(MxRows, BadShapesAndBuffersGiveClearErrors) {
  std::vector<float> x(33);
  std::vector<uint8_t> q(64), s(4);
  auto st = mx_quantize(x, 1, 33, MxElement::kE4M3, ScaleRule::kRceil, q, s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("cols = 33"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("32"), std::string::npos);
  st = mx_quantize(x, 2, 32, MxElement::kE4M3, ScaleRule::kRceil, q, s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("x: buffer holds 33"), std::string::npos) << st.message();
  st = mx_quantize(x, -1, 32, MxElement::kE4M3, ScaleRule::kRceil, q, s);
  EXPECT_NE(st.message().find("rows = -1"), std::string::npos) << st.message();
  std::vector<float> out(10);
  st = mx_dequantize(q, s, 1, 32, MxElement::kE4M3, out);
  EXPECT_NE(st.message().find("out: buffer holds 10 elements, needs 32"), std::string::npos) << st.message();
}

TEST(MxRows, Bf16DequantIsExactOrReportsTheBlock) {
  const int64_t rows = 3, cols = 64;
  auto x = random_rows(rows * cols, 2);
  for (int i = 0; i < 32; ++i) x[64 + i] = 0.f;  // a zero block (scale code 0) is still exact
  std::vector<uint8_t> q(rows * cols), s(rows * 2);
  ASSERT_TRUE(mx_quantize(x, rows, cols, MxElement::kE4M3, ScaleRule::kRceil, q, s).is_ok());
  std::vector<float> f(rows * cols);
  std::vector<uint16_t> b(rows * cols);
  ASSERT_TRUE(mx_dequantize(q, s, rows, cols, MxElement::kE4M3, f).is_ok());
  ASSERT_TRUE(mx_dequantize_bf16(q, s, rows, cols, MxElement::kE4M3, b).is_ok());
  for (size_t i = 0; i < f.size(); ++i) EXPECT_EQ(bf16_to_f32(b[i]), f[i]) << i;
  // a block at scale 2^-120 with a small element leaves BF16's normal range
  s[2 * 2 + 1] = 7;
  q[2 * cols + 40] = 0x01;  // 2^-9 * 2^-120 = 2^-129
  EXPECT_TRUE(mx_find_bf16_inexact_block(q, s, rows, cols, MxElement::kE4M3).has_value());
  const auto st = mx_dequantize_bf16(q, s, rows, cols, MxElement::kE4M3, b);
  EXPECT_EQ(st.code(), StatusCode::kInexact);
  EXPECT_NE(st.message().find("row 2, block 1"), std::string::npos) << st.message();
  EXPECT_TRUE(mx_element_bf16_exact(0x38, 0xF6, MxElement::kE4M3));   // 1 * 2^119
  EXPECT_TRUE(mx_element_bf16_exact(0x7E, 0xF6, MxElement::kE4M3));   // 448 * 2^119 = 1.75 * 2^127
  EXPECT_FALSE(mx_element_bf16_exact(0x7E, 0xF7, MxElement::kE4M3));  // 1.75 * 2^128 overflows
  EXPECT_FALSE(mx_element_bf16_exact(0x01, 0x0A - 1, MxElement::kE4M3));  // 2^-9 * 2^-118 = 2^-127
}

TEST(MxRows, ResultsDoNotDependOnThreadCount) {
  const int64_t rows = 257, cols = 256;
  const auto x = random_rows(rows * cols, 3);
  std::vector<uint8_t> q1(rows * cols / 2), s1(rows * 8), q3(q1.size()), s3(s1.size());
  omp_set_num_threads(1);
  ASSERT_TRUE(mx_quantize(x, rows, cols, MxElement::kE2M1, ScaleRule::kRceil, q1, s1).is_ok());
  omp_set_num_threads(3);
  ASSERT_TRUE(mx_quantize(x, rows, cols, MxElement::kE2M1, ScaleRule::kRceil, q3, s3).is_ok());
  EXPECT_EQ(q1, q3);
  EXPECT_EQ(s1, s3);
}

TEST(SwizzledScales, OffsetsAtThePaddingEdges) {
  const int64_t sc = 7;  // numKTiles = 2
  EXPECT_EQ(swizzled_scale_offset(0, 0, sc), 0);
  EXPECT_EQ(swizzled_scale_offset(0, 3, sc), 3);
  EXPECT_EQ(swizzled_scale_offset(0, 4, sc), 512);
  EXPECT_EQ(swizzled_scale_offset(1, 0, sc), 16);
  EXPECT_EQ(swizzled_scale_offset(31, 0, sc), 31 * 16);
  EXPECT_EQ(swizzled_scale_offset(32, 0, sc), 4);
  EXPECT_EQ(swizzled_scale_offset(127, 7, sc), 512 + 31 * 16 + 3 * 4 + 3);  // last padded cell of tile 0
  EXPECT_EQ(swizzled_scale_offset(128, 0, sc), 2 * 512);
  EXPECT_EQ(swizzled_scale_size(129, 7), 256 * 8);
  EXPECT_EQ(swizzled_scale_size(128, 4), 512);
}

TEST(SwizzledScales, RoundTripAndZeroPadding) {
  for (auto [rows, sc] : {std::pair<int64_t, int64_t>{1, 1}, {128, 4}, {129, 5}, {300, 112}}) {
    std::vector<uint8_t> lin(rows * sc), swz(swizzled_scale_size(rows, sc), 0xEE), back(lin.size());
    for (size_t i = 0; i < lin.size(); ++i) lin[i] = static_cast<uint8_t>(1 + i % 250);
    ASSERT_TRUE(scales_to_swizzled(lin, rows, sc, swz).is_ok());
    ASSERT_TRUE(scales_from_swizzled(swz, rows, sc, back).is_ok());
    EXPECT_EQ(lin, back);
    int64_t zeros = 0;
    for (auto v : swz) zeros += v == 0;
    EXPECT_EQ(zeros, static_cast<int64_t>(swz.size()) - rows * sc) << rows << "x" << sc;
  }
  std::vector<uint8_t> small(10), lin(128 * 4);
  EXPECT_EQ(scales_to_swizzled(lin, 128, 4, small).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(scales_to_swizzled(lin, 128, 0, small).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace k3
