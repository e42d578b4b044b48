// Tile GEMM on AVX2 + FMA (also used by the AVX-512 FP32 level): MXFP4 weight tiles x FP32
// operand rows, FP32 totals. Designed for 16 YMM registers and 8 FP32 lanes.
//
// Arithmetic (identical to the portable body in gemm_fp32.cpp, so every FP32 level gives the
// same bits): per 32-element block and output lane, a partial sum from +0 over the k-pairs,
// odd element first, one FMA per product (E2M1 value x operand, exact); then
// totals = fma(partial, 2^(s-127), totals). Lanes are output rows, so vectorizing over them
// keeps every lane's operation order.
//
// E2M1 -> FP32 in registers: one 32-byte load of codes (16 lanes x 2 k, two groups in the two
// nibbles) is split into nibbles, looked up with two VPSHUFB tables (low and high byte of the
// BF16 pattern, exact for every E2M1 value), interleaved to BF16 words with VPUNPCK{L,H}BW and
// widened to FP32 with a shift (even k) or a mask (odd k): 19 instructions for 64 weights, no
// cross-lane shuffle. The in-lane unpack leaves lanes in the order {0-3, 8-11} / {4-7, 12-15}
// ("halves"); accumulators, scales and totals use that order and the totals are put back in
// lane order at the end of the tile.
//
// Weight sources with identical arithmetic (results do not depend on which one runs):
//   direct  <= kDirectMaxRowsAvx2 rows (decode): weights expanded in registers, used by every
//           row at once; the tile streams from memory once, with software prefetch a few records
//           ahead. Blocks whose operand rows all have an integer view (below) take exact int16
//           dot products (up to 6 rows, in subgroups of at most 4 rows while the record is in
//           L1); the others the FP32 FMA chain (up to 3 rows; 4-6 rows: the panel).
//   panel   more rows: kPanelBlocksAvx2 blocks are dequantized once into an FP32 panel in L1
//           ([block][k][2G vectors of 8]), then streamed by register tiles of up to 6 rows x
//           16 lanes (12 accumulators + 2 weight vectors + 1 broadcast = 15 YMM registers).
#include <immintrin.h>

#include <cstring>

#include "cpu/moe/layout.hpp"
#include "cpu/prefetch.hpp"

#define K3_TARGET_AVX2 __attribute__((target("avx2,fma")))

namespace k3::cpu::detail {
namespace {

static_assert(int64_t{kPanelBlocksAvx2} * kBlock * kFc1Groups * kLanes * 4 <= kPanelScratchBytes,
              "the FP32 panel must fit the per-thread panel scratch");

// Low and high byte of the BF16 pattern of E2M1 code c (c = 0..15: +0, 0.5, 1, 1.5, 2, 3, 4, 6,
// -0, -0.5, ..., -6), repeated in both 128-bit lanes for VPSHUFB.
alignas(32) constexpr uint8_t kLoByte[32] = {0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0,
                                             0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0,
                                             0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0,
                                             0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0};
alignas(32) constexpr uint8_t kHiByte[32] = {0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
                                             0x80, 0xBF, 0xBF, 0xBF, 0xC0, 0xC0, 0xC0, 0xC0,
                                             0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
                                             0x80, 0xBF, 0xBF, 0xBF, 0xC0, 0xC0, 0xC0, 0xC0};
// Scale bytes of one group (16 lanes) reordered to the halves' lane order.
alignas(16) constexpr uint8_t kHalfOrder[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

struct Decoder {
  __m256i nibble, odd, lo, hi;
  K3_TARGET_AVX2 Decoder()
      : nibble(_mm256_set1_epi8(0x0F)),
        odd(_mm256_set1_epi32(static_cast<int>(0xFFFF0000u))),
        lo(_mm256_load_si256(reinterpret_cast<const __m256i*>(kLoByte))),
        hi(_mm256_load_si256(reinterpret_cast<const __m256i*>(kHiByte))) {}
};

// 32 codes of one nibble plane -> w[half][parity] (parity 0 = even element 2kp, 1 = odd 2kp+1).
K3_TARGET_AVX2 inline void expand_plane(__m256i codes, const Decoder& d, __m256 (&w)[2][2]) {
  const __m256i b_lo = _mm256_shuffle_epi8(d.lo, codes), b_hi = _mm256_shuffle_epi8(d.hi, codes);
  const __m256i words[2] = {_mm256_unpacklo_epi8(b_lo, b_hi), _mm256_unpackhi_epi8(b_lo, b_hi)};
  for (int h = 0; h < 2; ++h) {
    w[h][0] = _mm256_castsi256_ps(_mm256_slli_epi32(words[h], 16));
    w[h][1] = _mm256_castsi256_ps(_mm256_and_si256(words[h], d.odd));
  }
}

// The 32 code bytes of (k-pair, group pair p) -> w[nibble][half][parity]; nibble 0 = group 2p.
K3_TARGET_AVX2 inline void expand_pair(const uint8_t* codes, const Decoder& d, __m256 (&w)[2][2][2]) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  expand_plane(_mm256_and_si256(raw, d.nibble), d, w[0]);
  expand_plane(_mm256_and_si256(_mm256_srli_epi16(raw, 4), d.nibble), d, w[1]);
}

// 16 E8M0 codes of one group -> FP32 scales 2^(s-127) of the two halves (s = 0 gives +0.0, which
// prepack allows only for all-zero blocks).
K3_TARGET_AVX2 inline void group_scales(const uint8_t* s, __m256 (&out)[2]) {
  const __m128i perm = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)),
                                        _mm_load_si128(reinterpret_cast<const __m128i*>(kHalfOrder)));
  out[0] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(perm), 23));
  out[1] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(perm, 8)), 23));
}

