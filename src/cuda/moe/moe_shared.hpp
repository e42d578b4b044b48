// Host + device code of the CUDA fused-MoE backend: the per-element arithmetic, the status bits,
// the kernel dimensions and the launch geometry. It includes no CUDA header, so the exact
// functions the kernels run are also compiled by the host compiler and unit-tested without a GPU
// (tests/core/test_cuda_moe_shared.cpp). The kernels themselves ran on an H200 (2026-12-04).
#pragma once

#include <math.h>

#include <cstdint>

#include "k3/activation.hpp"
#include "k3/config.hpp"
#include "k3/cuda_moe.hpp"
#include "k3/formats.hpp"
#include "k3/moe.hpp"
#include "k3/mx.hpp"

namespace k3::cuda::moe_detail {

// ---- status bits (the int at MoePlan::ws_status; run_host turns them into kInexact) ---------

// An MXFP8 block of x (W4A8) dequantizes to a value BF16 does not hold as a normal number: a
// BF16 subnormal or below (|value| < 2^-126). The BF16 operand would round or be flushed.
inline constexpr int kStatusInexactX = 1;
// The same for the W4A8 re-quantized activation output (FC1 epilogue -> FC2 operand).
inline constexpr int kStatusInexactAct = 2;

// ---- kernel dimensions -------------------------------------------------------------------

struct Dims {
  int64_t k;         // hidden (GEMM1 reduction, GEMM2 output columns)
  int64_t n;         // intermediate
  int top_k;
  int e_local;
  int first_local;   // global id of local expert 0
  int block_m;
  int64_t max_m;
  int64_t max_slots;
  int64_t max_tiles;
  int chunks;        // sort chunks
  int chunk;         // token-slots per chunk
};

inline Dims dims_of(const MoePlan& plan) {
  const auto& sh = plan.problem.shape;
  Dims d{};
  d.k = sh.hidden;
  d.n = sh.intermediate;
  d.top_k = sh.top_k;
  d.e_local = sh.local_experts();
  d.first_local = sh.first_local_expert();
  d.block_m = plan.block_m;
  d.max_m = plan.max_tokens;
  d.max_slots = plan.max_slots;
  d.max_tiles = plan.max_tiles;
  d.chunk = plan.sort_chunk;
  d.chunks = static_cast<int>((plan.max_slots + plan.sort_chunk - 1) / plan.sort_chunk);
  return d;
}

// The token count a kernel uses: the value read from device memory (DeviceInputs::m_device),
// clamped to [0, max_m]. Every buffer is sized for max_m rows, so a larger value must never
// index past topk_ids, x, the row map or out; a negative one means no tokens.
K3_HOST_DEVICE constexpr int64_t clamp_tokens(int32_t m_device, int64_t max_m) {
  return m_device < 0 ? 0 : (m_device > max_m ? max_m : static_cast<int64_t>(m_device));
}

// ---- activation (FC1 epilogue) -------------------------------------------------------------

struct ActParams {
  ActivationKind kind;
  float swiglu_alpha, swiglu_beta, swiglu_limit;
  const float* situ_beta;         // [E_local] device
  const float* situ_linear_beta;  // [E_local] device
};

// min(v, hi) and clamp(v, lo, hi) that return NaN for a NaN v, as the contract's SwiGLU does
// (k3/activation.hpp). fminf / fmaxf return the other operand for a NaN and would hide it.
using act::clamp_keep_nan;
using act::min_keep_nan;

// The kernels' math for the shared activation formulas: CUDA's expf / tanhf (the host's libm
// where this header is compiled for host tests).
struct DeviceMath {
  K3_HOST_DEVICE static float exp(float x) { return expf(x); }
  K3_HOST_DEVICE static float tanh(float x) { return tanhf(x); }
};

// The gated activation in FP32 (k3/activation.hpp); b, lb: this expert's SiTU betas.
K3_HOST_DEVICE inline float activation_f32(ActivationKind kind, float alpha, float beta, float limit, float b,
                                           float lb, float g, float u) {
  return act::gated<DeviceMath>(kind, g, u, b, lb, alpha, beta, limit);
}

// As used by the kernels: the SiTU betas are read per local expert (device pointers there).
K3_HOST_DEVICE inline float activation_f32(const ActParams& p, int expert, float g, float u) {
  const bool situ = p.kind == ActivationKind::kSiTU;
  const float b = situ ? p.situ_beta[expert] : 1.0f, lb = situ ? p.situ_linear_beta[expert] : 1.0f;
  return activation_f32(p.kind, p.swiglu_alpha, p.swiglu_beta, p.swiglu_limit, b, lb, g, u);
}

// ---- MXFP8 values as BF16 GEMM operands (W4A8 x and activation output) -----------------------

// True when BF16 holds the FP32 dequantization of `code` under `scale_code` (mx_decode_element,
// the contract's value) exactly as an operand the tensor cores use as is: zero, NaN, +-Inf (the
// FP32 dequantization overflows at scale codes >= 247: that Inf *is* the contract's value, and
// BF16 holds it exactly) or a normal number. BF16 subnormals and values below them are not
// (rounded by the conversion, or flushed), nor is a value with more than 8 significant bits
// (impossible for E2M1 / E4M3, checked anyway).
K3_HOST_DEVICE constexpr bool mx_bf16_operand_exact(uint8_t code, uint8_t scale_code, MxElement e) {
  const uint32_t bits = f32_to_bits(mx_decode_element(code, scale_code, e));
  const uint32_t exp_field = (bits >> 23) & 0xFFu;
  if ((bits & 0x7FFFFFFFu) == 0 || exp_field == 0xFFu) return true;  // +-0, +-Inf, NaN
  return exp_field != 0 && (bits & 0xFFFFu) == 0;
}

// One element: MXFP8 (E4M3) code of v under scale sc, dequantized to BF16 bits; clears `exact`
// when BF16 does not hold it (mx_bf16_operand_exact).
K3_HOST_DEVICE constexpr uint16_t mxfp8_bf16_operand(float v, uint8_t sc, bool& exact) {
  const uint8_t code = mx_encode_element(v, sc, MxElement::kE4M3);
  exact = exact && mx_bf16_operand_exact(code, sc, MxElement::kE4M3);
  return bf16_from_f32(mx_decode_element(code, sc, MxElement::kE4M3));
}

// W4A8 FC1 epilogue, one lane's values of a 32-column block whose scale `sc` the quad has agreed
// on (0xFF when any of the 32 is NaN): the MXFP8 values as exact BF16 operands of FC2. Returns
// false when some value is not held exactly (the kernel then sets kStatusInexactAct): the CPU
// backend and the contract keep such values exactly, so the CUDA path reports kInexact instead
// of rounding them.
template <int N>
K3_HOST_DEVICE constexpr bool mxfp8_bf16_operands(const float (&v)[N], uint8_t sc, uint16_t (&h)[N]) {
  bool exact = true;
  for (int t = 0; t < N; ++t) h[t] = mxfp8_bf16_operand(v[t], sc, exact);
  return exact;
}

// W4A8 prep_x for one 32-block of x: MXFP8 (E4M3, RCEIL; a NaN block gets scale 0xFF) and the
// exact dequantization as BF16 into dst. Returns false when some value is not held exactly
// (the kernel then sets kStatusInexactX).
K3_HOST_DEVICE constexpr bool w4a8_prep_block(const uint16_t* src, uint16_t* dst) {
  MxBlockAmax block;
  for (int j = 0; j < kMxBlock; ++j) block.add(bf16_to_f32(src[j]));
  const uint8_t scale = block.scale_code(MxElement::kE4M3, ScaleRule::kRceil);
  bool exact = true;
  for (int j = 0; j < kMxBlock; ++j) dst[j] = mxfp8_bf16_operand(bf16_to_f32(src[j]), scale, exact);
  return exact;
}

// ---- MXFP4 weights -> BF16 (FC1 / FC2 B operand) --------------------------------------------

// BF16 bits of E2M1 `code` times 2^(scale_code - 127): the kernels' register dequantization, an
// exponent add of fp4_exp_add(scale) to the BF16 bits of the E2M1 value, then an OR with
// fp4_nan_mask(scale). Exact for every (code, scale) that prepack accepts
// (mx_find_bf16_inexact_block: every nonzero product a normal BF16), and for scale 0xFF, which
// the contract defines as NaN for the whole block (0 x NaN too): the mask sets the exponent and
// the top mantissa bit, which makes any BF16 a NaN. The add alone would carry 0xFF's exponent
// into the sign bit (+Inf, -0, ...).
K3_HOST_DEVICE constexpr uint32_t fp4_exp_add(uint8_t scale_code) {
  return static_cast<uint32_t>(static_cast<int32_t>(scale_code) - 127) << 7;
}
K3_HOST_DEVICE constexpr uint32_t fp4_nan_mask(uint8_t scale_code) {
  return scale_code == kE8M0Nan ? 0x7FC07FC0u : 0u;  // both halves of a BF16 pair
}
K3_HOST_DEVICE constexpr uint32_t fp4_to_bf16(uint32_t code, uint32_t exp_add) {
  const uint32_t mag = code & 7u;
  const uint32_t bits = mag == 1u ? 0x3F00u : ((((mag >> 1) + 126u) << 7) | ((mag & 1u) << 6));
  return (mag == 0u ? 0u : bits + exp_add) | ((code & 8u) << 12);
}

// Two BF16 values of one packed byte (low nibble = even k) as a 32-bit MMA operand register.
K3_HOST_DEVICE constexpr uint32_t fp4x2_to_bf16x2(uint32_t byte, uint32_t exp_add, uint32_t nan_mask) {
  return (fp4_to_bf16(byte & 0xFu, exp_add) | (fp4_to_bf16((byte >> 4) & 0xFu, exp_add) << 16)) | nan_mask;
}
K3_HOST_DEVICE constexpr uint32_t fp4x2_to_bf16x2(uint32_t byte, uint8_t scale_code) {
  return fp4x2_to_bf16x2(byte, fp4_exp_add(scale_code), fp4_nan_mask(scale_code));
}

// ---- launch geometry -----------------------------------------------------------------------

struct Grid {
  uint32_t x = 1, y = 1, z = 1;
};
inline constexpr int64_t kMaxGridX = 2147483647;  // CUDA limits (every architecture k3 targets)
inline constexpr int64_t kMaxGridYZ = 65535;

inline constexpr int kPrepThreads = 128;
inline constexpr int kFinalizeThreads = 256;

constexpr uint32_t grid_dim(int64_t v, int64_t limit) {
  return static_cast<uint32_t>(v < 1 ? 1 : (v > limit ? limit : v));
}

// prep_x: one thread per (token, 32-block), grid-stride over max_m * K/32 blocks.
constexpr Grid prep_grid(const Dims& d) {
  const int64_t blocks = d.max_m * (d.k / kMxBlock);
  return {grid_dim((blocks + kPrepThreads - 1) / kPrepThreads, kMaxGridX), 1, 1};
}

// Grouped GEMMs: x = output column tiles, y = row tiles (max_tiles <= 36800 for every plan:
// max_slots <= 65536 * 32 and E_local <= 4096; tests/core/test_cuda_moe_shared.cpp).
constexpr Grid gemm_grid(const Dims& d, bool fc1, int block_n) {
  return {grid_dim((fc1 ? d.n : d.k) / block_n, kMaxGridX), grid_dim(d.max_tiles, kMaxGridYZ), 1};
}

// Finalize: x = column blocks of K, y = token rows, grid-stride (t += gridDim.y): max_m may be
// 65536, one more than gridDim.y allows.
constexpr Grid finalize_grid(const Dims& d) {
  return {grid_dim((d.k + kFinalizeThreads - 1) / kFinalizeThreads, kMaxGridX), grid_dim(d.max_m, kMaxGridYZ), 1};
}

}  // namespace k3::cuda::moe_detail
