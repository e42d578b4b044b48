// The host + device functions of the sm_90a grouped prefill path (src/cuda/moe/moe_grouped.hpp),
// compiled here by the host compiler and checked against k3/mx.hpp's MX decoders (the contract's
// values) without a GPU: the prepack re-encoding of MXFP4 weights as E4M3 codes under BF16 scales
// per 64 columns, the per-expert group entries the device builds from the sort's counts, and the
// activation over GEMM1's FP32 rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cuda/moe/moe_grouped.hpp"
#include "k3/activation.hpp"
#include "k3/formats.hpp"
#include "k3/mx.hpp"

namespace k3::cuda::moe_detail {
namespace {

bool same_bits(float a, float b) { return f32_to_bits(a) == f32_to_bits(b); }

// E4M3 code under a BF16 scale, as the GEMM forms the operand: E4M3 -> BF16 (exact) times the
// BF16 scale (an exponent add while the product is a normal number).
float sm90_weight_value(uint8_t e4m3, uint16_t scale_bf16) {
  return mx_decode_element(e4m3, 127, MxElement::kE4M3) * bf16_to_f32(scale_bf16);
}

// Every E2M1 code at every allowed shift: the E4M3 code is exactly the E2M1 value times 2^shift
// (signed zeros included); the two shifts just outside the range are not representable.
TEST(CudaMoeGrouped, E2m1ToE4m3IsExactForEveryCodeAndShift) {
  for (int shift = kSm90MinShift; shift <= kSm90MaxShift; ++shift) {
    for (uint8_t code = 0; code < 16; ++code) {
      const float want = mx_decode_element(code, static_cast<uint8_t>(127 + shift), MxElement::kE2M1);
      const uint8_t e4m3 = e2m1_to_e4m3(code, shift);
      const float got = mx_decode_element(e4m3, 127, MxElement::kE4M3);
      EXPECT_TRUE(same_bits(got, want)) << "code " << int(code) << " shift " << shift << ": " << got << " vs " << want;
      EXPECT_NE(e4m3 & 0x7F, 0x7F) << "never the NaN code";
    }
  }
  // 0.5 x 2^-9 is below E4M3's smallest subnormal, 6 x 2^7 = 768 above its maximum 448.
  EXPECT_LT(std::ldexp(0.5f, kSm90MinShift - 1), std::ldexp(1.0f, -9));
  EXPECT_GT(std::ldexp(6.0f, kSm90MaxShift + 1), 448.0f);
}

// The BF16 group scale 2^(e - 127) equals the E8M0 scale's value for every code it takes.
TEST(CudaMoeGrouped, GroupScaleIsTheE8m0Value) {
  for (int e = 1; e <= 254; ++e) {
    const float want = mx_decode_element(2, static_cast<uint8_t>(e), MxElement::kE2M1);  // E2M1 2 = 1.0
    EXPECT_TRUE(same_bits(bf16_to_f32(sm90_scale_bf16(e)), want)) << e;
    EXPECT_EQ(std::fpclassify(bf16_to_f32(sm90_scale_bf16(e))), FP_NORMAL) << e;
  }
}

// Two MX blocks (one 64-column group) with every pair of scale codes: when the nonzero blocks'
// exponents are at most 14 apart the row encodes and every weight is the contract's value
// (mx_decode_element), NaN blocks (0xFF) included; otherwise the encoder names group 0.
TEST(CudaMoeGrouped, RowEncodingIsExactForEveryScalePairOrRefused) {
  std::mt19937 rng(7);
  uint8_t q[32];
  for (auto& b : q) b = static_cast<uint8_t>(rng());
  q[3] = 0x11;  // both blocks hold nonzero codes whatever rng gave
  q[20] = 0x99;
  for (int e0 = 0; e0 <= 255; ++e0) {
    for (int e1 = 0; e1 <= 255; ++e1) {
      const uint8_t s[2] = {static_cast<uint8_t>(e0), static_cast<uint8_t>(e1)};
      uint8_t codes[64];
      uint16_t scale = 0xFFFF;
      const int64_t bad = sm90_encode_row(q, s, 64, codes, &scale, 1);
      const bool nan0 = e0 == kE8M0Nan, nan1 = e1 == kE8M0Nan;
      int lo = 1, hi = 254;
      const bool nz0 = true, nz1 = true;  // q[3] / q[20] make both blocks nonzero
      if (!nan0 && nz0) {
        lo = std::max(lo, e0 - 6);
        hi = std::min(hi, e0 + 8);
      }
      if (!nan1 && nz1) {
        lo = std::max(lo, e1 - 6);
        hi = std::min(hi, e1 + 8);
      }
      ASSERT_EQ(bad, lo <= hi ? -1 : 0) << e0 << " " << e1;
      if (bad >= 0) continue;
      for (int col = 0; col < 64; ++col) {
        const uint8_t e2m1 = col % 2 ? fp4_high(q[col / 2]) : fp4_low(q[col / 2]);
        const float want = mx_decode_element(e2m1, s[col / 32], MxElement::kE2M1);
        const float got = sm90_weight_value(codes[col], scale);
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(got)) << e0 << " " << e1 << " col " << col;
        } else {
          ASSERT_TRUE(same_bits(got, want)) << e0 << " " << e1 << " col " << col << ": " << got << " vs " << want;
        }
      }
    }
  }
}

