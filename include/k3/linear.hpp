// k3/linear.hpp — the dense linear layer Y[M, N] = X[M, K] · Wᵀ (+ bias) with MXFP8 or BF16
// weights (docs/linear.md, "the linear contract"). Shared by the oracles (src/core/linear) and the CPU
// backend (k3/cpu_linear.hpp). Plain values and non-owning views; nothing here allocates.
//
// The contract, for every output element (m, n), in this order:
//   x_k   = the BF16 value of X[m, k]                              (recipes W8A16 and W16A16)
//         = the exact FP32 value of X[m, :] quantized to MXFP8     (recipe W8A8: E4M3, RCEIL, RNE,
//           per 32 along K, the codec of k3/mx.hpp)
//   w_k   = the unscaled E4M3 value of W[n, k];  s_b = W's E8M0 scale code of block b
//           (recipe W16A16: w_k = the BF16 value of W[n, k] and s_b = 127, a scale of 1)
//   total = +0
//   for each block b of 32 along K, in order:
//     partial = +0
//     for each pair p = 0..15 of the block: partial = fma(w_odd, x_odd, partial),
//                                           partial = fma(w_even, x_even, partial)
//     total = fma(partial, 2^(s_b - 127), total)
//   y = total (+ bias[n] as one FP32 addition), rounded once (RNE) to the output dtype.
// Every operation is an IEEE FP32 operation; the CPU backend computes exactly this on every ISA
// level and thread count (bit-identical to linear_reference below).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "k3/moe.hpp"  // OutDType
#include "k3/status.hpp"

namespace k3 {

enum class LinearRecipe : uint8_t {
  kW8A8,   // X quantized per row to MXFP8 (E4M3 + E8M0 per 32 along K, RCEIL), the seed's recipe
  kW8A16,  // X stays BF16
  kW16A16, // BF16 weights (no quantization), X stays BF16
};
const char* linear_recipe_name(LinearRecipe r);  // "w8a8" / "w8a16" / "w16a16"
Result<LinearRecipe> parse_linear_recipe(const std::string& s);

inline constexpr int64_t kLinearMaxDim = int64_t{1} << 20;  // the largest K or N a plan accepts

struct LinearProblem {
  int64_t k = 0;  // input features: a positive multiple of 32, at most kLinearMaxDim
  int64_t n = 0;  // output features: positive, at most kLinearMaxDim (any value)
  LinearRecipe recipe = LinearRecipe::kW8A16;
  OutDType out_dtype = OutDType::kBF16;
  bool bias = false;  // an FP32 bias of N values, added once before the output rounding
};

// Checks k (positive multiple of 32, <= kLinearMaxDim) and n (1..kLinearMaxDim); names the field.
Status validate_linear_problem(const LinearProblem& p);

// Weights in the checkpoint layout (non-owning):
//   codes  [N, K]    E4M3 codes (OCP E4M3FN; 0x7F / 0xFF are NaN and refused)   W8A8, W8A16
//   scales [N, K/32] E8M0 codes, linear layout (0xFF is NaN and refused)         W8A8, W8A16
//   bf16   [N, K]    BF16 bits (NaN refused; +-Inf allowed)                      W16A16
//   bias   [N]       FP32 (only when the problem has a bias)
// The fields the recipe does not use must be empty.
struct LinearWeightsView {
  std::span<const uint8_t> codes;
  std::span<const uint8_t> scales;
  std::span<const float> bias;
  std::span<const uint16_t> bf16;
};

// Checks the sizes, then every code: the first NaN element or scale is named by row and block
// (W16A16: the first NaN weight by row and column).
Status validate_linear_weights(const LinearProblem& p, const LinearWeightsView& w);
// Checks x (M * K BF16 values) and out (M * N elements of the output dtype).
Status validate_linear_io(const LinearProblem& p, int64_t m, std::span<const uint16_t> x, std::span<const uint8_t> out);

// The contract above, written plainly (one output at a time, no blocking, no SIMD). It is the
// definition the CPU backend is tested against bit for bit, and the "reference" backend.
Status linear_reference(const LinearProblem& p, const LinearWeightsView& w, int64_t m, std::span<const uint16_t> x,
                        std::span<uint8_t> out);

// The exact operand values of the contract for one row of X: x_k as FP32 (BF16 value, or the
// MXFP8 round trip for W8A8). out: K floats.
void linear_operand_row(const LinearProblem& p, std::span<const uint16_t> x_row, std::span<float> out);

// The FP64 oracle: y = sum_k w_k 2^(s_b - 127) x_k (+ bias) in FP64 (exact products, FP64
// accumulation), with x_k the contract's operand values. out_fp64: M * N values before the
// output rounding (round_output() in k3/moe_ref.hpp rounds them once).
Status linear_oracle_fp64(const LinearProblem& p, const LinearWeightsView& w, int64_t m,
                          std::span<const uint16_t> x, std::span<double> out_fp64);

// Outputs (M*N values of `dtype`, little-endian) that differ from `want` bit for bit, NaN counted
// as a class (two NaNs with different payloads agree). -1 when the sizes differ. The bit-identity
// check of the tests and of `k3 validate --op linear`; `first` (optional) gets the first index.
int64_t count_output_mismatches(std::span<const uint8_t> got, std::span<const uint8_t> want, OutDType dtype,
                                int64_t* first = nullptr);

}  // namespace k3
