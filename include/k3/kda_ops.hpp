// k3/kda_ops.hpp — the small ops around the KDA core (docs/kda.md, "The K3 layer around the
// core"): the causal depthwise convolution + SiLU on q, k and v with its rolling state, and the
// gated per-head RMSNorm of the output. FP32 tensors, token-major, non-owning views.
// Each op has an FP64 reference (computed in double, rounded once to FP32) and a CPU op (FP32
// arithmetic, threads over independent rows/channels, bit-identical for any thread count;
// threads = 0: all logical CPUs, hardware_thread_count(); no environment variable is read).
#pragma once

#include <cstdint>
#include <span>

#include "k3/status.hpp"

namespace k3::kda {

inline constexpr int64_t kMaxConvWidth = 8;

// y_t[c] = silu(bias[c] + sum_{i<W} weight[c, i] x_{t-W+1+i}[c]) within each sequence (PyTorch
// conv1d with groups = D and left padding W - 1); inputs before a sequence's first token come
// from its conv_state: conv_state[n, c, j] is the input at position j - (W - 1) (j = W - 2 is
// the latest). After the call conv_state holds each sequence's last W - 1 inputs (rolling), so
// decode is the same call with one token per sequence.
struct ConvArgs {
  int64_t channels = 0;                 // D (H * K for q and k, H * V for v)
  int64_t width = 4;                    // W in [2, kMaxConvWidth]
  bool silu = true;                     // false: the convolution alone
  std::span<const float> x;             // [T, D]
  std::span<const float> weight;        // [D, W]
  std::span<const float> bias;          // [D] or empty
  std::span<const int64_t> cu_seqlens;  // [N + 1] or empty (one sequence)
  std::span<float> conv_state;          // [N, D, W - 1] read, then overwritten; empty: zeros, not returned
  std::span<float> y;                   // [T, D]
};
Status causal_conv1d(const ConvArgs& a, int threads = 0);
Status causal_conv1d_reference(const ConvArgs& a);

// y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight * sigmoid(gate[r, :]) per row of D
// (a row is one token's head: rows = T * H, D = V; weight shared by the heads).
struct GatedRmsNormArgs {
  int64_t dim = 0;                  // D
  float eps = 1e-5f;
  std::span<const float> x;         // [rows, D]
  std::span<const float> gate;      // [rows, D]
  std::span<const float> weight;    // [D]
  std::span<float> y;               // [rows, D]
};
Status gated_rmsnorm(const GatedRmsNormArgs& a, int threads = 0);
Status gated_rmsnorm_reference(const GatedRmsNormArgs& a);

namespace detail {
Status validate_conv(const ConvArgs& a, int64_t* num_tokens, int64_t* num_seqs);
// validate_conv without reading cu_seqlens' entries (only its size: empty or >= 2), for device
// spans (k3/cuda_kda_ops.hpp); every other check and message is validate_conv's.
Status validate_conv_sizes(const ConvArgs& a, int64_t* num_tokens, int64_t* num_seqs);
Status validate_rmsnorm(const GatedRmsNormArgs& a, int64_t* rows);
}  // namespace detail

}  // namespace k3::kda
