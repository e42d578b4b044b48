// Inner pieces of the CPU MoE backend: the MXFP8 block quantizer, exp / tanh, the activations and
// situ_and_mul, the tiled weight layout and the BF16 operand scaling.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/moe/elementwise.hpp"
#include "cpu/moe/layout.hpp"
#include "cpu/moe/operand.hpp"
#include "k3/cpu_moe.hpp"
#include "k3/formats.hpp"
#include "k3/moe_ref.hpp"
#include "k3/mx.hpp"

namespace k3 {
namespace {

using namespace cpu::detail;

// exp / tanh: relative error bound in FP32 ulps (2^-23 relative), over the tested range.
constexpr double kExpUlps = 4;
constexpr double kTanhUlps = 8;
// situ_and_mul vs the FP64 reference rounded to FP32: relative error (a few FP32 ulps of the
// several rounded steps of the formula).
constexpr double kSituRel = 2e-6;

std::vector<IsaLevel> levels() {
  std::vector<IsaLevel> v;
  for (int l = 0; l <= static_cast<int>(best_isa_level()); ++l) v.push_back(static_cast<IsaLevel>(l));
  return v;
}

TEST(CpuMoeKernels, E4M3BlockQuantizerMatchesTheCodecBitForBit) {
  std::mt19937_64 rng(1);
  std::normal_distribution<float> nd;
  std::vector<std::vector<float>> blocks;
  for (int b = 0; b < 3000; ++b) {  // magnitudes from 2^-140 to 2^120
    std::vector<float> v(32);
    const int e = static_cast<int>(rng() % 260) - 140;
    for (auto& x : v) x = std::ldexp(nd(rng), e);
    blocks.push_back(v);
  }
  std::vector<float> special(32, 0.f);
  special = {0.f, -0.f, 448.f, -448.f, 480.f, 1e-40f, -1e-45f, 0.0009765625f, 0.001953125f, 0.0029296875f,
             17.f, 18.f, 19.f, 0.015625f, 0.0146484375f, 0.0048828125f, 240.f, 232.f, 248.f, 6.f, -2.75f, 3.25f,
             INFINITY, 1.f, 2.f, 3.f, 5.f, 7.f, 9.f, 11.f, 13.f, 15.f};
  blocks.push_back(special);  // Inf: scale 0xFE, saturation
  special[22] = -INFINITY;
  blocks.push_back(special);
  special[5] = std::nanf("");
  blocks.push_back(special);  // NaN: scale 0xFF, zero codes
  std::vector<float> ties(32);
  for (int i = 0; i < 32; ++i) ties[static_cast<size_t>(i)] = 448.f * static_cast<float>(i) / 31.f + 0.5f;  // 0.5-steps
  blocks.push_back(ties);
  for (IsaLevel l : levels()) {
    const Elementwise& ew = elementwise(l);
    for (size_t b = 0; b < blocks.size(); ++b) {
      uint8_t want[32], got[32];
      const uint8_t ws = mx_quantize_block(blocks[b].data(), MxElement::kE4M3, ScaleRule::kRceil, want);
      const uint8_t gs = ew.quantize_e4m3_block(blocks[b].data(), got);
      ASSERT_EQ(gs, ws) << isa_level_name(l) << " block " << b;
      for (int i = 0; i < 32; ++i) ASSERT_EQ(got[i], want[i]) << isa_level_name(l) << " block " << b << " element " << i;
    }
  }
}

double ulp_error(float got, double want) {
  if (want == 0) return got == 0 ? 0 : INFINITY;
  return std::fabs(static_cast<double>(got) - want) / std::fabs(want) * 8388608.0;
}

TEST(CpuMoeKernels, ExpAndTanhAreAccurateAndSaturate) {
  double worst_exp = 0, worst_tanh = 0;
  for (double x = -87.0; x <= 88.5; x += 0.0137) {
    worst_exp = std::max(worst_exp, ulp_error(exp_f32(static_cast<float>(x)), std::exp(static_cast<double>(static_cast<float>(x)))));
  }
  for (double x = -12.0; x <= 12.0; x += 0.00071) {
    const float xf = static_cast<float>(x);
    worst_tanh = std::max(worst_tanh, ulp_error(tanh_f32(xf), std::tanh(static_cast<double>(xf))));
  }
  EXPECT_LE(worst_exp, kExpUlps);
  EXPECT_LE(worst_tanh, kTanhUlps);
  EXPECT_EQ(exp_f32(89.f), INFINITY);
  EXPECT_EQ(exp_f32(INFINITY), INFINITY);
  EXPECT_EQ(exp_f32(-INFINITY), 0.f);
  EXPECT_TRUE(std::isnan(exp_f32(std::nanf(""))));
  EXPECT_EQ(tanh_f32(100.f), 1.f);
  EXPECT_EQ(tanh_f32(-INFINITY), -1.f);
  EXPECT_EQ(tanh_f32(0.f), 0.f);
  EXPECT_TRUE(std::isnan(tanh_f32(std::nanf(""))));
  EXPECT_EQ(tanh_f32(1e-30f), 1e-30f);
}

TEST(CpuMoeKernels, ActivationsMatchTheReferenceAndEveryLevelGivesTheSameBits) {
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.f, 4.f);
  const int64_t n = 1000;
  std::vector<float> g(n), u(n);
  for (int64_t i = 0; i < n; ++i) g[i] = nd(rng), u[i] = nd(rng);
  g[0] = 200.f, u[0] = -300.f;            // saturation
  g[1] = std::nanf(""), u[2] = std::nanf("");
  g[3] = 1e-20f, u[3] = 5e-21f;          // tiny
  Activation a;
  for (ActivationKind kind : {ActivationKind::kSiTU, ActivationKind::kSwiGLU, ActivationKind::kSiLU}) {
    a.kind = kind;
    ActParams p;
    p.kind = kind;
    std::vector<float> first;
    for (IsaLevel l : levels()) {
      std::vector<float> out(n);
      elementwise(l).activate(p, g.data(), u.data(), out.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const double want = activation_ref(a, g[i], u[i], 4.0, 25.0);
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(out[i])) << activation_name(kind) << " " << i;
        } else {
          ASSERT_LE(std::fabs(out[i] - want), kSituRel * std::max(std::fabs(want), 1e-30) + 1e-37)
              << activation_name(kind) << " " << i << " g " << g[i] << " u " << u[i];
        }
      }
      if (first.empty()) {
        first = out;
      } else {
        for (int64_t i = 0; i < n; ++i) {  // same bits (any NaN equals any NaN: payloads may differ)
          if (std::isnan(first[i]) && std::isnan(out[i])) continue;
          ASSERT_EQ(0, std::memcmp(&first[i], &out[i], sizeof(float))) << isa_level_name(l) << " " << i;
        }
      }
    }
  }
}