inline void prefetch_record(const uint8_t* r, int64_t bytes) { prefetch_bytes(r, bytes); }

// End of a record's pass: totals[m][lanes of group g, half h] = fma(partial[m][n - n0][h], scale,
// totals), for the groups of nibble planes [n0, n0 + PL) of pair p0, in block order.
template <int MR, int G, int PL>
__attribute__((always_inline)) K3_TARGET_AVX2 inline void add_scaled(const uint8_t* r, int p0, int n0, float* totals,
                                                                    const __m256 (&partial)[MR * PL * 2]) {
  const uint8_t* sc = r + record_code_bytes(G);
#pragma GCC unroll 2
  for (int n = n0; n < n0 + PL; ++n) {
    const int g = 2 * p0 + n;
    __m256 s[2];
    group_scales(sc + g * kLanes, s);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        float* t = totals + m * G * kLanes + (g * 2 + h) * 8;
        _mm256_storeu_ps(t, _mm256_fmadd_ps(partial[(m * PL + (n - n0)) * 2 + h], s[h], _mm256_loadu_ps(t)));
      }
    }
  }
}

// FP32 direct, one record: MR rows over the lanes of group pair p0, nibble planes [n0, n0 + PL):
// MR * PL * 2 accumulators of two dependent FMAs per k-pair (at most 8: enough independent chains
// for the FMA latency); each nibble plane is expanded and consumed at once (2 weight vectors
// live), broadcasts of x once per k-pair; every accumulator sees its odd element before its even.
template <int MR, int G, int PL>
__attribute__((always_inline)) K3_TARGET_AVX2 inline void fp32_record_rows(const uint8_t* r, int64_t b, int p0, int n0,
                                                                          const float* const* rows, float* totals) {
  static_assert(MR * PL * 2 <= 8 && (PL == 1 || PL == 2), "register budget");
  const Decoder d;
  __m256 acc[MR * PL * 2];  // [row][plane][half]
  for (auto& v : acc) v = _mm256_setzero_ps();
#pragma GCC unroll 1
  for (int kp = 0; kp < kPairs; ++kp) {
    __m256 x_odd[MR], x_even[MR];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const float* x = rows[m] + b * kBlock + 2 * kp;
      x_odd[m] = _mm256_broadcast_ss(x + 1);
      x_even[m] = _mm256_broadcast_ss(x);
    }
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + (kp * (G / 2) + p0) * 32));
#pragma GCC unroll 2
    for (int n = n0; n < n0 + PL; ++n) {
      const __m256i codes = _mm256_and_si256(n == 0 ? raw : _mm256_srli_epi16(raw, 4), d.nibble);
      const __m256i b_lo = _mm256_shuffle_epi8(d.lo, codes), b_hi = _mm256_shuffle_epi8(d.hi, codes);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i words = h == 0 ? _mm256_unpacklo_epi8(b_lo, b_hi) : _mm256_unpackhi_epi8(b_lo, b_hi);
        const __m256 w_odd = _mm256_castsi256_ps(_mm256_and_si256(words, d.odd));
        const __m256 w_even = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          __m256& acc_ = acc[(m * PL + (n - n0)) * 2 + h];
          acc_ = _mm256_fmadd_ps(w_odd, x_odd[m], acc_);
          acc_ = _mm256_fmadd_ps(w_even, x_even[m], acc_);
        }
      }
    }
  }
  add_scaled<MR, G, PL>(r, p0, n0, totals, acc);
}

