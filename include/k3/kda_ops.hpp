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
inline constexpr int64_t kMaxConvStateLen = 64;

// y_t[c] = silu(bias[c] + sum_{i<W} weight[c, i] x_{t-W+1+i}[c]) within each sequence (PyTorch
// conv1d with groups = D and left padding W - 1); inputs before a sequence's first token come
// from its conv_state: conv_state[n, c, j] is the input at position j - S (j = S - 1 is the
// latest), S = state_len (0: W - 1). Only the last W - 1 entries feed the convolution. After the
// call conv_state holds each sequence's last S inputs (rolling; older entries shift down when a
// sequence is shorter than S), so decode is the same call with one token per sequence.
// S = W is the layout of transformers' cache (`causal_conv1d_update`); S = W - 1 fla's.
struct ConvArgs {
  int64_t channels = 0;                 // D (H * K for q and k, H * V for v)
  int64_t width = 4;                    // W in [2, kMaxConvWidth]
  bool silu = true;                     // false: the convolution alone
  std::span<const float> x;             // [T, D]
  std::span<const float> weight;        // [D, W]
  std::span<const float> bias;          // [D] or empty
  std::span<const int64_t> cu_seqlens;  // [N + 1] or empty (one sequence)
  std::span<float> conv_state;          // [N, D, S] read, then overwritten; empty: zeros, not returned
  std::span<float> y;                   // [T, D]
  int64_t state_len = 0;                // S in [W - 1, kMaxConvStateLen]; 0: W - 1
};
Status causal_conv1d(const ConvArgs& a, int threads = 0);
Status causal_conv1d_reference(const ConvArgs& a);

// The same op on BF16 storage (bit patterns): x, weight, conv_state and y are BF16, bias FP32.
// The arithmetic is causal_conv1d's (FP32, the same order) on the widened values and y is rounded
// once to BF16 (RNE): the bits of causal_conv1d on the widened inputs, then rounded. The state
// holds inputs, so it is exact. This is the storage of a BF16 model's cache (transformers).
struct ConvArgsBf16 {
  int64_t channels = 0;
  int64_t width = 4;
  bool silu = true;
  std::span<const uint16_t> x;          // [T, D] BF16
  std::span<const uint16_t> weight;     // [D, W] BF16
  std::span<const float> bias;          // [D] or empty
  std::span<const int64_t> cu_seqlens;  // [N + 1] or empty (one sequence)
  std::span<uint16_t> conv_state;       // [N, D, S] BF16; empty: zeros, not returned
  std::span<uint16_t> y;                // [T, D] BF16
  int64_t state_len = 0;                // S; 0: W - 1
};
Status causal_conv1d_bf16(const ConvArgsBf16& a, int threads = 0);

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
Status validate_conv_bf16(const ConvArgsBf16& a, int64_t* num_tokens, int64_t* num_seqs);
int64_t conv_state_len(int64_t width, int64_t state_len);  // S: state_len, or W - 1 when 0
// validate_conv without reading cu_seqlens' entries (only its size: empty or >= 2), for device
// spans (k3/cuda_kda_ops.hpp); every other check and message is validate_conv's.
Status validate_conv_sizes(const ConvArgs& a, int64_t* num_tokens, int64_t* num_seqs);
Status validate_rmsnorm(const GatedRmsNormArgs& a, int64_t* rows);
}  // namespace detail

}  // namespace k3::kda