TEST(CpuMoeKernels, SituAndMulHonoursTheRowStrideAndMatchesTheReference) {
  const int64_t rows = 7, d = 100, ld = 230;
  std::vector<float> in(static_cast<size_t>((rows - 1) * ld + 2 * d));
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 3.f);
  for (auto& v : in) v = nd(rng);
  std::vector<float> got(rows * d), want(rows * d);
  ASSERT_TRUE(cpu::situ_and_mul(in, rows, d, ld, 4.f, 25.f, got).is_ok());
  ASSERT_TRUE(situ_and_mul_ref(in, rows, d, ld, 4.f, 25.f, want).is_ok());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_LE(std::fabs(got[i] - want[i]), kSituRel * std::fabs(want[i]) + 1e-37) << i;
  }
  // Errors name the argument.
  auto msg = [&](int64_t r, int64_t dd, int64_t l, float b, size_t in_n, size_t out_n) {
    std::vector<float> i2(in_n), o2(out_n);
    return cpu::situ_and_mul(i2, r, dd, l, b, 25.f, o2).message();
  };
  EXPECT_NE(msg(2, 10, 15, 4.f, 100, 20).find("ld = 15 must be >= 2*d = 20"), std::string::npos);
  EXPECT_NE(msg(2, 10, 20, 4.f, 39, 20).find("in has 39 elements"), std::string::npos);
  EXPECT_NE(msg(2, 10, 20, 4.f, 40, 21).find("out has 21 elements, expected rows*d = 20"), std::string::npos);
  EXPECT_NE(msg(2, 10, 20, 0.f, 40, 20).find("beta = 0"), std::string::npos);
  EXPECT_NE(msg(-1, 10, 20, 4.f, 40, 20).find("rows = -1"), std::string::npos);
  EXPECT_NE(msg(1, 0, 20, 4.f, 40, 20).find("d = 0"), std::string::npos);
}

TEST(CpuMoeKernels, PrepackedLayoutHoldsEveryCodeAndScaleOnce) {
  // Unpack the records with the documented offsets and compare with the checkpoint tensors.
  MoeProblem p;
  p.shape = {96, 64, 3, 2, 1, 0};
  const int64_t el = 3, k = 96, n = 64;
  std::mt19937_64 rng(4);
  std::vector<uint8_t> f1q(el * 2 * n * k / 2), f1s(el * 2 * n * k / 32), f2q(el * k * n / 2), f2s(el * k * n / 32);
  for (auto& b : f1q) b = static_cast<uint8_t>(rng());
  for (auto& b : f2q) b = static_cast<uint8_t>(rng());
  for (auto& b : f1s) b = static_cast<uint8_t>(1 + rng() % 254);
  for (auto& b : f2s) b = static_cast<uint8_t>(1 + rng() % 254);
  auto plan = cpu::plan(p, {});
  ASSERT_TRUE(plan.is_ok());
  auto packed = cpu::prepack(plan.value(), {f1q, f1s, f2q, f2s, {}, {}});
  ASSERT_TRUE(packed.is_ok()) << packed.status().to_string();
  EXPECT_EQ(packed->bytes(), static_cast<int64_t>(f1q.size() + f1s.size() + f2q.size() + f2s.size()));
  auto check = [&](const uint8_t* base, int groups, int64_t tiles, int64_t red, auto row_of, const std::vector<uint8_t>& q,
                   const std::vector<uint8_t>& s, int64_t e, int64_t rows) {
    for (int64_t j = 0; j < tiles; ++j) {
      for (int64_t b = 0; b < red / 32; ++b) {
        const uint8_t* rec = base + (j * (red / 32) + b) * record_bytes(groups);
        for (int g = 0; g < groups; ++g) {
          for (int lane = 0; lane < 16; ++lane) {
            const int64_t row = row_of(j, g) + lane;
            ASSERT_EQ(rec[record_code_bytes(groups) + g * 16 + lane], s[(e * rows + row) * (red / 32) + b]);
            for (int el2 = 0; el2 < 32; ++el2) {
              const uint8_t byte = rec[record_code_offset(groups, g, lane, el2)];
              const uint8_t code = record_code_high(g) ? byte >> 4 : byte & 15;
              const int64_t col = b * 32 + el2;
              const uint8_t src = q[(e * rows + row) * (red / 2) + col / 2];
              ASSERT_EQ(code, col % 2 ? src >> 4 : src & 15) << "expert " << e << " row " << row << " col " << col;
            }
          }
        }
      }
    }
  };
  for (int64_t e = 0; e < el; ++e) {
    check(packed->fc1(e), kFc1Groups, n / 32, k, [n = n](int64_t j, int g) { return (g >= 2 ? n : 0) + j * 32 + (g & 1) * 16; },
          f1q, f1s, e, 2 * n);
    check(packed->fc2(e), kFc2Groups, k / 32, n, [](int64_t j, int g) { return j * 32 + g * 16; }, f2q, f2s, e, k);
  }
}