// ---- Exact integer block dots (direct path) ------------------------------------------------
//
// When every product w * x of a block and every partial sum of the FP32 chain is exactly
// representable, the chain rounds nowhere and its result is the exact block dot product, which
// integer arithmetic computes in any order. An operand block has an integer view when
//   x[k] = xi[k] * T  for every k, with T = 2^(e-14), e = floor(log2 max |x|), |xi[k]| < 2^15.
// Then with wi = 2w (E2M1 values are multiples of 1/2, |wi| <= 12):
//   * each product w * x[k] = wi * xi[k] * T/2 has |wi * xi[k]| < 2^19 and each partial sum is
//     an integer multiple of T/2 below 12 * 32 * 2^15 < 2^24 in magnitude, with T/2 >= 2^-141:
//     all representable in FP32 (no rounding, no underflow; e <= kIntViewMaxExp keeps them far
//     from overflow), so the FP32 chain's partial is exactly (sum of wi * xi[k]) * T/2;
//   * the integer sum fits in int32 and converts to FP32 exactly, and a zero sum gives +0, as the
//     chain does (it starts from +0 and x + (-x) rounds to +0).
// BF16 operands (W4A16) have 8 significant bits and MXFP8 ones (W4A8) 4, so most blocks have
// such a view: a block lacks one only if some nonzero element's lowest set bit lies more than
// 2^14 below the block's largest magnitude (or it holds a NaN, an Inf or a value >= 2^101).
// Blocks without a view run the FP32 kernel above; both give the same bits by construction, and
// tests compare them with the portable kernel for both kinds of blocks.
//
// Weights: one VPSHUFB gives wi + 12 as an unsigned byte and VPUNPCK{L,H}BW with zero widens it to
// int16 words (word pair = the even and odd k of one lane, in the halves' lane order of the FP32
// kernel); VPMADDWD with the broadcast int16 pair (xi[2kp], xi[2kp+1]) adds both products into
// the lane's int32 accumulator, and 12 * sum(xi) of the block (kept with the view) is subtracted
// once per record. 19 instructions per 64 weights for one row instead of 30.
inline constexpr int kIntViewMaxExp = 100;
inline constexpr int kDirectMaxRowsFp32 = 3;  // FP32 direct kernel: up to 4 rows (8 accumulators)
inline constexpr int64_t kIntViewChunk = 64;  // blocks whose integer views are made at once

// 2w + 12 for every E2M1 code (w = +-0, 0.5, ..., 6): a nonnegative byte, so that a zero byte
// widens it to an int16 word; the kernel subtracts 12 * sum(xi) of the block afterwards.
alignas(32) constexpr uint8_t kTwiceE2M1Plus12[32] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                                      12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
inline constexpr int32_t kWeightOffset = 12;

// 2^p as an FP32 (p in [-149, 127], subnormal below -126).
inline float exp2_f32(int p) {
  const uint32_t bits = p >= -126 ? static_cast<uint32_t>(p + 127) << 23 : uint32_t{1} << (p + 149);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace

K3_TARGET_AVX2 float int_view_block(const float* x, int16_t* xi) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i v[4];
  __m256i m = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8 * i));
    m = _mm256_max_epu32(m, _mm256_and_si256(v[i], abs_mask));  // |x| bits; NaN and Inf above all
  }
  m = _mm256_max_epu32(m, _mm256_permute2x128_si256(m, m, 1));
  m = _mm256_max_epu32(m, _mm256_shuffle_epi32(m, 0x4E));
  m = _mm256_max_epu32(m, _mm256_shuffle_epi32(m, 0xB1));
  const auto amax = static_cast<uint32_t>(_mm256_cvtsi256_si32(m));
  if (amax == 0) {  // all zeros (of either sign): the sum is +0
    std::memset(xi, 0, kBlock * sizeof(int16_t));
    return 1.f;
  }
  const int biased = static_cast<int>(amax >> 23);
  if (biased > 127 + kIntViewMaxExp) return 0.f;  // huge, Inf or NaN
  const int e = (biased == 0 ? 1 : biased) - 127;  // a subnormal maximum counts as 2^-126
  // x * 2^(14-e) in two exact steps (2^(14-e) itself may exceed the FP32 range).
  const int up = 14 - e, up1 = up < 127 ? up : 127;
  const __m256 f1 = _mm256_set1_ps(exp2_f32(up1)), f2 = _mm256_set1_ps(exp2_f32(up - up1));
  const __m256 t = _mm256_set1_ps(exp2_f32(e - 14));
  __m256i q[4];
  int ok = 0xFF;
  for (int i = 0; i < 4; ++i) {
    const __m256 xv = _mm256_castsi256_ps(v[i]);
    q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(xv, f1), f2));
    // xi * T is exact (|xi| <= 2^15, T >= 2^-140), so equality means x = xi * T exactly.
    ok &= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q[i]), t), xv, _CMP_EQ_OQ));
  }
  if (ok != 0xFF) return 0.f;
  // |xi| < 2^15: the saturating pack is exact; it interleaves 128-bit lanes, the permute undoes it.
  for (int i = 0; i < 2; ++i) {
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * i], q[2 * i + 1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xi + 16 * i), p);
  }
  return exp2_f32(e - 15);
}

