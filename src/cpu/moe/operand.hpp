// Operand rows of the two GEMMs: the exact values of the contract (BF16 x, or MXFP8 x / MXFP8
// activation output dequantized), in the element type of the ISA level's dot product.
//
// BF16 level: VDPBF16PS flushes subnormal inputs and results. A row is therefore stored as
// value * 2^shift (exact: a power-of-two scaling of a value with <= 8 significant bits) with the
// shift chosen so that every nonzero finite magnitude m satisfies 2^-118 <= m < 2^120. Then
// every product with an E2M1 value (a multiple of 0.5, <= 6) is a multiple of 2^-127 and every
// partial sum of one 32-element block is either 0 or a normal FP32 below 2^128: the block dot
// product has no subnormal and no overflow. The GEMM result is multiplied by 2^-shift.
// Rows whose nonzero magnitudes span more than 2^237 cannot be placed: kShiftFail.
#pragma once

#include <cstdint>
#include <limits>

namespace k3::cpu::detail {

inline constexpr int32_t kShiftFail = std::numeric_limits<int32_t>::min();
inline constexpr int kOperandLogMin = -118, kOperandLogMax = 119;

// Shift for nonzero finite magnitudes with floor(log2 m) in [lo, hi] (lo > hi: none).
int32_t choose_shift(int lo, int hi);

// MXFP8 row: codes [len], scales [len/32] -> BF16 row * 2^shift (returns the shift or kShiftFail;
// a 0xFF scale gives a NaN block).
int32_t mxfp8_row_to_bf16(const uint8_t* codes, const uint8_t* scales, int64_t len, uint16_t* dst);
// MXFP8 row -> FP32 row (exact, including FP32 subnormals).
void mxfp8_row_to_f32(const uint8_t* codes, const uint8_t* scales, int64_t len, float* dst);
// BF16 row -> BF16 row * 2^shift (src == dst allowed).
int32_t bf16_row_to_bf16(const uint16_t* src, int64_t len, uint16_t* dst);
// FP32 levels: the block partial sums use unscaled E2M1 values (up to 6), so a row with
// magnitudes of 2^120 or more is scaled down in place (shift < 0) to keep the 32-term partial
// sums finite; magnitudes that then fall below 2^-126 may lose low bits (they are 2^-246 of the
// row's largest value). Returns the shift (0 for every ordinary row).
int32_t f32_row_fit(float* row, int64_t len);

}  // namespace k3::cpu::detail