TEST(CpuMoeKernels, OperandShiftKeepsBf16DotProductsExact) {
  EXPECT_EQ(choose_shift(0, -1), 0);               // no nonzero value
  EXPECT_EQ(choose_shift(-118, 119), 0);           // already in range
  EXPECT_EQ(choose_shift(-130, 10), 12);           // tiny values scaled up
  EXPECT_EQ(choose_shift(-10, 125), -6);           // huge values scaled down
  EXPECT_EQ(choose_shift(-133, 105), kShiftFail);  // span > 2^237
  // BF16 row with subnormals: values * 2^shift exactly, nonzero magnitudes >= 2^-118.
  std::vector<uint16_t> row = {0x0001, 0x8003, 0x0040, 0x3F80, 0x0000, 0x8000, 0x7F80, 0x7FC0};
  std::vector<uint16_t> out(row.size());
  const int32_t s = bf16_row_to_bf16(row.data(), static_cast<int64_t>(row.size()), out.data());
  EXPECT_EQ(s, 15);  // lowest magnitude 2^-133
  for (size_t i = 0; i < row.size(); ++i) {
    const float a = bf16_to_f32(row[i]), b = bf16_to_f32(out[i]);
    if (std::isnan(a)) {
      EXPECT_TRUE(std::isnan(b));
    } else {
      EXPECT_EQ(std::ldexp(static_cast<double>(a), s), static_cast<double>(b)) << i;
    }
  }
  // MXFP8 row with a tiny block scale: dequantized * 2^shift exactly.
  std::vector<uint8_t> codes(64), scales = {3, 130};
  for (int i = 0; i < 64; ++i) codes[static_cast<size_t>(i)] = static_cast<uint8_t>((i * 37) & 0xFE);
  std::vector<uint16_t> q(64);
  const int32_t s8 = mxfp8_row_to_bf16(codes.data(), scales.data(), 64, q.data());
  EXPECT_GT(s8, 0);
  std::vector<float> f(64);
  mxfp8_row_to_f32(codes.data(), scales.data(), 64, f.data());
  for (int i = 0; i < 64; ++i) {
    const double want = std::ldexp(static_cast<double>(mx_decode_element(codes[static_cast<size_t>(i)], scales[static_cast<size_t>(i) / 32], MxElement::kE4M3)), s8);
    EXPECT_EQ(static_cast<double>(bf16_to_f32(q[static_cast<size_t>(i)])), want) << i;
    EXPECT_EQ(static_cast<double>(f[static_cast<size_t>(i)]), std::ldexp(want, -s8)) << i;
  }
}

// The FP32 levels' dequantization of an MXFP8 row gives every code (both signs, zeros, the
// largest, subnormals, NaN) times every kind of scale (the smallest, 2^0, large, NaN) bit for bit
// as the codec: value(code) * 2^(s - 127).
TEST(CpuMoeKernels, Mxfp8RowToFp32IsTheCodecForEveryCodeAndScale) {
  const std::vector<uint8_t> scale_codes = {0, 1, 3, 100, 127, 130, 200, 254, kE8M0Nan};
  std::vector<uint8_t> codes(256 * scale_codes.size()), scales;
  for (size_t j = 0; j < scale_codes.size(); ++j) {
    for (int c = 0; c < 256; ++c) codes[j * 256 + static_cast<size_t>(c)] = static_cast<uint8_t>(c);
    for (int b = 0; b < 256 / kMxBlock; ++b) scales.push_back(scale_codes[j]);
  }
  std::vector<float> got(codes.size());
  mxfp8_row_to_f32(codes.data(), scales.data(), static_cast<int64_t>(codes.size()), got.data());
  for (size_t i = 0; i < codes.size(); ++i) {
    const float want = e4m3_to_f32(codes[i]) * e8m0_to_f32(scales[i / kMxBlock]);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got[i])) << "code " << int{codes[i]} << " scale " << int{scales[i / kMxBlock]};
    } else {
      EXPECT_EQ(f32_to_bits(want), f32_to_bits(got[i])) << "code " << int{codes[i]} << " scale " << int{scales[i / kMxBlock]};
    }
  }
}

