// CPU ops around the KDA core: causal depthwise conv + SiLU, gated RMSNorm. FP32 arithmetic in a
// fixed order per output element; threads over (sequence, channel block) and rows.
#include <algorithm>
#include <cmath>

#include "k3/formats.hpp"
#include "k3/kda_ops.hpp"
#include "k3/system.hpp"

namespace k3::kda {
namespace {
constexpr int64_t kChannelBlock = 64;  // channels per work item: contiguous, vectorizable
int resolve(int threads) { return threads > 0 ? threads : hardware_thread_count(); }  // 0: all logical CPUs

// FP32 and BF16 storage: the same arithmetic on the loaded (widened) values.
float load(float v) { return v; }
float load(uint16_t v) { return bf16_to_f32(v); }
template <typename T>
T store(float v);
template <>
float store<float>(float v) { return v; }
template <>
uint16_t store<uint16_t>(float v) { return bf16_from_f32(v); }

template <typename T, typename Args>
Status conv_impl(const Args& a, int threads, int64_t T_, int64_t N) {
  if (threads < 0) return invalid_argument("threads = " + std::to_string(threads) + " must be >= 0 (0: all logical CPUs)");
  const int64_t D = a.channels, W = a.width, S = detail::conv_state_len(W, a.state_len);
  const int64_t blocks = (D + kChannelBlock - 1) / kChannelBlock;
  T* const state_base = a.conv_state.empty() ? nullptr : a.conv_state.data();
#pragma omp parallel for schedule(dynamic, 1) num_threads(resolve(threads)) if (N * blocks > 1)
  for (int64_t u = 0; u < N * blocks; ++u) {
    const int64_t n = u / blocks, c0 = (u % blocks) * kChannelBlock, c1 = std::min(D, c0 + kChannelBlock);
    const int64_t t0 = a.cu_seqlens.empty() ? 0 : a.cu_seqlens[n];
    const int64_t t1 = a.cu_seqlens.empty() ? T_ : a.cu_seqlens[n + 1];
    // win[i][c - c0]: the input at position t - W + 1 + i, shifted by one every token.
    float win[kMaxConvWidth][kChannelBlock];
    for (int64_t i = 0; i < W - 1; ++i) {
      for (int64_t c = c0; c < c1; ++c) {
        win[i][c - c0] = state_base == nullptr ? 0.0f : load(state_base[(n * D + c) * S + (S - (W - 1)) + i]);
      }
    }
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t c = c0; c < c1; ++c) win[W - 1][c - c0] = load(a.x[t * D + c]);
      for (int64_t c = c0; c < c1; ++c) {
        float z = a.bias.empty() ? 0.0f : a.bias[c];
        for (int64_t i = 0; i < W; ++i) z += load(a.weight[c * W + i]) * win[i][c - c0];
        a.y[t * D + c] = store<T>(a.silu ? z / (1.0f + std::exp(-z)) : z);
      }
      for (int64_t i = 0; i + 1 < W; ++i) std::copy(win[i + 1], win[i + 1] + (c1 - c0), win[i]);
    }
    if (state_base != nullptr) {  // the last S inputs: older state entries shift down, then the tokens
      const int64_t L = t1 - t0, keep = std::max<int64_t>(S - L, 0);
      for (int64_t c = c0; c < c1; ++c) {
        T* st = state_base + (n * D + c) * S;
        for (int64_t j = 0; j < keep; ++j) st[j] = st[j + L];
        for (int64_t j = keep; j < S; ++j) st[j] = a.x[(t1 - (S - j)) * D + c];
      }
    }
  }
  return Status::ok();
}
}  // namespace

Status causal_conv1d(const ConvArgs& a, int threads) {
  int64_t T = 0, N = 0;
  K3_RETURN_IF_ERROR(detail::validate_conv(a, &T, &N));
  return conv_impl<float>(a, threads, T, N);
}

Status causal_conv1d_bf16(const ConvArgsBf16& a, int threads) {
  int64_t T = 0, N = 0;
  K3_RETURN_IF_ERROR(detail::validate_conv_bf16(a, &T, &N));
  return conv_impl<uint16_t>(a, threads, T, N);
}

Status gated_rmsnorm(const GatedRmsNormArgs& a, int threads) {
  int64_t rows = 0;
  K3_RETURN_IF_ERROR(detail::validate_rmsnorm(a, &rows));
  if (threads < 0) return invalid_argument("threads = " + std::to_string(threads) + " must be >= 0 (0: all logical CPUs)");
  const int64_t D = a.dim;
#pragma omp parallel for schedule(static) num_threads(resolve(threads))
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = a.x.data() + r * D;
    float ss = 0.0f;
    for (int64_t j = 0; j < D; ++j) ss += x[j] * x[j];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + a.eps);
    for (int64_t j = 0; j < D; ++j) {
      a.y[r * D + j] = x[j] * inv * a.weight[j] / (1.0f + std::exp(-a.gate[r * D + j]));
    }
  }
  return Status::ok();
}

}  // namespace k3::kda