K3_TARGET_AVX2 int32_t int_view_offset(const int16_t* xi) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s = _mm256_add_epi32(_mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi)), ones),
                               _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi + 16)), ones));
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  return kWeightOffset * _mm_cvtsi128_si32(h);  // |sum| <= 32 * 32767: no overflow
}

void int_view_row(const float* row, int64_t len, int16_t* view) {
  auto* half = reinterpret_cast<float*>(view + len);
  auto* offset = reinterpret_cast<int32_t*>(half + len / kBlock);
  for (int64_t b = 0; b < len / kBlock; ++b) {
    half[b] = int_view_block(row + b * kBlock, view + b * kBlock);
    offset[b] = half[b] != 0.f ? int_view_offset(view + b * kBlock) : 0;
  }
}

void int_view_row_bf16(const uint16_t* row, int64_t len, int16_t* view) {
  auto* half = reinterpret_cast<float*>(view + len);
  auto* offset = reinterpret_cast<int32_t*>(half + len / kBlock);
  float x[kBlock];
  for (int64_t b = 0; b < len / kBlock; ++b) {
    for (int i = 0; i < kBlock; ++i) {
      const uint32_t bits = uint32_t{row[b * kBlock + i]} << 16;
      std::memcpy(&x[i], &bits, sizeof(float));
    }
    half[b] = int_view_block(x, view + b * kBlock);
    offset[b] = half[b] != 0.f ? int_view_offset(view + b * kBlock) : 0;
  }
}

bool uses_int_views(IsaLevel l) {
  return l == IsaLevel::kAvx2 || l == IsaLevel::kAvx512 ||
         (l == IsaLevel::kAvx512Bf16 && cpu_info().features.avx512_vnni);
}