// Operand rows for the FP32 tile kernels: Gaussian FP32 (24-bit significands: no block has an
// integer view), BF16 and E4M3 values (most blocks have one), blocks at the integer view's limits
// (|xi| = 2^15 - 1 everywhere, the largest partial sums; a lowest bit exactly 2^14 or 2^15 below
// the maximum; subnormals; magnitudes 2^100 and 2^101), zeros of both signs, an Inf and a NaN.
std::vector<float> fp32_operand_rows(std::mt19937_64& rng, int64_t rows, int64_t len) {
  std::vector<float> ops(static_cast<size_t>(rows * len));
  std::normal_distribution<float> nd;
  for (int64_t r = 0; r < rows; ++r) {
    float* x = ops.data() + r * len;
    for (int64_t i = 0; i < len; ++i) {
      const float v = nd(rng);
      switch (r % 4) {
        case 0: x[i] = v; break;                                    // FP32
        case 1: x[i] = bf16_to_f32(bf16_from_f32(v)); break;        // BF16
        case 2: x[i] = e4m3_to_f32(static_cast<uint8_t>(rng() & 0x7E)) * (v < 0 ? -1.f : 1.f); break;  // E4M3
        default: x[i] = std::ldexp(static_cast<float>(static_cast<int>(rng() % 65535) - 32767), -14); break;
      }
    }
  }
  ops[3] = 1e-40f;                                  // subnormal operand (FP32 row)
  ops[static_cast<size_t>(len + 5)] = 0.f;
  ops[static_cast<size_t>(len + 6)] = -0.f;
  ops[static_cast<size_t>(2 * len + 7)] = 3e37f;    // huge (partial sums stay finite)
  ops[static_cast<size_t>(5 * len + 1)] = std::nanf("");
  if (rows > 9) {
    float* x = ops.data() + 7 * len;  // integer-view row: block 0 at |xi| = 2^15 - 1 throughout
    for (int i = 0; i < kBlock; ++i) x[i] = std::ldexp((i & 1) ? -32767.f : 32767.f, -14);
    x = ops.data() + 9 * len;  // BF16 row: block 0 has a lowest bit 2^15 below its maximum
    x[0] = 1.f;
    x[1] = std::ldexp(1.f, -15);
  }
  if (rows > 13 && len >= 3 * kBlock) {
    float* x = ops.data() + 13 * len;  // BF16 row: subnormal block, 2^100 block, 2^101 block
    for (int i = 0; i < kBlock; ++i) {
      x[i] = std::ldexp(static_cast<float>(i - 16), -140);
      x[kBlock + i] = std::ldexp(static_cast<float>(i + 1), 95);
      x[2 * kBlock + i] = std::ldexp(static_cast<float>(i + 1), 96);
    }
  }
  if (rows > 17 && len >= kBlock) ops[static_cast<size_t>(17 * len + 2)] = -std::numeric_limits<float>::infinity();
  return ops;
}

