// Host + device code of the sm_90a grouped prefill path (MoePath::kPrefillSm90): the weight
// re-encoding done at prepack, the per-expert group entries the device builds from the sort's
// counts, and the activation over GEMM1's FP32 rows. No CUDA header: tests/core runs these very
// functions on the host (test_cuda_moe_grouped.cpp). The kernels using them ran on an H200 (2026-12-04).
//
// Why E4M3 + a BF16 scale per 64 columns (and not per 32, the MX block):
// CUTLASS 4.2's sm90 ptr-array mixed-input mainloop (sm90_mma_array_tma_gmma_rs_warpspecialized_mixed_input.hpp)
// converts the narrow operand in registers and multiplies it by a group scale
// (ConversionMode::ConvertAndScale). Its can_implement requires chunk_size % TileShapeK == 0, and
// its main loop static_asserts K_BLOCK_MAX = TileShapeK / 16 >= 4 for a BF16 MMA, so TileShapeK
// >= 64 and the scale group is at least 64 columns: two MX blocks share one BF16 scale
// 2^(e_ref - 127). Each block's own exponent is carried into its E4M3 codes: an E2M1 value times
// 2^(e_block - e_ref) is exact in E4M3 for shifts in [-8, 6] (e2m1_to_e4m3). E2M1 itself cannot be
// the register operand on sm_90: CUTLASS's E2M1 converters use cvt.*.e2m1x2 (sm_100+).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/moe/moe_shared.hpp"
#include "k3/config.hpp"
#include "k3/formats.hpp"
#include "k3/mx.hpp"

