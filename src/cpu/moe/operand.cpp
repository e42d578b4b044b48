#include "cpu/moe/operand.hpp"

#include <array>
#include <climits>

#include "k3/formats.hpp"
#include "k3/mx.hpp"

namespace k3::cpu::detail {
namespace {

struct E4M3Tables {
  std::array<int8_t, 128> log2;   // floor(log2 |value|) of magnitude code c (c = 1..126)
  std::array<uint32_t, 128> bits; // FP32 bits of the magnitude
};

constexpr E4M3Tables make_tables() {
  E4M3Tables t{};
  for (int c = 0; c < 128; ++c) {
    t.bits[static_cast<size_t>(c)] = f32_to_bits(e4m3_to_f32(static_cast<uint8_t>(c)));
    int l = 0;
    if (c >= 8) {
      l = (c >> 3) - 7;
    } else if (c > 0) {
      int msb = 2;
      while (((c >> msb) & 1) == 0) --msb;
      l = msb - 9;
    }
    t.log2[static_cast<size_t>(c)] = static_cast<int8_t>(l);
  }
  return t;
}
constexpr E4M3Tables kE4M3 = make_tables();

// Every E4M3 code's value (both signs, NaN codes included), for the row dequantization.
constexpr std::array<float, 256> make_values() {
  std::array<float, 256> v{};
  for (int c = 0; c < 256; ++c) v[static_cast<size_t>(c)] = e4m3_to_f32(static_cast<uint8_t>(c));
  return v;
}
constexpr std::array<float, 256> kE4M3Values = make_values();

}  // namespace

int32_t choose_shift(int lo, int hi) {
  if (lo > hi) return 0;
  if (lo >= kOperandLogMin && hi <= kOperandLogMax) return 0;
  if (hi - lo > kOperandLogMax - kOperandLogMin) return kShiftFail;
  return lo < kOperandLogMin ? kOperandLogMin - lo : kOperandLogMax - hi;
}

int32_t mxfp8_row_to_bf16(const uint8_t* codes, const uint8_t* scales, int64_t len, uint16_t* dst) {
  int lo = INT_MAX, hi = INT_MIN;
  const int64_t blocks = len / kMxBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const int s = scales[b];
    if (s == kE8M0Nan) continue;
    int blo = INT_MAX, bhi = INT_MIN;
    for (int i = 0; i < kMxBlock; ++i) {
      const int c = codes[b * kMxBlock + i] & 0x7F;
      if (c == 0) continue;
      const int l = kE4M3.log2[static_cast<size_t>(c)];
      if (l + s - 127 > 127) continue;  // beyond FLT_MAX: +-Inf, as in the FP32 dequantization
      blo = l < blo ? l : blo;
      bhi = l > bhi ? l : bhi;
    }
    if (blo > bhi) continue;
    lo = blo + s - 127 < lo ? blo + s - 127 : lo;
    hi = bhi + s - 127 > hi ? bhi + s - 127 : hi;
  }
  const int32_t shift = choose_shift(lo, hi);
  if (shift == kShiftFail) return shift;
  for (int64_t b = 0; b < blocks; ++b) {
    const int s = scales[b];
    const uint8_t* c = codes + b * kMxBlock;
    uint16_t* d = dst + b * kMxBlock;
    if (s == kE8M0Nan) {
      for (int i = 0; i < kMxBlock; ++i) d[i] = 0x7FC0;
      continue;
    }
    // Nonzero values land in [2^-118, 2^120): adding the exponent offset to the FP32 bits of
    // the E4M3 magnitude is exact, and the result has <= 4 significant bits (exact in BF16).
    // Values of 2^128 or more (scale codes >= 247 with large elements) overflow FP32: the
    // contract's FP32 dequantization makes them +-Inf, and so does this one.
    const uint32_t offset = static_cast<uint32_t>(s - 127 + shift) << 23;
    for (int i = 0; i < kMxBlock; ++i) {
      const uint32_t mag = c[i] & 0x7Fu;
      const bool inf = mag != 0 && kE4M3.log2[mag] + s - 127 > 127;
      const uint32_t bits = mag == 0 ? 0u : (inf ? 0x7F800000u : kE4M3.bits[mag] + offset);
      d[i] = static_cast<uint16_t>((bits >> 16) | ((c[i] & 0x80u) << 8));
    }
  }
  return shift;
}

