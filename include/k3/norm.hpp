// k3/norm.hpp — RMSNorm of rows (docs/transformers.md: the decoder layers' norms of a Kimi-Linear
// model, `k3.hf.patch`), in the form transformers' Llama / T5 / Kimi-Linear RMSNorm computes:
//
//   r    = 1 / sqrt(S / D + eps)      S = sum_j x_j^2 in FP32 (k3's order, below)
//   h_j  = x_j * r                    rounded to the storage type (BF16 or FP32)
//   y_j  = weight_j * h_j             one FP32 product, rounded to the storage type
//
// Storage: x, weight and y all BF16 bits or all FP32; rows of D, row-major. S is summed in 16
// interleaved FP32 partial sums (element j into partial j mod 16, ascending j), which are then
// added pairwise (0+8, 1+9, ...; then 0+4, ...): the same bits on every ISA level and thread
// count (the library is built with -ffp-contract=off). torch sums in its own order, so a value
// can differ from torch's in the last bit of S; that reaches an output at most as one rounding
// step of the storage type (tested against transformers' module).
#pragma once

#include <cstdint>
#include <span>

#include "k3/status.hpp"

namespace k3 {

template <typename T>  // uint16_t (BF16 bits) or float
struct RmsNormArgs {
  int64_t dim = 0;              // D >= 1
  float eps = 1e-6f;            // finite, >= 0
  std::span<const T> x;         // [rows, D]
  std::span<const T> weight;    // [D]
  std::span<T> y;               // [rows, D]; may be x's memory (in place)
};

// threads: 0 = all logical CPUs; rows are split between threads (one row: one thread).
Status rms_norm(const RmsNormArgs<uint16_t>& a, int threads = 0);
Status rms_norm(const RmsNormArgs<float>& a, int threads = 0);
// FP64 oracle: r and h_j in FP64, the two roundings to the storage type as above.
Status rms_norm_oracle(const RmsNormArgs<uint16_t>& a);
Status rms_norm_oracle(const RmsNormArgs<float>& a);

// The gated form (transformers' KimiLinearRMSNormGated: the KDA output norm, one row per token
// and head; fla's FusedRMSNormGated with a sigmoid): r as above, then
//   y_j = ((weight_j * (x_j * r)) * sigmoid(gate_j))   in FP32, rounded once to the storage type,
// sigmoid(g) = 1 / (1 + expf(-g)) (the C library's expf). torch computes its sigmoid with its
// own exp, so an output can differ from transformers' by a rounding.
template <typename T>
struct GatedRmsNormRowsArgs {
  int64_t dim = 0;              // D >= 1
  float eps = 1e-6f;            // finite, >= 0
  std::span<const T> x;         // [rows, D]
  std::span<const T> gate;      // [rows, D]
  std::span<const T> weight;    // [D]
  std::span<T> y;               // [rows, D]; may be x's memory
};
Status rms_norm_gated(const GatedRmsNormRowsArgs<uint16_t>& a, int threads = 0);
Status rms_norm_gated(const GatedRmsNormRowsArgs<float>& a, int threads = 0);
// FP64 oracle: everything in FP64, one rounding to the storage type.
Status rms_norm_gated_oracle(const GatedRmsNormRowsArgs<uint16_t>& a);
Status rms_norm_gated_oracle(const GatedRmsNormRowsArgs<float>& a);

}  // namespace k3