// The AVX2 kernel's integer view of a block exists exactly when x = xi * 2^(e-14) with |xi| < 2^15
// (e = floor(log2 max|x|)), and then holds those xi.
TEST(CpuMoeKernels, IntegerViewsAreExactAndExistExactlyWithinTheirRange) {
  if (best_isa_level() < IsaLevel::kAvx2) GTEST_SKIP() << "the integer view is part of the AVX2 kernel";
  auto view = [](const std::vector<float>& x, std::vector<int16_t>& xi) {
    xi.assign(kBlock, 0);
    return int_view_block(x.data(), xi.data());
  };
  auto check_exact = [](const std::vector<float>& x, const std::vector<int16_t>& xi, float half) {
    for (int i = 0; i < kBlock; ++i) {
      EXPECT_EQ(static_cast<double>(x[static_cast<size_t>(i)]),
                static_cast<double>(xi[static_cast<size_t>(i)]) * 2.0 * static_cast<double>(half)) << i;
    }
  };
  std::vector<int16_t> xi;
  std::vector<float> x(kBlock, 0.f);
  x[4] = -0.f;
  EXPECT_EQ(view(x, xi), 1.f);  // zeros of either sign: xi = 0
  for (int16_t v : xi) EXPECT_EQ(v, 0);
  // Largest |xi| and the lowest bit exactly 2^14 below the maximum: a view, T/2 = 2^-15.
  for (int i = 0; i < kBlock; ++i) x[static_cast<size_t>(i)] = std::ldexp(static_cast<float>((i % 2 ? -1 : 1) * (32767 - i)), -14);
  x[5] = std::ldexp(1.f, -14);
  float h = view(x, xi);
  EXPECT_EQ(h, std::ldexp(1.f, -15));
  check_exact(x, xi, h);
  EXPECT_EQ(xi[0], 32767);
  EXPECT_EQ(xi[5], 1);
  x[5] = std::ldexp(1.f, -15);  // one bit lower: no view
  EXPECT_EQ(view(x, xi), 0.f);
  x[5] = 0.f;
  // Every BF16 block whose span fits gets an exact view; at 2^100 a block still does, at 2^101 it
  // does not (partial sums kept far from overflow).
  std::mt19937_64 rng(5);
  int viewed = 0;
  for (int trial = 0; trial < 200; ++trial) {
    // BF16 magnitudes in [1, 128): exponents within 7 of each other, so lowest bits within 2^14
    for (auto& v : x) v = bf16_to_f32(static_cast<uint16_t>(0x3F80 + rng() % 0x0380 + ((rng() & 1) << 15)));
    const float hv = view(x, xi);
    if (hv != 0.f) {
      ++viewed;
      check_exact(x, xi, hv);
    }
  }
  EXPECT_EQ(viewed, 200);
  for (int i = 0; i < kBlock; ++i) x[static_cast<size_t>(i)] = std::ldexp(static_cast<float>(i + 1), 95);  // max 2^100
  h = view(x, xi);
  EXPECT_NE(h, 0.f);
  check_exact(x, xi, h);
  x[0] = std::ldexp(1.f, 101);
  EXPECT_EQ(view(x, xi), 0.f);
  // Subnormal values: a view with T/2 = 2^-141 when they are multiples of 2^-140.
  for (int i = 0; i < kBlock; ++i) x[static_cast<size_t>(i)] = std::ldexp(static_cast<float>(i - 16), -140);
  h = view(x, xi);
  EXPECT_EQ(h, std::ldexp(1.f, -141));
  check_exact(x, xi, h);
  x[3] = std::ldexp(1.f, -149);  // the smallest subnormal is not a multiple of 2^-140
  EXPECT_EQ(view(x, xi), 0.f);
  // NaN and Inf: no view.
  x.assign(kBlock, 1.f);
  x[9] = std::nanf("");
  EXPECT_EQ(view(x, xi), 0.f);
  x[9] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(view(x, xi), 0.f);
  // A row: the views of its blocks, then their T/2.
  std::vector<float> row(3 * kBlock, 0.5f);
  row[kBlock] = std::nanf("");
  std::vector<int16_t> rv(static_cast<size_t>(int_view_bytes(3 * kBlock) / 2));
  int_view_row(row.data(), 3 * kBlock, rv.data());
  float halves[3];
  std::memcpy(halves, rv.data() + 3 * kBlock, sizeof(halves));
  EXPECT_EQ(halves[0], std::ldexp(1.f, -16));
  EXPECT_EQ(halves[1], 0.f);
  EXPECT_EQ(halves[2], std::ldexp(1.f, -16));
  EXPECT_EQ(rv[0], 16384);
  int32_t offsets[3];  // 12 * sum(xi) per block (the kernel's 2w + 12 weights), 0 without a view
  std::memcpy(offsets, rv.data() + 3 * kBlock + 2 * 3, sizeof(offsets));
  EXPECT_EQ(offsets[0], 12 * 32 * 16384);
  EXPECT_EQ(offsets[1], 0);
  EXPECT_EQ(offsets[2], 12 * 32 * 16384);
}

// `blocks` records of random codes; scales random in 1..254, or all 127 (2^0).
std::vector<uint8_t> random_records(std::mt19937_64& rng, int groups, int64_t blocks, bool unit_scales) {
  std::vector<uint8_t> rec(static_cast<size_t>(blocks * record_bytes(groups)));
  for (auto& b : rec) b = static_cast<uint8_t>(rng());
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* sc = rec.data() + b * record_bytes(groups) + record_code_bytes(groups);
    for (int i = 0; i < groups * kLanes; ++i) sc[i] = unit_scales ? 127 : static_cast<uint8_t>(1 + rng() % 254);
  }
  return rec;
}

// Random records with, where the tile is long enough, an all-zero block with scale code 0 (block 0,
// allowed by prepack) and a block of +-6 codes only (block 2: the largest integer sums).
std::vector<uint8_t> records_with_edge_blocks(std::mt19937_64& rng, int groups, int64_t blocks) {
  auto rec = random_records(rng, groups, blocks, false);
  if (blocks > 1) {
    std::memset(rec.data(), 0, static_cast<size_t>(record_code_bytes(groups)));
    std::memset(rec.data() + record_code_bytes(groups), 0, static_cast<size_t>(groups * kLanes));
  }
  if (blocks > 2) {
    uint8_t* c = rec.data() + 2 * record_bytes(groups);
    for (int64_t i = 0; i < record_code_bytes(groups); ++i) c[i] = (i % 3) ? 0x77 : 0xF7;
  }
  return rec;
}

