// k3/formats.hpp — scalar codecs for the MX element and scale types and for BF16 / FP16.
//
// Every function is constexpr and usable from host and device code (nvcc with
// --expt-relaxed-constexpr), so the CPU, the CUDA kernels and the tests share one definition.
// They agree bit for bit with NVIDIA's host-callable conversions in cuda_fp8.h / cuda_fp4.h /
// cuda_bf16.h / cuda_fp16.h (tests/xcheck sweeps more than 10^8 FP32 patterns against them).
//
// Narrowing conversions round to nearest, ties to even (RNE). MX element conversions saturate
// ("satfinite"): anything above the largest finite magnitude, including +-Inf, becomes +-max.
//
// NaN inputs (matching NVIDIA):
//   E4M3, E5M2 -> 0x7F (positive NaN code)      E2M1 -> 0x7 (+6.0, E2M1 has no NaN)
//   E8M0       -> 0xFF (NaN scale)              BF16 / FP16 -> 0x7FFF (canonical quiet NaN)
// E8M0 decodes code 0 as 2^-127 (TensorRT-LLM's host reference decodes it as 0.0; k3 and
// NVIDIA's __nv_fp8_e8m0 do not) and 0xFF as NaN.
#pragma once

#include <cstdint>

#include "k3/config.hpp"

