// k3/moe_ref.hpp — the FP64 oracles of the fused-MoE contract (docs/moe.md).
//
// Two oracles, both computed from exactly the same inputs a backend gets (the BF16 x, the packed
// MXFP4 weights and their E8M0 scales, the routing ids and weights); neither ever sees
// pre-quantization weights:
//
//  * kContract — the contract itself with FP64 arithmetic between its rounding points:
//      1. input:       W4A8:  x (BF16) -> MXFP8 (E4M3, RCEIL, RNE) per 32 along K, dequantized
//                      W4A16: x (BF16) as is
//      2. GEMM1:       h[2N] = W1 · x, operands dequantized exactly to FP32 (k3/mx.hpp: exact except
//                      overflow to +-Inf at scale codes >= 247, and NaN for a 0xFF scale), products
//                      and sums in FP64
//      3. activation:  in FP64 on (gate = h[0..N), up = h[N..2N)), then rounded once to FP32 (the
//                      value a backend's FP32 activation produces; it also makes step 4 use the
//                      shared, NVIDIA-bit-exact codec of k3/mx.hpp unchanged)
//      4. requantize:  W4A8:  MXFP8 (E4M3, RCEIL, RNE) per 32 along N, dequantized
//                      W4A16: BF16 (RNE)
//      5. GEMM2:       y[K] = W2 · a in FP64
//      6. finalize:    out[t] = sum over slots k = 0..top_k-1, in slot order, of w[t,k] · y[t,k], FP64.
//                      Masked (-1) slots and slots of experts not on this EP rank are skipped:
//                      they contribute nothing (not even a NaN weight). A row without a local slot
//                      is +0.0 everywhere.
//  * kBf16Reference — the seeds' reference: steps 1, 2, 3 (without the FP32 rounding), 5, 6, with no
//    re-quantization or rounding of the intermediate. It measures what the recipe itself loses.
//
// `out` is the FP64 finalize sum before the final rounding; round_output() applies that rounding
// (once, directly from FP64, RNE) to BF16 / FP16 / FP32.
//
// Determinism: every output element is computed by one thread with a fixed summation order (32
// interleaved partial sums over the reduction dimension, combined pairwise), so results are
// bit-identical across runs and OpenMP thread counts.
//
// Activation formulas (FP64), sigmoid(v) = 1 / (1 + exp(-v)):
//   SiTU:   (b · tanh(g / b) · sigmoid(g)) · (lb · tanh(u / lb))
//   SwiGLU: g' = min(g, L); u' = clamp(u, -L, L); g' · sigmoid(alpha · g') · (u' + beta)
//           The clamps propagate NaN (unlike fminf / fmaxf, which would turn NaN into the limit).
//   SiLU:   g · sigmoid(g) · u
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "k3/moe.hpp"
#include "k3/status.hpp"

namespace k3 {

enum class OracleKind : uint8_t { kContract, kBf16Reference };

const char* oracle_kind_name(OracleKind k);  // "contract" / "bf16_reference"

// FP64 oracle of the fused-MoE contract for any recipe / activation / EP rank.
// out: [M, K] FP64, the finalize sum BEFORE the final rounding to the output dtype.
// Errors: every buffer is checked (validate_moe_buffers), out.size() must be M*K, and the
// activation parameters must be finite with SiTU betas > 0. OpenMP-parallel, deterministic.
//
// rows_beyond_fp32 (optional, resized to [M]): true for the rows where an FP32-accumulating
// backend necessarily leaves the FP64 contract's NaN / Inf class (docs/moe.md, "Limits"): for one
// of the row's local slots, a GEMM1 value (gate or up) or a GEMM2 value of the contract is finite
// in FP64 but beyond FLT_MAX, so FP32 holds +-Inf there (an activation that clamps, like SwiGLU's,
// then turns the FP64 value into a finite output and the FP32 Inf into NaN). Not marked: an
// intermediate FP32 partial sum that overflows while the FP64 result stays in range (only a
// cancellation of values near FLT_MAX does that). Generated cases stay far below; the nonfinite
// suite's largest-BF16 input under W4A16 does not.
Status moe_oracle(const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in, OracleKind kind,
                  std::span<double> out, std::vector<bool>* rows_beyond_fp32 = nullptr);

// Both oracles in one pass (steps 1-2 are shared, so this costs about 2/3 of two calls); each
// output is bit-identical to its moe_oracle() result. rows_beyond_fp32: as above.
Status moe_oracles(const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in, std::span<double> contract,
                   std::span<double> bf16_reference, std::vector<bool>* rows_beyond_fp32 = nullptr);

// Rounds FP64 values once (RNE, overflow to +-Inf, NaN -> the canonical 0x7FFF / 0x7FC00000) to
// the output dtype; writes little-endian bytes, out.size() == in.size() * out_dtype_size(dtype).
// Sizes that do not match write nothing (the function is total on valid sizes only).
void round_output(std::span<const double> in, OutDType dtype, std::span<uint8_t> out);

// FP64 -> FP32 with one RNE rounding; beyond FLT_MAX + half an ulp -> +-Inf (the plain C++
// conversion of such a value is undefined behaviour); NaN stays NaN.
float round_to_f32(double v);

// Scalar activations in FP64 (the formulas above).
double sigmoid_ref(double v);
double situ_ref(double gate, double up, double beta, double linear_beta);
double swiglu_ref(double gate, double up, double alpha, double beta, double limit);
double silu_and_mul_ref(double gate, double up);
// The problem's activation with SiTU betas (b, lb) given explicitly (per-expert overrides).
double activation_ref(const Activation& a, double gate, double up, double situ_beta, double situ_linear_beta);

// Checks that the activation parameters are usable: all finite, SiTU betas > 0, SwiGLU limit >= 0.
Status validate_activation(const Activation& a);

// situ_and_mul reference: in [rows, 2D] with row stride `ld` (elements, ld >= 2D), gate = the
// first D columns, up = the next D; out [rows, D] (dense). Computed in FP64, rounded once to FP32.
// beta, linear_beta must be finite and > 0; in must hold (rows-1)*ld + 2D elements.
Status situ_and_mul_ref(std::span<const float> in, int64_t rows, int64_t d, int64_t ld, float beta,
                        float linear_beta, std::span<float> out);

}  // namespace k3