// Every FP32 tile kernel (AVX2 + FMA: direct for 1-3 rows, integer or FP32 per block, panel with
// register tiles above) gives the portable kernel's bits for every row count 1..kRowGroup, both
// tile shapes, all 16 codes, scale codes 1..254 and all-zero blocks with code 0, odd block counts
// (the FC2 two-block direct path's tail), the operand rows above, and with the rows' integer views
// given by the caller (as run() does) or made by the kernel.
TEST(CpuMoeKernels, Fp32TileKernelsMatchThePortableKernelBitForBit) {
  std::mt19937_64 rng(11);
  for (int groups : {kFc1Groups, kFc2Groups}) {
    for (int64_t blocks : {int64_t{1}, int64_t{3}, int64_t{8}, int64_t{67}}) {
      const auto rec = records_with_edge_blocks(rng, groups, blocks);
      const int64_t len = blocks * kBlock;
      const std::vector<float> ops = fp32_operand_rows(rng, kRowGroup, len);
      // Row orders: all rows from the first, from the last, and the rows that are not plain FP32
      // (so that 4..6-row tasks mix blocks with and without views).
      std::vector<std::vector<int64_t>> orders(3);
      for (int64_t r = 0; r < kRowGroup; ++r) {
        orders[0].push_back(r);
        orders[1].push_back(kRowGroup - 1 - r);
        if (r % 4 != 0) orders[2].push_back(r);
      }
      std::vector<std::vector<int16_t>> view_rows(kRowGroup);
      const int64_t width = groups * kLanes;
      for (IsaLevel l : levels()) {
        if (l == IsaLevel::kScalar || l == IsaLevel::kAvx512Bf16) continue;
        for (int64_t r = 0; r < kRowGroup; ++r) {
          view_rows[static_cast<size_t>(r)].resize(static_cast<size_t>(int_view_bytes(len) / 2));
          int_view_row(ops.data() + r * len, len, view_rows[static_cast<size_t>(r)].data());
        }
        for (size_t o = 0; o < orders.size(); ++o) {
          std::vector<const void*> rows;
          std::vector<const int16_t*> views;
          for (int64_t r : orders[o]) {
            rows.push_back(ops.data() + r * len);
            views.push_back(view_rows[static_cast<size_t>(r)].data());
          }
          for (int64_t nr = 1; nr <= static_cast<int64_t>(rows.size()); ++nr) {
            std::vector<float> want(static_cast<size_t>(nr * width), -1.f), got(want.size(), -2.f);
            alignas(64) static uint8_t panel[kPanelScratchBytes];
            TileGemm g{rec.data(), blocks, groups, rows.data(), nr, want.data(), panel};
            tile_gemm_fp32(IsaLevel::kScalar)(g);
            for (bool given : {false, true}) {
              for (bool avx_vnni : {false, true}) {  // the integer form: VPMADDWD + VPADDD, or AVX-VNNI's
                g.totals = got.data();
                g.views = given ? views.data() : nullptr;
                tile_gemm_fp32(l, avx_vnni)(g);
                ASSERT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)))
                    << isa_level_name(l) << " groups " << groups << " blocks " << blocks << " rows " << nr
                    << " order " << o << (given ? " (views given)" : "") << " avx_vnni " << avx_vnni;
              }
            }
          }
        }
      }
    }
  }
}

// A direct kernel computes viewed blocks from the row's integer view alone: the view with one
// integer off (element `index`) changes the result; with no block viewed the kernel reads the
// operand row itself and gives the first result again.
void expect_kernel_reads_views(TileGemmFn fn, const std::vector<uint8_t>& rec, int groups, int64_t blocks,
                               const void* row, std::vector<int16_t> view, int64_t index, const char* what) {
  const int16_t* vrow = view.data();
  std::vector<float> want(static_cast<size_t>(groups * kLanes)), got(want.size());
  alignas(64) static uint8_t panel[kPanelScratchBytes];
  TileGemm g{rec.data(), blocks, groups, &row, 1, want.data(), panel};
  g.views = &vrow;
  fn(g);
  view[static_cast<size_t>(index)] = static_cast<int16_t>(view[static_cast<size_t>(index)] + 1);
  g.totals = got.data();
  fn(g);
  EXPECT_NE(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float))) << what;
  std::memset(view.data() + blocks * kBlock, 0, static_cast<size_t>(blocks) * sizeof(float));  // every 2^(e-15) = 0
  fn(g);
  EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float))) << what;
}

// The AVX2 kernel reads the views (so the bit-identity above covers the integer path).
TEST(CpuMoeKernels, Avx2DirectKernelReadsTheIntegerViews) {
  if (best_isa_level() < IsaLevel::kAvx2) GTEST_SKIP() << "no AVX2";
  const int64_t blocks = 4, len = blocks * kBlock;
  std::mt19937_64 rng(3);
  const auto rec = random_records(rng, kFc1Groups, blocks, true);
  std::vector<float> x(static_cast<size_t>(len));
  for (auto& v : x) v = bf16_to_f32(bf16_from_f32(std::normal_distribution<float>()(rng)));
  std::vector<int16_t> view(static_cast<size_t>(int_view_bytes(len) / 2));
  int_view_row(x.data(), len, view.data());
  float half1;
  std::memcpy(&half1, view.data() + len + 1 * 2, sizeof(half1));
  ASSERT_NE(half1, 0.f) << "block 1 of a BF16 Gaussian row should have a view";
  // Every form of the integer kernel this CPU runs: VPMADDWD + VPADDD, AVX-VNNI's VEX VPDPWSSD,
  // AVX512-VNNI's EVEX VPDPWSSD.
  const auto& f = cpu_info().features;
  expect_kernel_reads_views(tile_gemm_avx2(IntMac::kMadd), rec, kFc1Groups, blocks, x.data(), view, kBlock + 3,
                            "vpmaddwd");
  if (f.avx_vnni) {
    expect_kernel_reads_views(tile_gemm_avx2(IntMac::kAvxVnni), rec, kFc1Groups, blocks, x.data(), view, kBlock + 3,
                              "vex vpdpwssd");
  }
  if (f.avx512_vnni && f.avx512vl) {
    expect_kernel_reads_views(tile_gemm_avx2(IntMac::kAvx512Vnni), rec, kFc1Groups, blocks, x.data(), view,
                              kBlock + 3, "evex vpdpwssd");
  }
}