namespace {

// Integer direct, one record: CNT rows (xi[m], half[m], offset[m], totals row m at totals +
// m * G * 16) over the lanes of group pair p0, nibble planes [n0, n0 + PL); CNT * PL * 2 int32
// accumulators of sum (2w + 12) * xi, minus the row's 12 * sum(xi) of the block at the end.
// One int16 multiply-add step of the integer kernel: acc += (w[2i] * x[2i] + w[2i+1] * x[2i+1]) per
// int32 lane, in one of three forms with the same integers (no saturation: |w| <= 24, |x| < 2^15):
//   IntMac::kMadd        VPMADDWD + VPADDD (every AVX2 CPU);
//   IntMac::kAvxVnni     one VEX VPDPWSSD (AVX-VNNI: Alder Lake, Sierra Forest, Zen 5);
//   IntMac::kAvx512Vnni  one EVEX VPDPWSSD (AVX512-VNNI + AVX512-VL, on the AVX-512 FP32 level).
// Inline assembly, because this file is compiled for AVX2 + FMA only (GCC 12, clang 14 and
// binutils accept the {vex} / {evex} encoding prefixes).
template <IntMac kMac>
__attribute__((always_inline)) K3_TARGET_AVX2 inline __m256i int_mac(__m256i acc, __m256i w, __m256i x) {
  if constexpr (kMac == IntMac::kAvx512Vnni) {
    __asm__("%{evex%} vpdpwssd %[x], %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "v"(x));
    return acc;
  } else if constexpr (kMac == IntMac::kAvxVnni) {
    __asm__("%{vex%} vpdpwssd %[x], %[w], %[acc]" : [acc] "+x"(acc) : [w] "x"(w), [x] "x"(x));
    return acc;
  } else {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
  }
}

template <int CNT, int G, int PL, IntMac kMac>
__attribute__((always_inline)) K3_TARGET_AVX2 inline void int_record_rows(const uint8_t* r, int64_t xo, int64_t hb, int p0,
                                                                         int n0, const int16_t* const* xi,
                                                                         const float* const* half,
                                                                         const int32_t* const* offset, float* totals,
                                                                         const uint8_t* prefetch) {
  static_assert(CNT * PL * 2 <= 8 && (PL == 1 || PL == 2), "register budget");  // + 6 more: 14 of 16
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i tab_w = _mm256_load_si256(reinterpret_cast<const __m256i*>(kTwiceE2M1Plus12));
  const __m256i zero = _mm256_setzero_si256();
  __m256i acc[CNT * PL * 2];  // [row][plane][half]
  for (auto& v : acc) v = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int kp = 0; kp < kPairs; ++kp) {
    if (prefetch != nullptr) {  // one line of a later record's codes per k-pair (see direct_mixed)
      prefetch_line(prefetch + kp * (record_code_bytes(G) / kPairs));
    }
    // Per nibble plane: its weights ([half]), then per row one broadcast of its int16 pair and its
    // multiply-adds (two weight registers and one broadcast live, so that 4 rows fit 16 registers).
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + (kp * (G / 2) + p0) * 32));
#pragma GCC unroll 2
    for (int n = n0; n < n0 + PL; ++n) {
      const __m256i codes = _mm256_and_si256(n == 0 ? raw : _mm256_srli_epi16(raw, 4), nibble);
      const __m256i wv = _mm256_shuffle_epi8(tab_w, codes);
      const __m256i w16[2] = {_mm256_unpacklo_epi8(wv, zero), _mm256_unpackhi_epi8(wv, zero)};
#pragma GCC unroll 4
      for (int m = 0; m < CNT; ++m) {
        int32_t pair;
        std::memcpy(&pair, xi[m] + xo + 2 * kp, sizeof(pair));
        const __m256i xp = _mm256_set1_epi32(pair);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          __m256i& a = acc[(m * PL + (n - n0)) * 2 + h];
          a = int_mac<kMac>(a, w16[h], xp);
        }
      }
    }
  }
  __m256 partial[CNT * PL * 2];  // the FP32 chain's partial sums: (acc - 12 * sum(xi)) * T/2, exact
#pragma GCC unroll 8
  for (int m = 0; m < CNT; ++m) {
    const __m256i off = _mm256_set1_epi32(offset[m][hb]);
    const __m256 hv = _mm256_set1_ps(half[m][hb]);
#pragma GCC unroll 4
    for (int i = 0; i < PL * 2; ++i) {
      partial[m * PL * 2 + i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[m * PL * 2 + i], off)), hv);
    }
  }
  add_scaled<CNT, G, PL>(r, p0, n0, totals, partial);
}

template <int G>
void panel_range(const TileGemm& a, int64_t rows, int64_t b0, int64_t b1, const float* const* r, float* t);

