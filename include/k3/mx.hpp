// k3/mx.hpp — MX block formats (OCP Microscaling v1.0): MXFP4 = 32 x E2M1 + one E8M0 scale,
// MXFP8 = 32 x E4M3 + one E8M0 scale, blocks of 32 consecutive elements along K.
//
// Decisions (see docs/formats.md; identical on every backend):
// * Scale rule: RCEIL by default (scale = 2^ceil(log2(amax / elem_max)), computed exactly, as
//   cuBLAS / TensorRT-LLM / FlashInfer do); FLOOR (OCP text) as an option.
// * Elements: x / scale with round-to-nearest-even and saturation to +-elem_max.
// * Zero block: scale code 0x00 (2^-127) and all-zero elements.
// * +-Inf in a block: amax is Inf, the scale saturates to 0xFE (2^127) and Inf elements become
//   +-elem_max, finite ones (almost always) 0. No NaN is produced for Inf input.
// * NaN in a block: the whole block is NaN. The scale is written as 0xFF (E8M0 NaN) and every
//   element code as 0, so dequantization yields NaN for all 32 elements. NaN never disappears.
// * Dequantization to FP32 is exact (the product of an element and a power of two always fits
//   FP32's precision) except that values beyond FLT_MAX become +-Inf (only at scale codes >= 247).
// * Dequantization to BF16 is exact when every nonzero product lies in BF16's *normal* range
//   [2^-126, 2^128). Blocks that would need BF16 subnormals or overflow are reported as inexact
//   (kInexact) rather than silently rounded: BF16 dot-product instructions (AVX512-BF16
//   VDPBF16PS) flush subnormal inputs, so such a block must take an exact FP32 path.
// * FP4 packing: byte i of a row holds element 2i in the low nibble and 2i+1 in the high nibble.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "k3/config.hpp"
#include "k3/formats.hpp"
#include "k3/status.hpp"