// Which integer form each level picks: AVX-VNNI only where the CPU has it and the caller allows it
// (MoeOptions::avx_vnni), AVX512-VNNI only above the AVX2 level.
TEST(CpuMoeKernels, IntegerFormFollowsTheCpuAndTheOption) {
  const auto& f = cpu_info().features;
  const IntMac vex = f.avx_vnni ? IntMac::kAvxVnni : IntMac::kMadd;
  EXPECT_EQ(int_mac_form(IsaLevel::kAvx2, true), vex);
  EXPECT_EQ(int_mac_form(IsaLevel::kAvx2, false), IntMac::kMadd);
  const bool evex = f.avx512_vnni && f.avx512vl;
  EXPECT_EQ(int_mac_form(IsaLevel::kAvx512, true), evex ? IntMac::kAvx512Vnni : vex);
  EXPECT_EQ(int_mac_form(IsaLevel::kAvx512, false), evex ? IntMac::kAvx512Vnni : IntMac::kMadd);
}

std::vector<uint16_t> bf16_operand_rows(std::mt19937_64& rng, int64_t rows, int64_t len) {
  std::vector<uint16_t> ops(static_cast<size_t>(rows * len));
  std::normal_distribution<float> nd;
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* x = ops.data() + r * len;
    for (int64_t i = 0; i < len; ++i) {
      const float v = nd(rng);
      const float sign = v < 0 ? -1.f : 1.f;
      const float m = 1.f + static_cast<float>(rng() % 128) / 128.f;  // 8 significant bits
      float f = v;
      switch (r % 6) {
        case 0: f = v; break;
        case 1: f = sign * std::ldexp(m, -118 + static_cast<int>(rng() % 12)); break;  // low end
        case 2: f = sign * std::ldexp(m, 108 + static_cast<int>(rng() % 12)); break;   // high end
        case 3: f = e4m3_to_f32(static_cast<uint8_t>(rng() & 0x7E)) * sign; break;
        case 4: f = sign * std::ldexp(m, (i % 7 == 3) ? -20 : 0); break;  // no view where both meet
        default: f = sign * std::ldexp(1.9921875f, 3); break;  // every xi = +-32640
      }
      x[i] = bf16_from_f32(f);
    }
  }
  ops[static_cast<size_t>(5)] = 0x0000;
  ops[static_cast<size_t>(6)] = 0x8000;
  return ops;
}

// The avx512bf16 tile kernel with the rows' integer views (VPDPWSSD on the blocks viewed in every
// row of a direct task) gives exactly the bits of its VDPBF16PS-only form, and both give the
// portable FP32 kernel's bits on the same values, for every row count (direct <= 4 rows, panel
// above), both tile shapes, all codes, scale codes 1..254, a zero block with code 0 and blocks
// of +-6 codes only.
TEST(CpuMoeKernels, Bf16TileKernelGivesTheSameBitsWithIntegerViews) {
  if (best_isa_level() != IsaLevel::kAvx512Bf16) GTEST_SKIP() << "no AVX512-BF16";
  if (!uses_int_views(IsaLevel::kAvx512Bf16)) GTEST_SKIP() << "no AVX512-VNNI: the BF16 kernel reads no views";
  std::mt19937_64 rng(23);
  for (int groups : {kFc1Groups, kFc2Groups}) {
    for (int64_t blocks : {int64_t{1}, int64_t{3}, int64_t{8}, int64_t{67}}) {
      const auto rec = records_with_edge_blocks(rng, groups, blocks);
      const int64_t len = blocks * kBlock;
      const std::vector<uint16_t> ops = bf16_operand_rows(rng, kRowGroup, len);
      std::vector<float> f32(ops.size());
      for (size_t i = 0; i < ops.size(); ++i) f32[i] = bf16_to_f32(ops[i]);
      std::vector<std::vector<int16_t>> view_rows(kRowGroup);
      int64_t viewed = 0, unviewed = 0;
      for (int64_t r = 0; r < kRowGroup; ++r) {
        view_rows[static_cast<size_t>(r)].resize(static_cast<size_t>(int_view_bytes(len) / 2));
        int_view_row_bf16(ops.data() + r * len, len, view_rows[static_cast<size_t>(r)].data());
        const auto* half = reinterpret_cast<const float*>(view_rows[static_cast<size_t>(r)].data() + len);
        for (int64_t b = 0; b < blocks; ++b) (half[b] != 0.f ? viewed : unviewed) += 1;
      }
      ASSERT_GT(viewed, 0);
      if (blocks > 1) {
        ASSERT_GT(unviewed, 0);
      }
      const int64_t width = groups * kLanes;
      // Row orders: in turn, reversed, and the rows with views in every block first.
      std::vector<std::vector<int64_t>> orders(3);
      for (int64_t r = 0; r < kRowGroup; ++r) {
        orders[0].push_back(r);
        orders[1].push_back(kRowGroup - 1 - r);
        if (r % 6 != 4) orders[2].push_back(r);
      }
      for (size_t o = 0; o < orders.size(); ++o) {
        std::vector<const void*> rows, frows;
        std::vector<const int16_t*> views;
        for (int64_t r : orders[o]) {
          rows.push_back(ops.data() + r * len);
          frows.push_back(f32.data() + r * len);
          views.push_back(view_rows[static_cast<size_t>(r)].data());
        }
        for (int64_t nr = 1; nr <= static_cast<int64_t>(rows.size()); ++nr) {
          std::vector<float> want(static_cast<size_t>(nr * width), -1.f), plain(want.size(), -2.f),
              got(want.size(), -3.f);
          alignas(64) static uint8_t panel[kPanelScratchBytes];
          TileGemm g{rec.data(), blocks, groups, frows.data(), nr, want.data(), panel};
          tile_gemm_fp32(IsaLevel::kScalar)(g);
          g.rows = rows.data();
          g.totals = plain.data();
          tile_gemm_bf16()(g);
          g.totals = got.data();
          g.views = views.data();
          tile_gemm_bf16()(g);
          ASSERT_EQ(0, std::memcmp(plain.data(), got.data(), got.size() * sizeof(float)))
              << "views vs none: groups " << groups << " blocks " << blocks << " rows " << nr << " order " << o;
          ASSERT_EQ(0, std::memcmp(want.data(), got.data(), got.size() * sizeof(float)))
              << "vs portable: groups " << groups << " blocks " << blocks << " rows " << nr << " order " << o;
        }
      }
    }
  }
}

