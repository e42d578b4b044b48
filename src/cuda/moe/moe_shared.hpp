// Host + device code of the CUDA fused-MoE backend: the per-element arithmetic, the status bits,
// the kernel dimensions and the launch geometry. It includes no CUDA header, so the exact
// functions the kernels run are also compiled by the host compiler and unit-tested without a GPU
// (tests/core/test_cuda_moe_shared.cpp). The kernels themselves are NOT YET RUN ON A GPU.
#pragma once

#include <math.h>

#include <cstdint>

#include "k3/config.hpp"
#include "k3/cuda_moe.hpp"
#include "k3/formats.hpp"
#include "k3/moe.hpp"
#include "k3/mx.hpp"

namespace k3::cuda::moe_detail {

// ---- status bits (the int at MoePlan::ws_status; run_host turns them into kInexact) ---------

// Bit 0: an MXFP8 block of x has a scale outside the range where its values are exact BF16
// (docs/formats.md); the result would not be exact.
inline constexpr int kStatusInexactX = 1;

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
  d.max_m = plan.max_m;
  d.max_slots = plan.max_slots;
  d.max_tiles = plan.max_tiles;
  d.chunk = plan.sort_chunk;
  d.chunks = static_cast<int>((plan.max_slots + plan.sort_chunk - 1) / plan.sort_chunk);
  return d;
}

// ---- activation (FC1 epilogue) -------------------------------------------------------------

struct ActParams {
  ActivationKind kind;
  float swiglu_alpha, swiglu_beta, swiglu_limit;
  const float* situ_beta;         // [E_local] device
  const float* situ_linear_beta;  // [E_local] device
};

// min(v, hi) and clamp(v, lo, hi) that return NaN for a NaN v, as the contract's SwiGLU does
// (k3/moe_ref.hpp). fminf / fmaxf return the other operand for a NaN and would hide it.
K3_HOST_DEVICE constexpr float min_keep_nan(float v, float hi) { return v > hi ? hi : v; }
K3_HOST_DEVICE constexpr float clamp_keep_nan(float v, float lo, float hi) {
  return v > hi ? hi : (v < lo ? lo : v);
}

K3_HOST_DEVICE inline float act_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// The gated activation in FP32 (formulas of k3/moe_ref.hpp); b, lb: this expert's SiTU betas.
K3_HOST_DEVICE inline float activation_f32(ActivationKind kind, float alpha, float beta, float limit, float b,
                                           float lb, float g, float u) {
  switch (kind) {
    case ActivationKind::kSiTU:
      return (b * tanhf(g / b) * act_sigmoid(g)) * (lb * tanhf(u / lb));
    case ActivationKind::kSwiGLU: {
      const float gc = min_keep_nan(g, limit);
      const float uc = clamp_keep_nan(u, -limit, limit);
      return gc * act_sigmoid(alpha * gc) * (uc + beta);
    }
    case ActivationKind::kSiLU:
    default:
      return g * act_sigmoid(g) * u;
  }
}

// As used by the kernels: the SiTU betas are read per local expert (device pointers there).
K3_HOST_DEVICE inline float activation_f32(const ActParams& p, int expert, float g, float u) {
  const bool situ = p.kind == ActivationKind::kSiTU;
  const float b = situ ? p.situ_beta[expert] : 1.0f, lb = situ ? p.situ_linear_beta[expert] : 1.0f;
  return activation_f32(p.kind, p.swiglu_alpha, p.swiglu_beta, p.swiglu_limit, b, lb, g, u);
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

}  // namespace k3::cuda::moe_detail