namespace k3 {

inline constexpr int kMxBlock = 32;

enum class MxElement : uint8_t { kE2M1, kE4M3 };  // MXFP4, MXFP8
enum class ScaleRule : uint8_t { kRceil, kFloor };

const char* mx_element_name(MxElement e);  // "mxfp4" / "mxfp8"
const char* scale_rule_name(ScaleRule r);  // "rceil" / "floor"

// ---- scalar building blocks (host and device) -----------------------------------------------

// Largest element magnitude written as m * 2^emax with 1 <= m < 2.
K3_HOST_DEVICE constexpr float mx_elem_max(MxElement e) { return e == MxElement::kE2M1 ? kE2M1Max : kE4M3Max; }
K3_HOST_DEVICE constexpr int mx_elem_emax(MxElement e) { return e == MxElement::kE2M1 ? 2 : 8; }
// Mantissa field (23 bits) of elem_max: 1.5 -> 0x400000, 1.75 -> 0x600000.
K3_HOST_DEVICE constexpr uint32_t mx_elem_max_frac(MxElement e) { return e == MxElement::kE2M1 ? 0x400000u : 0x600000u; }

// The block scale code for a block whose absolute maximum is `amax` (NaN if any element is NaN).
// RCEIL uses the exact quotient amax / elem_max (no reciprocal approximation).
K3_HOST_DEVICE constexpr uint8_t mx_scale_code(float amax, MxElement e, ScaleRule rule) {
  const uint32_t a = f32_to_bits(amax) & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kE8M0Nan;
  if (a == 0x7F800000u) return 0xFE;
  if (a == 0) return 0x00;
  // amax = (1 + frac / 2^23) * 2^lead
  int lead;
  uint32_t frac;
  if ((a >> 23) != 0) {
    lead = static_cast<int>(a >> 23) - 127;
    frac = a & 0x7FFFFFu;
  } else {  // FP32 subnormal: normalize
    int msb = 22;
    while (((a >> msb) & 1u) == 0) --msb;
    lead = -149 + msb;
    frac = (a << (23 - msb)) & 0x7FFFFFu;
  }
  int exp = lead - mx_elem_emax(e);
  if (rule == ScaleRule::kRceil && frac > mx_elem_max_frac(e)) exp += 1;
  int code = exp + 127;
  if (code < 0) code = 0;
  if (code > 0xFE) code = 0xFE;
  return static_cast<uint8_t>(code);
}

// Element code of x in a block with scale `scale_code` (x / 2^(scale_code-127), exact scaling,
// RNE, saturating). A NaN block (0xFF) encodes every element as 0.
K3_HOST_DEVICE constexpr uint8_t mx_encode_element(float x, uint8_t scale_code, MxElement e) {
  if (scale_code == kE8M0Nan) return 0;
  const int shift = 127 - static_cast<int>(scale_code);
  return static_cast<uint8_t>(encode_minifloat(x, e == MxElement::kE2M1 ? e2m1_format() : e4m3_format(), shift));
}

// Exact FP32 value of an element (code) under a scale code; NaN for a 0xFF scale.
K3_HOST_DEVICE constexpr float mx_decode_element(uint8_t code, uint8_t scale_code, MxElement e) {
  // A NaN scale gives the canonical quiet NaN itself, not v * NaN: a GPU's multiply returns its
  // own NaN (0x7FFFFFFF) where x86 keeps the operand's (0x7FC00000), and the codec must give the
  // same bits on both (first seen on an H200, 2026-12-04).
  if (scale_code == kE8M0Nan) return e8m0_to_f32(kE8M0Nan);
  const float v = e == MxElement::kE2M1 ? e2m1_to_f32(code) : e4m3_to_f32(code);
  return v * e8m0_to_f32(scale_code);
}

// The block-scale decision of every MX quantizer in k3 (the host codec, the CUDA quantize kernel,
// the CUDA MoE's x and activation re-quantization): the absolute maximum of the block's finite and
// infinite values, with NaN tracked apart (an fmax would drop it), then a NaN block gets scale
// 0xFF and any other block mx_scale_code(amax). Elements may be folded in any order and partial
// accumulators merged in any order (max and or are exact): the same scale for every split.
struct MxBlockAmax {
  float amax = 0.0f;
  bool nan = false;
  K3_HOST_DEVICE constexpr void add(float x) {
    const float a = x < 0 ? -x : x;
    if (a != a) nan = true;
    else if (a > amax) amax = a;
  }
  K3_HOST_DEVICE constexpr void merge(float other_amax, bool other_nan) {
    nan = nan || other_nan;
    if (other_amax > amax) amax = other_amax;
  }
  K3_HOST_DEVICE constexpr uint8_t scale_code(MxElement e, ScaleRule rule) const {
    return nan ? kE8M0Nan : mx_scale_code(amax, e, rule);
  }
};

// Quantize one block of 32 values: returns the scale code, writes 32 unpacked element codes.
K3_HOST_DEVICE constexpr uint8_t mx_quantize_block(const float* x, MxElement e, ScaleRule rule, uint8_t* codes) {
  MxBlockAmax block;
  for (int i = 0; i < kMxBlock; ++i) block.add(x[i]);
  const uint8_t scale = block.scale_code(e, rule);
  for (int i = 0; i < kMxBlock; ++i) codes[i] = mx_encode_element(x[i], scale, e);
  return scale;
}

// True when code * 2^(scale_code-127) is zero, NaN, or a normal BF16 (hence exact in BF16).
K3_HOST_DEVICE constexpr bool mx_element_bf16_exact(uint8_t code, uint8_t scale_code, MxElement e) {
  if (scale_code == kE8M0Nan) return true;
  const float v = e == MxElement::kE2M1 ? e2m1_to_f32(code) : e4m3_to_f32(code);
  if (v == 0.0f || v != v) return true;
  const int lead = static_cast<int>((f32_to_bits(v) >> 23) & 0xFFu) - 127 + e8m0_exponent(scale_code);
  return lead >= -126 && lead <= 127;
}

// ---- FP4 packing ----------------------------------------------------------------------------
K3_HOST_DEVICE constexpr uint8_t fp4_pack(uint8_t even, uint8_t odd) {
  return static_cast<uint8_t>((even & 0xFu) | ((odd & 0xFu) << 4));
}
K3_HOST_DEVICE constexpr uint8_t fp4_low(uint8_t byte) { return byte & 0xFu; }
K3_HOST_DEVICE constexpr uint8_t fp4_high(uint8_t byte) { return static_cast<uint8_t>(byte >> 4); }

// ---- row-major tensors [rows, cols], blocks along cols --------------------------------------

// Bytes of element codes per row: cols / 2 (MXFP4, packed) or cols (MXFP8).
constexpr int64_t mx_row_bytes(MxElement e, int64_t cols) { return e == MxElement::kE2M1 ? cols / 2 : cols; }
constexpr int64_t mx_scale_cols(int64_t cols) { return cols / kMxBlock; }

// Checks rows >= 0, cols > 0 and a multiple of 32, and every buffer size. Names what is wrong.
Status mx_check_shape(int64_t rows, int64_t cols, const char* what);

// q: [rows, mx_row_bytes], scales: [rows, cols/32] (linear layout).
Status mx_quantize(std::span<const float> x, int64_t rows, int64_t cols, MxElement e, ScaleRule rule,
                   std::span<uint8_t> q, std::span<uint8_t> scales);
// BF16 input as raw bits.
Status mx_quantize_bf16(std::span<const uint16_t> x, int64_t rows, int64_t cols, MxElement e, ScaleRule rule,
                        std::span<uint8_t> q, std::span<uint8_t> scales);

Status mx_dequantize(std::span<const uint8_t> q, std::span<const uint8_t> scales, int64_t rows, int64_t cols,
                     MxElement e, std::span<float> out);

// A block whose values are not all exactly representable as normal BF16.
struct MxBlockRef {
  int64_t row;
  int64_t block;  // block index along cols
  uint8_t scale_code;
  std::string to_string() const;
};
std::optional<MxBlockRef> mx_find_bf16_inexact_block(std::span<const uint8_t> q, std::span<const uint8_t> scales,
                                                     int64_t rows, int64_t cols, MxElement e);
// Exact dequantization into BF16 bits; kInexact (naming the first offending block) if any block
// would leave BF16's normal range. Nothing is written in that case.
Status mx_dequantize_bf16(std::span<const uint8_t> q, std::span<const uint8_t> scales, int64_t rows, int64_t cols,
                          MxElement e, std::span<uint16_t> out);

// ---- scale layouts --------------------------------------------------------------------------
// 128x4 swizzled layout consumed by SM100/SM120 block-scaled MMA and FlashInfer: rows padded to
// 128 and scale columns to 4 (padding = 0).
K3_HOST_DEVICE constexpr int64_t swizzled_scale_offset(int64_t row, int64_t scale_col, int64_t scale_cols) {
  const int64_t num_k_tiles = (scale_cols + 3) / 4;
  return (row / 128) * num_k_tiles * 512 + (scale_col / 4) * 512 + (row % 32) * 16 + ((row % 128) / 32) * 4 +
         (scale_col % 4);
}
constexpr int64_t swizzled_scale_size(int64_t rows, int64_t scale_cols) {
  return ((rows + 127) / 128) * 128 * ((scale_cols + 3) / 4) * 4;
}
Status scales_to_swizzled(std::span<const uint8_t> linear, int64_t rows, int64_t scale_cols,
                          std::span<uint8_t> swizzled);
Status scales_from_swizzled(std::span<const uint8_t> swizzled, int64_t rows, int64_t scale_cols,
                            std::span<uint8_t> linear);

}  // namespace k3