// All-zero blocks do not constrain the group (any scale, both signs of zero kept); a K that is an
// odd multiple of 32 ends with a one-block group; the scales land MN-major (stride = rows).
TEST(CudaMoeGrouped, ZeroBlocksPartialGroupsAndScaleStride) {
  const int64_t k = 96;                           // groups [0, 64) and [64, 96)
  uint8_t q[48] = {};
  q[0] = 0x80;                                    // +0 and -0
  q[16] = 0x10;                                   // block 1: 0 and 0.5 (x 2^-124 = 2^-125)
  q[40] = 0x27;                                   // block 2: 6 and 1
  const uint8_t s[3] = {250, 3, 3};               // 250 next to 3: fine, block 0 holds zeros only
  uint8_t codes[96];
  uint16_t scales[2 * 5] = {};
  ASSERT_EQ(sm90_encode_row(q, s, k, codes, scales, 5), -1);
  EXPECT_EQ(codes[0], 0x00);
  EXPECT_EQ(codes[1], 0x80);                      // -0 stays -0
  for (int col = 0; col < 96; ++col) {
    const uint8_t e2m1 = col % 2 ? fp4_high(q[col / 2]) : fp4_low(q[col / 2]);
    const float want = mx_decode_element(e2m1, s[col / 32], MxElement::kE2M1);
    EXPECT_TRUE(same_bits(sm90_weight_value(codes[col], scales[(col / 64) * 5]), want)) << col;
  }
  for (int i = 0; i < 10; ++i) {
    if (i != 0 && i != 5) {
      EXPECT_EQ(scales[i], 0) << "only every 5th entry is written: " << i;
    }
  }
  q[2] = 0x01;                                    // now block 0 holds 0.5 x 2^123 next to 2^-125
  EXPECT_EQ(sm90_encode_row(q, s, k, codes, scales, 5), 0);
}