// Direct path of MR rows over blocks [c0, c1), with the rows' integer views (xi[m], half[m],
// indexed from block `base`): one loop over the records, each streamed from memory once, with
// software prefetch kAhead records ahead (without it `k3 bench moe` at M = 1 was slower). The
// prefetch runs past the tile's end, into the next tile of the expert, which follows in memory
// (a prefetch never faults). A record taking the integer kernel spreads the prefetch of the later
// record over its first pass, one line per k-pair, rather than issuing the 17 lines at once: on
// the Intel Xeon guest `k3 bench moe --isa avx2` M = 1 W4A8 then took 7.4 against 8.1 ms (three
// alternated runs; docs/cpu_moe.md). A record whose
// rows all have a view takes the integer kernel (one row: both nibble planes per pass; more
// rows: one plane per pass, in subgroups of at most 4 rows (5, 6 rows: 3 + 2, 3 + 3; 4 rows in one
// subgroup instead of 2 + 2: BM_DequantDotCached/rows:4 25.6 -> 22.7 us on the Intel Xeon guest),
// while the record stays in L1; with VPDPWSSD two rows take both planes per pass: its 5-cycle
// latency bounds a pass with 4 accumulators, 8 hide it (`BM_DequantDotCached/rows:2/op:1` 10.5 ->
// 8.9 us there; VPMADDWD + VPADDD has no such chain and keeps one plane); any other the FP32 kernel: directly for up to 3 rows, through the panel for 4-6 (the FP32
// direct kernel with 4 rows was slower than the panel), one call per run of such records.
template <int MR, int G, IntMac kMac>
__attribute__((noinline)) K3_TARGET_AVX2 void direct_mixed(const TileGemm& a, int64_t c0, int64_t c1, int64_t base,
                                                           const int16_t* const* xi, const float* const* half,
                                                           const int32_t* const* offset, const float* const* rows,
                                                           float* totals) {
  constexpr int kAhead = 4;
  constexpr int kPlInt = MR == 1 || (MR == 2 && kMac != IntMac::kMadd) ? 2 : 1, kSub = MR <= 4 ? MR : 3;
  constexpr int kFull = MR / kSub, kRest = MR % kSub;
  constexpr int kPlFp32 = MR == 3 ? 1 : 2;
  const int64_t rec = record_bytes(G);
  int64_t fp32_run = -1;  // 4-6 rows: first record of a run waiting for the panel
  for (int64_t b = c0; b < c1; ++b) {
    const uint8_t* r = a.records + b * rec;
    const uint8_t* ahead = r + kAhead * rec;
    const int64_t hb = b - base;
    bool viewed = true;
    for (int m = 0; m < MR; ++m) viewed = viewed && half[m][hb] != 0.f;
    if (!viewed) prefetch_record(ahead, rec);
    if (viewed) {
      prefetch_line(ahead + record_code_bytes(G));  // its scales
      if constexpr (MR > kDirectMaxRowsFp32) {
        if (fp32_run >= 0) panel_range<G>(a, MR, fp32_run, b, rows, totals);
        fp32_run = -1;
      }
      for (int pp = 0; pp < G / 2 * (2 / kPlInt); ++pp) {  // (group pair, nibble-plane pass)
        const int p0 = kPlInt == 2 ? pp : pp / 2, n0 = kPlInt == 2 ? 0 : pp % 2;
#pragma GCC unroll 1
        for (int q = 0; q < kFull; ++q) {
          int_record_rows<kSub, G, kPlInt, kMac>(r, hb * kBlock, hb, p0, n0, xi + q * kSub, half + q * kSub,
                                           offset + q * kSub, totals + q * kSub * G * kLanes,
                                           pp == 0 && q == 0 ? ahead : nullptr);
        }
        if constexpr (kRest > 0) {
          int_record_rows<kRest, G, kPlInt, kMac>(r, hb * kBlock, hb, p0, n0, xi + kFull * kSub, half + kFull * kSub,
                                            offset + kFull * kSub, totals + kFull * kSub * G * kLanes,
                                            pp == 0 && kFull == 0 ? ahead : nullptr);
        }
      }
    } else if constexpr (MR <= kDirectMaxRowsFp32) {
      for (int pp = 0; pp < G / 2 * (2 / kPlFp32); ++pp) {
        const int p0 = kPlFp32 == 2 ? pp : pp / 2, n0 = kPlFp32 == 2 ? 0 : pp % 2;
        fp32_record_rows<MR, G, kPlFp32>(r, b, p0, n0, rows, totals);
      }
    } else {
      if (fp32_run < 0) fp32_run = b;
    }
  }
  if constexpr (MR > kDirectMaxRowsFp32) {
    if (fp32_run >= 0) panel_range<G>(a, MR, fp32_run, c1, rows, totals);
  }
}

