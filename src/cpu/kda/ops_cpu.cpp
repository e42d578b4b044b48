// CPU ops around the KDA core: causal depthwise conv + SiLU, gated RMSNorm. FP32 arithmetic in a
// fixed order per output element; threads over (sequence, channel block) and rows.
#include <algorithm>
#include <cmath>

#include "k3/kda_ops.hpp"
#include "k3/system.hpp"

namespace k3::kda {
namespace {
constexpr int64_t kChannelBlock = 64;  // channels per work item: contiguous, vectorizable
int resolve(int threads) { return threads > 0 ? threads : hardware_thread_count(); }  // 0: all logical CPUs
}  // namespace

Status causal_conv1d(const ConvArgs& a, int threads) {
  int64_t T = 0, N = 0;
  K3_RETURN_IF_ERROR(detail::validate_conv(a, &T, &N));
  if (threads < 0) return invalid_argument("threads = " + std::to_string(threads) + " must be >= 0 (0: all logical CPUs)");
  const int64_t D = a.channels, W = a.width, blocks = (D + kChannelBlock - 1) / kChannelBlock;
#pragma omp parallel for schedule(dynamic, 1) num_threads(resolve(threads))
  for (int64_t u = 0; u < N * blocks; ++u) {
    const int64_t n = u / blocks, c0 = (u % blocks) * kChannelBlock, c1 = std::min(D, c0 + kChannelBlock);
    const int64_t t0 = a.cu_seqlens.empty() ? 0 : a.cu_seqlens[n];
    const int64_t t1 = a.cu_seqlens.empty() ? T : a.cu_seqlens[n + 1];
    // win[i][c - c0]: the input at position t - W + 1 + i, shifted by one every token.
    float win[kMaxConvWidth][kChannelBlock];
    for (int64_t i = 0; i < W - 1; ++i) {
      for (int64_t c = c0; c < c1; ++c) {
        win[i][c - c0] = a.conv_state.empty() ? 0.0f : a.conv_state[(n * D + c) * (W - 1) + i];
      }
    }
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t c = c0; c < c1; ++c) win[W - 1][c - c0] = a.x[t * D + c];
      for (int64_t c = c0; c < c1; ++c) {
        float z = a.bias.empty() ? 0.0f : a.bias[c];
        for (int64_t i = 0; i < W; ++i) z += a.weight[c * W + i] * win[i][c - c0];
        a.y[t * D + c] = a.silu ? z / (1.0f + std::exp(-z)) : z;
      }
      for (int64_t i = 0; i + 1 < W; ++i) std::copy(win[i + 1], win[i + 1] + (c1 - c0), win[i]);
    }
    if (!a.conv_state.empty()) {
      for (int64_t i = 0; i < W - 1; ++i) {
        for (int64_t c = c0; c < c1; ++c) a.conv_state[(n * D + c) * (W - 1) + i] = win[i][c - c0];
      }
    }
  }
  return Status::ok();
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