// A host model of the sort's counts / padded starts, random counts with empty experts and the
// largest shapes: each group's rows and outputs stay inside the expert's own padded segment, the
// weights / scales of expert e start where the prepacked layout puts them.
TEST(CudaMoeGrouped, GroupEntriesFollowTheSortAndStayInTheirSegments) {
  std::mt19937 rng(3);
  for (int round = 0; round < 200; ++round) {
    const int e_local = 1 + static_cast<int>(rng() % 64);
    const int64_t k = 32 * (1 + rng() % 8), m_w = 32 * (1 + rng() % 8);
    const int block_m = 64;
    std::vector<int32_t> count(e_local), start(e_local);
    int32_t off = 0;
    for (int e = 0; e < e_local; ++e) {
      count[e] = rng() % 3 == 0 ? 0 : static_cast<int32_t>(rng() % 300);
      start[e] = off;
      off += (count[e] + block_m - 1) / block_m * block_m;
    }
    for (int e = 0; e < e_local; ++e) {
      const GroupedEntry g = grouped_entry(e, count[e], start[e], m_w, k);
      EXPECT_EQ(g.m, m_w);
      EXPECT_EQ(g.n, count[e]);
      EXPECT_EQ(g.k, k);
      EXPECT_EQ(g.a_off, e * m_w * k);
      EXPECT_EQ(g.s_off, e * m_w * sm90_scale_groups(k));
      EXPECT_EQ(g.b_off, int64_t{start[e]} * k);
      EXPECT_EQ(g.d_off, int64_t{start[e]} * m_w);
      const int64_t seg_end = e + 1 < e_local ? start[e + 1] : off;
      EXPECT_LE(g.b_off + int64_t{g.n} * k, seg_end * k) << "operand rows past the expert's segment";
      EXPECT_LE(g.d_off + int64_t{g.n} * m_w, seg_end * m_w) << "output rows past the expert's segment";
    }
  }
  // The largest plan: 4096 local experts, K 16384 x 2N 32768 weights, 65536 x 32 slots.
  const GroupedEntry big = grouped_entry(4095, 2097152, 2097152 + 4095 * 63, 32768, 16384);
  EXPECT_EQ(big.a_off, int64_t{4095} * 32768 * 16384);
  EXPECT_EQ(big.s_off, int64_t{4095} * 32768 * 256);
  EXPECT_EQ(big.b_off, (int64_t{2097152} + 4095 * 63) * 16384);
  EXPECT_EQ(grouped_entry(2, -1, 0, 64, 64).n, 0) << "a negative count is an empty group";
}

// The activation block equals the contract's pieces from k3/mx.hpp: W4A16 BF16-rounds the
// activation; W4A8 quantizes the block to MXFP8 (RCEIL) and dequantizes it exactly, NaN blocks
// stay NaN, and values in BF16's subnormal range are reported.
TEST(CudaMoeGrouped, ActivationBlockMatchesTheMxCodec) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (ActivationKind kind : {ActivationKind::kSiTU, ActivationKind::kSwiGLU, ActivationKind::kSiLU}) {
    for (int round = 0; round < 50; ++round) {
      float g[32], u[32], v[32];
      for (int j = 0; j < 32; ++j) g[j] = nd(rng), u[j] = nd(rng);
      if (round == 7) g[5] = std::numeric_limits<float>::quiet_NaN();
      const float alpha = 1.702f, beta = 1.0f, limit = 7.0f, b = 0.8f, lb = 1.1f;
      for (int j = 0; j < 32; ++j) v[j] = activation_f32(kind, alpha, beta, limit, b, lb, g[j], u[j]);
      uint16_t out[32];
      ASSERT_TRUE(grouped_act_block(Recipe::kW4A16, kind, alpha, beta, limit, b, lb, g, u, out));
      for (int j = 0; j < 32; ++j) EXPECT_EQ(out[j], bf16_from_f32(v[j])) << j;
      uint8_t codes[32];
      const uint8_t sc = mx_quantize_block(v, MxElement::kE4M3, ScaleRule::kRceil, codes);
      ASSERT_TRUE(grouped_act_block(Recipe::kW4A8, kind, alpha, beta, limit, b, lb, g, u, out));
      for (int j = 0; j < 32; ++j) {
        const float want = mx_decode_element(codes[j], sc, MxElement::kE4M3);
        if (std::isnan(want)) {
          EXPECT_TRUE(std::isnan(bf16_to_f32(out[j]))) << j;
        } else {
          EXPECT_EQ(bf16_to_f32(out[j]), want) << j;
        }
      }
    }
  }
  float g[32], u[32];
  for (int j = 0; j < 32; ++j) g[j] = 1e-20f, u[j] = j == 0 ? 1e-19f : 1e-30f;  // SiLU ~ g * u / 2 ~ 1e-39 .. 1e-50
  uint16_t out[32];
  EXPECT_FALSE(grouped_act_block(Recipe::kW4A8, ActivationKind::kSiLU, 0, 0, 0, 1, 1, g, u, out));
}

}  // namespace
}  // namespace k3::cuda::moe_detail