// Direct path of MR rows: the integer views given with the task, or made here kIntViewChunk
// blocks at a time.
template <int MR, int G, IntMac kMac>
K3_TARGET_AVX2 void direct_rows_any(const TileGemm& a, const float* const* rows, float* totals) {
  const int16_t* xi[MR];
  const float* half[MR];
  const int32_t* offset[MR];
  if (a.views != nullptr) {
    for (int m = 0; m < MR; ++m) {
      xi[m] = a.views[m];
      half[m] = reinterpret_cast<const float*>(a.views[m] + a.blocks * kBlock);
      offset[m] = reinterpret_cast<const int32_t*>(half[m] + a.blocks);
    }
    direct_mixed<MR, G, kMac>(a, 0, a.blocks, 0, xi, half, offset, rows, totals);
    return;
  }
  alignas(32) int16_t xi_buf[MR][kIntViewChunk * kBlock];
  float half_buf[MR][kIntViewChunk];
  int32_t offset_buf[MR][kIntViewChunk];
  for (int m = 0; m < MR; ++m) {
    xi[m] = xi_buf[m];
    half[m] = half_buf[m];
    offset[m] = offset_buf[m];
  }
  for (int64_t c0 = 0; c0 < a.blocks; c0 += kIntViewChunk) {
    const int64_t c1 = c0 + kIntViewChunk < a.blocks ? c0 + kIntViewChunk : a.blocks;
    for (int m = 0; m < MR; ++m) {
      for (int64_t b = c0; b < c1; ++b) {
        int16_t* v = xi_buf[m] + (b - c0) * kBlock;
        half_buf[m][b - c0] = int_view_block(rows[m] + b * kBlock, v);
        offset_buf[m][b - c0] = half_buf[m][b - c0] != 0.f ? int_view_offset(v) : 0;
      }
    }
    direct_mixed<MR, G, kMac>(a, c0, c1, c0, xi, half, offset, rows, totals);
  }
}

// Dequantize blocks [b0, b1) of the tile into the panel: [block][k][2G vectors of 8 FP32],
// vector index = group * 2 + half.
template <int G>
__attribute__((noinline)) K3_TARGET_AVX2 void fill_panel(const TileGemm& a, int64_t b0, int64_t b1, float* panel) {
  const Decoder d;
  const int64_t rec = record_bytes(G);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* r = a.records + b * rec;
    float* dst = panel + (b - b0) * kBlock * 2 * G * 8;
    for (int kp = 0; kp < kPairs; ++kp) {
      for (int p = 0; p < G / 2; ++p) {
        __m256 w[2][2][2];
        expand_pair(r + (kp * (G / 2) + p) * 32, d, w);
        for (int n = 0; n < 2; ++n)
          for (int h = 0; h < 2; ++h)
            for (int par = 0; par < 2; ++par)
              _mm256_storeu_ps(dst + ((2 * kp + par) * 2 * G + (2 * p + n) * 2 + h) * 8, w[n][h][par]);
      }
    }
  }
}