namespace k3::cuda::moe_detail {

// K columns per BF16 group scale of the sm90 weight operand (= the GEMM's TileShapeK).
inline constexpr int kSm90ScaleGroup = 64;
// The block shifts e_block - e_ref that keep every E2M1 value exact in E4M3.
inline constexpr int kSm90MinShift = -8;
inline constexpr int kSm90MaxShift = 6;
inline constexpr uint8_t kE4M3Nan = 0x7F;

// Host functions of k3_cuda (declared here, CUDA-free, so host tests can call them):
// true when this build contains the CUTLASS sm_90a grouped GEMM (K3_HAVE_CUTLASS); the bytes the
// per-group arrays of both GEMMs take for e_local groups; CUTLASS's workspace for both GEMMs on
// sm_count SMs (host arithmetic; 0 without CUTLASS). MoePlan reserves bounds for the last two.
bool sm90_grouped_built();
size_t sm90_group_arrays_bytes(int e_local);
size_t sm90_cutlass_workspace_bytes(int sm_count);

K3_HOST_DEVICE constexpr int64_t sm90_scale_groups(int64_t k) { return (k + kSm90ScaleGroup - 1) / kSm90ScaleGroup; }

// The E4M3 code of E2M1 `code` (bit 3 sign, bits 2..0 magnitude) times 2^shift, shift in
// [kSm90MinShift, kSm90MaxShift]: exact (E4M3 subnormals reach 2^-9, its maximum is 448).
K3_HOST_DEVICE constexpr uint8_t e2m1_to_e4m3(uint8_t code, int shift) {
  const uint8_t sign = static_cast<uint8_t>((code & 8u) << 4);
  const uint32_t mag = code & 7u;
  if (mag == 0) return sign;                   // +-0
  const uint32_t frac = mag == 1 ? 0u : (mag & 1u);  // significand 1 + frac / 2
  const int t = (mag == 1 ? -1 : static_cast<int>(mag >> 1) - 1) + shift;  // binary exponent
  if (t >= -6) return static_cast<uint8_t>(sign | ((t + 7) << 3) | (frac << 2));
  // E4M3 subnormal: (2 + frac) * 2^(t - 1) = mant * 2^-9
  const uint32_t mant = t + 8 >= 0 ? ((2u + frac) << (t + 8)) : ((2u + frac) >> 1);
  return static_cast<uint8_t>(sign | mant);
}

// BF16 bits of 2^(e - 127) for e in [1, 254] (a normal BF16: the scale the GEMM multiplies by).
K3_HOST_DEVICE constexpr uint16_t sm90_scale_bf16(int e) { return static_cast<uint16_t>(e << 7); }

// The reference exponent e_ref of one 64-column group: every block with a nonzero code and a
// finite scale (0xFF blocks become E4M3 NaN codes and do not constrain) needs
// e_block - e_ref in [-8, 6]; e_ref stays in [1, 254] (a normal BF16 scale, so the GEMM's BF16
// multiply is a plain exponent add), and is the one nearest 127 in the allowed range. -1 when no
// e_ref fits (block exponents more than 14 apart): these weights cannot take this path.
K3_HOST_DEVICE constexpr int sm90_group_exponent(const uint8_t* scales, const bool* constrains, int blocks) {
  int lo = 1, hi = 254;
  for (int b = 0; b < blocks; ++b) {
    if (!constrains[b] || scales[b] == kE8M0Nan) continue;
    const int e = scales[b];
    lo = lo > e - kSm90MaxShift ? lo : e - kSm90MaxShift;
    hi = hi < e - kSm90MinShift ? hi : e - kSm90MinShift;
  }
  if (lo > hi) return -1;
  return 127 < lo ? lo : (127 > hi ? hi : 127);
}

// The E4M3 weight code of one E2M1 element of a block with scale code `block_scale` under the
// group's e_ref: NaN for a 0xFF block (the contract: the whole block, zeros included), else the
// exact re-encoding. code x 2^(e_ref - 127) then equals mx_decode_element(code, block_scale, kE2M1).
K3_HOST_DEVICE constexpr uint8_t sm90_weight_code(uint8_t e2m1, uint8_t block_scale, int e_ref) {
  if (block_scale == kE8M0Nan) return kE4M3Nan;
  if ((e2m1 & 7u) == 0) return static_cast<uint8_t>((e2m1 & 8u) << 4);
  return e2m1_to_e4m3(e2m1, static_cast<int>(block_scale) - e_ref);
}

// One weight row of the checkpoint (K/2 packed E2M1 bytes, K/32 E8M0 scales) -> K E4M3 codes and
// ceil(K/64) BF16 group scales written at scales_out[g * scale_stride] (the GEMM's scale tensor is
// MN-major: one column of group scales per weight row). Returns -1, or the first group whose block
// exponents are too far apart (sm90_group_exponent).
K3_HOST_DEVICE constexpr int64_t sm90_encode_row(const uint8_t* q, const uint8_t* s, int64_t k, uint8_t* codes_out,
                                                 uint16_t* scales_out, int64_t scale_stride) {
  constexpr int kBlocksPerGroup = kSm90ScaleGroup / kMxBlock;
  const int64_t blocks = k / kMxBlock;
  for (int64_t g = 0; g < sm90_scale_groups(k); ++g) {
    uint8_t sc[kBlocksPerGroup] = {};
    bool nz[kBlocksPerGroup] = {};
    int n = 0;
    for (int64_t b = g * kBlocksPerGroup; b < blocks && n < kBlocksPerGroup; ++b, ++n) {
      sc[n] = s[b];
      for (int64_t j = b * kMxBlock / 2; j < (b + 1) * kMxBlock / 2; ++j) nz[n] = nz[n] || (q[j] & 0x77u) != 0;
    }
    const int e_ref = sm90_group_exponent(sc, nz, n);
    if (e_ref < 0) return g;
    scales_out[g * scale_stride] = sm90_scale_bf16(e_ref);
    for (int i = 0; i < n; ++i) {
      const int64_t b = g * kBlocksPerGroup + i;
      for (int64_t j = 0; j < kMxBlock; ++j) {
        const int64_t col = b * kMxBlock + j;
        const uint8_t byte = q[col / 2];
        codes_out[col] = sm90_weight_code(col % 2 ? fp4_high(byte) : fp4_low(byte), sc[i], e_ref);
      }
    }
  }
  return -1;
}

// ---- per-expert groups of the two grouped GEMMs (built on the device from the sort) ----------

// GEMM D^T = W x X^T of one local expert: M = weight rows (2N for FC1, K for FC2), N = the
// expert's rows (its count), K = the reduction. Offsets in elements: a into the E4M3 weights,
// s into the group scales, b into the operand rows (expert-contiguous from the sort's padded
// start), d into the FP32 output rows. Leading dimensions: a, b = k; d = m (one output row per
// token row); scale = m (MN-major).
struct GroupedEntry {
  int32_t m = 0, n = 0, k = 0;
  int64_t a_off = 0, s_off = 0, b_off = 0, d_off = 0;
};

// count / start: the sort's rows and padded first row of `expert` (counts[e], counts[E_local + e]).
// A negative count (never written by the sort) acts as 0: an empty group the GEMM skips.
K3_HOST_DEVICE constexpr GroupedEntry grouped_entry(int expert, int32_t count, int32_t start, int64_t m_w,
                                                    int64_t k_red) {
  GroupedEntry g;
  g.m = static_cast<int32_t>(m_w);
  g.n = count < 0 ? 0 : count;
  g.k = static_cast<int32_t>(k_red);
  g.a_off = static_cast<int64_t>(expert) * m_w * k_red;
  g.s_off = static_cast<int64_t>(expert) * m_w * sm90_scale_groups(k_red);
  g.b_off = static_cast<int64_t>(start) * k_red;
  g.d_off = static_cast<int64_t>(start) * m_w;
  return g;
}

// ---- activation over GEMM1's FP32 rows (one row's 32-column block) --------------------------

// gate / up: 32 FP32 values of one row (GEMM1 columns c and N + c); out: the FC2 operand as BF16,
// the same values as moe_gemm.cu's FC1 epilogue: the shared activation_f32, then W4A16 the
// contract's BF16 rounding, W4A8 MXFP8 (E4M3, RCEIL, NaN block -> scale 0xFF) exactly
// dequantized. Returns false when a W4A8 value is not held exactly (kStatusInexactAct).
// No local arrays (the kernel passes global pointers): W4A8 computes each activation twice, once
// for the block maximum and once to encode it (the same function, so the same value).
K3_HOST_DEVICE inline bool grouped_act_block(Recipe recipe, ActivationKind kind, float alpha, float beta, float limit,
                                             float b, float lb, const float* gate, const float* up, uint16_t* out) {
  if (recipe != Recipe::kW4A8) {
    for (int j = 0; j < kMxBlock; ++j) out[j] = bf16_from_f32(activation_f32(kind, alpha, beta, limit, b, lb, gate[j], up[j]));
    return true;
  }
  MxBlockAmax block;
  for (int j = 0; j < kMxBlock; ++j) block.add(activation_f32(kind, alpha, beta, limit, b, lb, gate[j], up[j]));
  const uint8_t sc = block.scale_code(MxElement::kE4M3, ScaleRule::kRceil);
  bool exact = true;
  for (int j = 0; j < kMxBlock; ++j) {
    out[j] = mxfp8_bf16_operand(activation_f32(kind, alpha, beta, limit, b, lb, gate[j], up[j]), sc, exact);
  }
  return exact;
}

}  // namespace k3::cuda::moe_detail