namespace k3 {

// ---- bit casts ------------------------------------------------------------------------------
K3_HOST_DEVICE constexpr uint32_t f32_to_bits(float x) { return __builtin_bit_cast(uint32_t, x); }
K3_HOST_DEVICE constexpr float bits_to_f32(uint32_t u) { return __builtin_bit_cast(float, u); }

// 2^e as a float for e in [-149, 127] (exact; subnormal below -126).
K3_HOST_DEVICE constexpr float exp2i(int e) {
  if (e >= -126) return bits_to_f32(static_cast<uint32_t>(e + 127) << 23);
  return bits_to_f32(1u << (e + 149));
}

// ---- generic minifloat (sign, EB exponent bits, MB mantissa bits) ---------------------------
struct MiniFloatFormat {
  int ebits;
  int mbits;
  int bias;
  uint32_t max_finite_code;  // magnitude code of the largest finite value
  uint32_t nan_code;         // code produced for NaN input
  bool ieee_specials;        // all-ones exponent encodes Inf/NaN (E5M2)
  bool e4m3_nan;             // S.1111.111 is NaN (E4M3 "fn"); no Inf
};

// Functions rather than variables: device code may call them without odr-using host data.
K3_HOST_DEVICE constexpr MiniFloatFormat e2m1_format() { return {2, 1, 1, 0x7, 0x7, false, false}; }
K3_HOST_DEVICE constexpr MiniFloatFormat e4m3_format() { return {4, 3, 7, 0x7E, 0x7F, false, true}; }
K3_HOST_DEVICE constexpr MiniFloatFormat e5m2_format() { return {5, 2, 15, 0x7B, 0x7F, true, false}; }

// Encode x * 2^exp_shift (computed exactly, no intermediate rounding) with RNE and saturation.
K3_HOST_DEVICE constexpr uint32_t encode_minifloat(float x, const MiniFloatFormat f, int exp_shift = 0) {
  const uint32_t bits = f32_to_bits(x);
  const uint32_t sign = bits >> 31;
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  const uint32_t sign_code = sign << (f.ebits + f.mbits);
  if (abs_bits > 0x7F800000u) return f.nan_code;                    // NaN
  if (abs_bits == 0x7F800000u) return sign_code | f.max_finite_code;  // Inf saturates
  if (abs_bits == 0) return sign_code;                               // +-0
  // value = mant * 2^(exp - 23), mant with the implicit bit
  const uint32_t exp_field = abs_bits >> 23;
  const uint64_t mant = (abs_bits & 0x7FFFFFu) | (exp_field != 0 ? 0x800000u : 0u);
  // exponent of the leading bit (floor(log2 |value|)), shifted
  int lead = (exp_field != 0 ? static_cast<int>(exp_field) - 127 : -126) + exp_shift;
  if (exp_field == 0) {  // FP32 subnormal: find its leading bit
    int msb = 22;
    while (((mant >> msb) & 1u) == 0) --msb;
    lead = -126 - (23 - msb) + exp_shift;
  }
  const int emin = 1 - f.bias;  // exponent of the smallest normal
  const int emax_clamp = (1 << f.ebits) + 1 - f.bias;  // any value with lead >= this saturates
  if (lead >= emax_clamp) return sign_code | f.max_finite_code;
  const int quantum_exp = (lead > emin ? lead : emin) - f.mbits;  // exponent of one ulp
  const int value_lsb_exp = (exp_field != 0 ? static_cast<int>(exp_field) - 127 : -126) - 23 + exp_shift;
  const int shift = quantum_exp - value_lsb_exp;  // > 0 always: mant has 24 bits, target <= MB+1
  uint64_t q = 0;
  if (shift <= 0) {
    q = mant << -shift;  // only for FP32 subnormals scaled far up: exact
  } else if (shift <= 40) {
    q = mant >> shift;
    const uint64_t rem = mant & ((uint64_t{1} << shift) - 1);
    const uint64_t half = uint64_t{1} << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
  }  // else: far below half an ulp of the smallest subnormal -> 0
  uint32_t code;
  if (lead < emin) {
    code = static_cast<uint32_t>(q);  // subnormal (q == 2^MB carries into the smallest normal)
  } else {
    code = (static_cast<uint32_t>(lead + f.bias) << f.mbits) + static_cast<uint32_t>(q - (uint64_t{1} << f.mbits));
  }
  if (code > f.max_finite_code) code = f.max_finite_code;
  return sign_code | code;
}

K3_HOST_DEVICE constexpr float decode_minifloat(uint32_t code, const MiniFloatFormat f) {
  const uint32_t mag_bits = static_cast<uint32_t>(f.ebits + f.mbits);
  const uint32_t sign = (code >> mag_bits) & 1u;
  const uint32_t mag = code & ((1u << mag_bits) - 1u);
  const uint32_t e = mag >> f.mbits;
  const uint32_t m = mag & ((1u << f.mbits) - 1u);
  float v;
  if (f.e4m3_nan && mag == 0x7Fu) {
    v = bits_to_f32(0x7FC00000u);
  } else if (f.ieee_specials && e == (1u << f.ebits) - 1u) {
    v = m == 0 ? bits_to_f32(0x7F800000u) : bits_to_f32(0x7FC00000u);
  } else if (e == 0) {
    v = static_cast<float>(m) * exp2i(1 - f.bias - f.mbits);
  } else {
    v = static_cast<float>((1u << f.mbits) | m) * exp2i(static_cast<int>(e) - f.bias - f.mbits);
  }
  return sign ? -v : v;
}

// ---- E2M1 (FP4): 4-bit code, bit 3 sign. Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 ----------
inline constexpr float kE2M1Max = 6.0f;
K3_HOST_DEVICE constexpr uint8_t e2m1_from_f32(float x) {
  return static_cast<uint8_t>(encode_minifloat(x, e2m1_format()));
}
K3_HOST_DEVICE constexpr float e2m1_to_f32(uint8_t code) { return decode_minifloat(code & 0xFu, e2m1_format()); }

// ---- E4M3 ("fn"): max 448, 0x7F / 0xFF NaN, no Inf ----------------------------------------
inline constexpr float kE4M3Max = 448.0f;
K3_HOST_DEVICE constexpr uint8_t e4m3_from_f32(float x) {
  return static_cast<uint8_t>(encode_minifloat(x, e4m3_format()));
}
K3_HOST_DEVICE constexpr float e4m3_to_f32(uint8_t code) { return decode_minifloat(code, e4m3_format()); }

// ---- E5M2: max 57344 (satfinite), IEEE Inf / NaN codes decode as such ---------------------
inline constexpr float kE5M2Max = 57344.0f;
K3_HOST_DEVICE constexpr uint8_t e5m2_from_f32(float x) {
  return static_cast<uint8_t>(encode_minifloat(x, e5m2_format()));
}
K3_HOST_DEVICE constexpr float e5m2_to_f32(uint8_t code) { return decode_minifloat(code, e5m2_format()); }

// ---- E8M0 (UE8M0) scale: 2^(code - 127); 0xFF = NaN -----------------------------------------
inline constexpr uint8_t kE8M0Nan = 0xFF;
K3_HOST_DEVICE constexpr float e8m0_to_f32(uint8_t code) {
  return code == kE8M0Nan ? bits_to_f32(0x7FC00000u) : exp2i(static_cast<int>(code) - 127);
}
// Unbiased exponent of a scale code (code - 127); meaningless for 0xFF.
K3_HOST_DEVICE constexpr int e8m0_exponent(uint8_t code) { return static_cast<int>(code) - 127; }

// |x| -> E8M0 rounding toward +Inf (ceil(log2|x|)), saturating to 0xFE; 0 and anything at or
// below 2^-127 give 0x00; NaN gives 0xFF. (= __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf))
K3_HOST_DEVICE constexpr uint8_t e8m0_from_f32_ceil(float x) {
  const uint32_t a = f32_to_bits(x) & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kE8M0Nan;
  if (a >= 0x7F000001u) return 0xFE;  // above 2^127 (incl. Inf) saturates
  if (a <= 0x00400000u) return 0x00;  // <= 2^-127
  const uint32_t e = a >> 23;
  if (e == 0) return 0x01;            // subnormal in (2^-127, 2^-126): ceil -> -126
  const uint32_t exact = (a & 0x7FFFFFu) == 0 ? 0u : 1u;
  return static_cast<uint8_t>(e + exact);
}
// |x| -> E8M0 rounding toward zero (floor(log2|x|)), saturating to 0xFE; below 2^-126 gives
// 0x00 (2^-127) for x >= 2^-127 ... and 0 as well for smaller x. NaN gives 0xFF.
// (= __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundZero))
K3_HOST_DEVICE constexpr uint8_t e8m0_from_f32_floor(float x) {
  const uint32_t a = f32_to_bits(x) & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kE8M0Nan;
  if (a == 0x7F800000u) return 0xFE;
  const uint32_t e = a >> 23;
  return static_cast<uint8_t>(e == 0 ? 0u : (e > 0xFEu ? 0xFEu : e));
}

// ---- BF16 / FP16 (bit patterns in uint16_t) -------------------------------------------------
K3_HOST_DEVICE constexpr uint16_t bf16_from_f32(float x) {
  const uint32_t u = f32_to_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  const uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}
K3_HOST_DEVICE constexpr float bf16_to_f32(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }

K3_HOST_DEVICE constexpr uint16_t fp16_from_f32(float x) {
  const uint32_t u = f32_to_bits(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7FFF;
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to Inf
  if (a < 0x33000001u) return static_cast<uint16_t>(sign);             // <= 2^-25 rounds to 0
  const uint32_t exp_field = a >> 23;
  const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
  const int e = static_cast<int>(exp_field) - 127;
  uint32_t shift, base;
  if (e < -14) {  // FP16 subnormal: ulp 2^-24
    shift = static_cast<uint32_t>(-1 - e);  // value = mant * 2^(e-23); q = value / 2^-24
    base = 0;
  } else {
    shift = 13;
    base = static_cast<uint32_t>(e + 15) << 10;
  }
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  const uint32_t code = e < -14 ? q : base + (q - 0x400u);
  return static_cast<uint16_t>(sign | code);
}
K3_HOST_DEVICE constexpr float fp16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0x1F) return bits_to_f32(sign | 0x7F800000u | (m << 13));
  if (e == 0) {
    const float v = static_cast<float>(m) * exp2i(-24);
    return sign ? -v : v;
  }
  return bits_to_f32(sign | ((e + 112u) << 23) | (m << 13));
}

}  // namespace k3
