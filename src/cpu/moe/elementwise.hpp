// Element-wise kernels of the CPU MoE pipeline: gated activations (FP32) and the MXFP8 block
// quantizer of the activation output. Branch-free scalar code with explicit FMAs, compiled for
// each ISA level (the compiler vectorizes the loops): every level gives the same bits.
#pragma once

#include <cstdint>

#include "k3/moe.hpp"
#include "k3/system.hpp"

namespace k3::cpu::detail {

struct ActParams {
  ActivationKind kind = ActivationKind::kSiTU;
  float beta = 4.0f, linear_beta = 25.0f;               // SiTU
  float alpha = 1.702f, swiglu_beta = 1.0f, limit = 7.0f;  // SwiGLU
};

struct Elementwise {
  // out[i] = act(gate[i], up[i]) for i < n (FP32).
  void (*activate)(const ActParams& p, const float* gate, const float* up, float* out, int64_t n);
  // 32 values -> 32 E4M3 codes and the E8M0 scale (RCEIL, RNE, saturating; a NaN anywhere gives
  // scale 0xFF and zero codes). Bit-identical to k3::mx_quantize_block(kE4M3, kRceil).
  uint8_t (*quantize_e4m3_block)(const float* v, uint8_t* codes);
  // Finalize of one token: acc[c] = sum over i < count, in order, of weights[i] * rows[i][c]
  // (FP32 FMAs from 0), c < len.
  void (*weighted_sum)(const float* const* rows, const float* weights, int count, int64_t len, float* acc);
};
const Elementwise& elementwise(IsaLevel level);

// Scalar building blocks, exposed for the tests: exp and tanh in FP32 (relative error a few
// ulp), NaN in -> NaN out, saturating to +-Inf / 0 (exp) and +-1 (tanh).
float exp_f32(float x);
float tanh_f32(float x);

}  // namespace k3::cpu::detail