// Panel: MR rows over blocks [b0, b1), one group (16 lanes = 2 vectors) at a time.
template <int MR, int G>
__attribute__((noinline)) K3_TARGET_AVX2 void panel_rows(const TileGemm& a, int64_t b0, int64_t b1, const float* panel,
                               const float* const* rows, float* totals) {
  for (int64_t b = b0; b < b1; ++b) {
    const float* pw = panel + (b - b0) * kBlock * 2 * G * 8;
    const uint8_t* sc = a.records + b * record_bytes(G) + record_code_bytes(G);
    for (int g = 0; g < G; ++g) {
      __m256 acc[MR][2];
      for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
#pragma GCC unroll 4
      for (int kp = 0; kp < kPairs; ++kp) {
        for (int par = 1; par >= 0; --par) {  // odd element first
          const int k = 2 * kp + par;
          const __m256 w0 = _mm256_loadu_ps(pw + (k * 2 * G + g * 2) * 8);
          const __m256 w1 = _mm256_loadu_ps(pw + (k * 2 * G + g * 2 + 1) * 8);
          for (int m = 0; m < MR; ++m) {
            const __m256 x = _mm256_broadcast_ss(rows[m] + b * kBlock + k);
            acc[m][0] = _mm256_fmadd_ps(w0, x, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(w1, x, acc[m][1]);
          }
        }
      }
      __m256 s[2];
      group_scales(sc + g * kLanes, s);
      // An opaque copy of the pointer keeps GCC from carrying totals in registers across groups.
      float* t = totals;
      __asm__("" : "+r"(t));
      for (int m = 0; m < MR; ++m) {
        for (int h = 0; h < 2; ++h) {
          float* tp = t + m * G * kLanes + (g * 2 + h) * 8;
          _mm256_storeu_ps(tp, _mm256_fmadd_ps(acc[m][h], s[h], _mm256_loadu_ps(tp)));
        }
      }
    }
  }
}

template <int G>
constexpr int kPanelMrAvx2 = 6;

template <int G, IntMac kMac, int MR = 1>
K3_TARGET_AVX2 void direct_dispatch(const TileGemm& a, int64_t rows, const float* const* r, float* t) {
  if constexpr (MR < kDirectMaxRowsAvx2) {
    if (rows != MR) return direct_dispatch<G, kMac, MR + 1>(a, rows, r, t);
  }
  direct_rows_any<MR, G, kMac>(a, r, t);
}

template <int G, int MR = 1>
K3_TARGET_AVX2 void panel_dispatch(const TileGemm& a, int64_t rows, int64_t b0, int64_t b1, const float* panel,
                                   const float* const* r, float* t) {
  if constexpr (MR < kPanelMrAvx2<G>) {
    if (rows != MR) return panel_dispatch<G, MR + 1>(a, rows, b0, b1, panel, r, t);
  }
  panel_rows<MR, G>(a, b0, b1, panel, r, t);
}

// Totals of one row, per group: halves order {0-3, 8-11, 4-7, 12-15} -> lane order.
K3_TARGET_AVX2 void unpermute_totals(float* totals, int64_t rows, int groups) {
  for (int64_t i = 0; i < rows * groups; ++i) {
    float* t = totals + i * kLanes;
    const __m128 q1 = _mm_loadu_ps(t + 4), q2 = _mm_loadu_ps(t + 8);
    _mm_storeu_ps(t + 4, q2);
    _mm_storeu_ps(t + 8, q1);
  }
}

// Panel path over blocks [b0, b1) for `rows` rows: kPanelBlocksAvx2 blocks at a time, near-equal
// register tiles (13 rows: 4 + 4 + 5, not 6 + 6 + 1, so that no tile streams the panel for one or
// two rows of work).
template <int G>
K3_TARGET_AVX2 void panel_range(const TileGemm& a, int64_t rows, int64_t b0, int64_t b1, const float* const* r,
                                float* t) {
  auto* panel = static_cast<float*>(a.panel);
  const int64_t width = G * kLanes;
  const int64_t tiles = (rows + kPanelMrAvx2<G> - 1) / kPanelMrAvx2<G>;
  for (int64_t p0 = b0; p0 < b1; p0 += kPanelBlocksAvx2) {
    const int64_t p1 = p0 + kPanelBlocksAvx2 < b1 ? p0 + kPanelBlocksAvx2 : b1;
    if (p1 < a.blocks) prefetch_record(a.records + p1 * record_bytes(G), record_bytes(G));
    fill_panel<G>(a, p0, p1, panel);
    for (int64_t i = 0, m0 = 0; i < tiles; ++i) {
      const int64_t mr = (rows - m0) / (tiles - i);
      panel_dispatch<G>(a, mr, p0, p1, panel, r + m0, t + m0 * width);
      m0 += mr;
    }
  }
}

template <int G, IntMac kMac>
K3_TARGET_AVX2 void tile_gemm(const TileGemm& a) {
  const float* rows[kRowGroup];
  for (int64_t i = 0; i < a.num_rows; ++i) rows[i] = static_cast<const float*>(a.rows[i]);
  const int64_t width = G * kLanes;
  std::memset(a.totals, 0, static_cast<size_t>(a.num_rows * width) * sizeof(float));
  if (a.num_rows <= kDirectMaxRowsAvx2) {
    direct_dispatch<G, kMac>(a, a.num_rows, rows, a.totals);
  } else {
    panel_range<G>(a, a.num_rows, 0, a.blocks, rows, a.totals);
  }
  unpermute_totals(a.totals, a.num_rows, G);
}

template <IntMac kMac>
void tile_gemm_entry(const TileGemm& a) {
  if (a.groups == kFc1Groups) {
    tile_gemm<kFc1Groups, kMac>(a);
  } else {
    tile_gemm<kFc2Groups, kMac>(a);
  }
}

}  // namespace

TileGemmFn tile_gemm_avx2(IntMac form) {
  switch (form) {
    case IntMac::kAvx512Vnni: return tile_gemm_entry<IntMac::kAvx512Vnni>;
    case IntMac::kAvxVnni: return tile_gemm_entry<IntMac::kAvxVnni>;
    case IntMac::kMadd: break;
  }
  return tile_gemm_entry<IntMac::kMadd>;
}

IntMac int_mac_form(IsaLevel level, bool avx_vnni) {
  const auto& f = cpu_info().features;
  if (level == IsaLevel::kScalar) return IntMac::kMadd;  // not used: the portable kernel has no integer dots
  if (level != IsaLevel::kAvx2 && f.avx512_vnni && f.avx512vl) return IntMac::kAvx512Vnni;
  return avx_vnni && f.avx_vnni ? IntMac::kAvxVnni : IntMac::kMadd;
}

}  // namespace k3::cpu::detail