// A table lookup per code: the codec's generic minifloat decode (e4m3_to_f32) took about 4 ns per
// element, and the FP32 levels' W4A8 decode step dequantizes every x row and activation row
// (forced AVX2 on the Zen 4 guest, M = 8: 0.64 -> 0.25 ms of the ~27 ms call for the h rows).
void mxfp8_row_to_f32(const uint8_t* codes, const uint8_t* scales, int64_t len, float* dst) {
  for (int64_t b = 0; b < len / kMxBlock; ++b) {
    const float f = e8m0_to_f32(scales[b]);  // exact products: E4M3 quantum * 2^-127 >= 2^-136
    for (int i = 0; i < kMxBlock; ++i) dst[b * kMxBlock + i] = kE4M3Values[codes[b * kMxBlock + i]] * f;
  }
}

int32_t bf16_row_to_bf16(const uint16_t* src, int64_t len, uint16_t* dst) {
  uint32_t emin = 255, emax = 0;  // exponent fields of the nonzero finite elements
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t h = src[i], e = (h >> 7) & 0xFFu;
    const bool counted = (h & 0x7FFFu) != 0 && e != 0xFFu;
    emin = counted && e < emin ? e : emin;
    emax = counted && e > emax ? e : emax;
  }
  // Fast path: none, or every exponent field in [9, 246] (log2 in [-118, 119]; no subnormal).
  if (emin > emax || (emin >= static_cast<uint32_t>(127 + kOperandLogMin) &&
                      emax <= static_cast<uint32_t>(127 + kOperandLogMax))) {
    if (dst != src) {
      for (int64_t i = 0; i < len; ++i) dst[i] = src[i];
    }
    return 0;
  }
  int lo = INT_MAX, hi = INT_MIN;
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t h = src[i], e = (h >> 7) & 0xFFu, mant = h & 0x7Fu;
    if ((h & 0x7FFFu) == 0 || e == 0xFFu) continue;
    int l;
    if (e == 0) {  // BF16 subnormal: mant * 2^-133
      int msb = 6;
      while (((mant >> msb) & 1u) == 0) --msb;
      l = msb - 133;
    } else {
      l = static_cast<int>(e) - 127;
    }
    lo = l < lo ? l : lo;
    hi = l > hi ? l : hi;
  }
  const int32_t shift = choose_shift(lo, hi);
  if (shift == kShiftFail) return shift;
  const float f = exp2i(shift);  // |shift| <= 15: a normal power of two
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t h = src[i];
    const bool scaled = (h & 0x7FFFu) != 0 && ((h >> 7) & 0xFFu) != 0xFFu;
    // <= 8 significant bits, normal result: the FP32 product is exact and truncates exactly.
    dst[i] = scaled ? static_cast<uint16_t>(f32_to_bits(bf16_to_f32(static_cast<uint16_t>(h)) * f) >> 16)
                    : static_cast<uint16_t>(h);
  }
  return shift;
}

int32_t f32_row_fit(float* row, int64_t len) {
  uint32_t emax = 0;
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t e = (f32_to_bits(row[i]) >> 23) & 0xFFu;
    emax = e != 0xFFu && e > emax ? e : emax;
  }
  if (emax <= static_cast<uint32_t>(127 + kOperandLogMax)) return 0;
  const int32_t shift = kOperandLogMax - (static_cast<int32_t>(emax) - 127);
  const float f = exp2i(shift);
  for (int64_t i = 0; i < len; ++i) row[i] *= f;
  return shift;
}

}  // namespace k3::cpu::detail