// The avx512bf16 direct kernel reads the views of BF16 rows too.
TEST(CpuMoeKernels, Bf16DirectKernelReadsTheIntegerViews) {
  if (best_isa_level() != IsaLevel::kAvx512Bf16) GTEST_SKIP() << "no AVX512-BF16";
  if (!uses_int_views(IsaLevel::kAvx512Bf16)) GTEST_SKIP() << "no AVX512-VNNI: the BF16 kernel reads no views";
  const int64_t blocks = 4, len = blocks * kBlock;
  std::mt19937_64 rng(5);
  const auto rec = random_records(rng, kFc2Groups, blocks, true);
  std::vector<uint16_t> x(static_cast<size_t>(len));
  for (auto& v : x) v = bf16_from_f32(std::normal_distribution<float>()(rng));
  std::vector<int16_t> view(static_cast<size_t>(int_view_bytes(len) / 2));
  int_view_row_bf16(x.data(), len, view.data());
  float half2;
  std::memcpy(&half2, view.data() + len + 2 * 2, sizeof(half2));
  ASSERT_NE(half2, 0.f) << "block 2 of a BF16 Gaussian row should have a view";
  expect_kernel_reads_views(tile_gemm_bf16(), rec, kFc2Groups, blocks, x.data(), view, 2 * kBlock + 9, "bf16");
}

TEST(CpuMoeKernels, PlanDescribesTheBlockingOfEachLevel) {
  MoeProblem p;
  p.shape = {3584, 3072, 896, 16, 32, 7};
  for (IsaLevel l : levels()) {
    for (bool avx_vnni : {true, false}) {
      cpu::MoeOptions o;
      o.isa = l;
      o.avx_vnni = avx_vnni;
      auto plan = cpu::plan(p, o);
      ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
      EXPECT_EQ(plan->avx_vnni, avx_vnni);
      const std::string d = plan->describe();
      EXPECT_NE(d.find(std::string("isa ") + isa_level_name(l) + " (kernel " + plan->blocking.kernel + ")"),
                std::string::npos) << d;
      EXPECT_NE(d.find(std::string(plan->blocking.register_tile) + " register tiles"), std::string::npos) << d;
      if (l == IsaLevel::kAvx2 || l == IsaLevel::kAvx512) {
        EXPECT_EQ(plan->blocking.direct_max_rows, kDirectMaxRowsAvx2);
        EXPECT_EQ(plan->blocking.panel_blocks, kPanelBlocksAvx2);
        const auto& f = cpu_info().features;
        const bool evex = l == IsaLevel::kAvx512 && f.avx512_vnni && f.avx512vl;
        EXPECT_STREQ(plan->blocking.kernel, evex                      ? "avx2 fma + int16 vpdpwssd"
                                            : avx_vnni && f.avx_vnni ? "avx2 fma + int16 vpdpwssd (avx-vnni)"
                                                                     : "avx2 fma + int16 madd");
      }
      if (l == IsaLevel::kAvx512Bf16) {
        EXPECT_STREQ(plan->blocking.kernel, uses_int_views(l) ? "avx512bf16 vdpbf16ps + int16 vpdpwssd" : "avx512bf16 vdpbf16ps");
      }
    }
  }
}

}  // namespace
}  // namespace k3
