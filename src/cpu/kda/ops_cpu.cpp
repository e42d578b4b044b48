// CPU ops around the KDA core: causal depthwise conv + SiLU, gated RMSNorm. FP32 arithmetic in a
// fixed order per output element; threads over (sequence, channel block) and rows.
#include <algorithm>
#include <cmath>
#include <cstring>

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

// WC: the width as a compile-time constant (2..8), so that the tap loops unroll and the channel
// loops vectorize.
template <typename T, int WC, typename Args>
void conv_run(const Args& a, int threads, int64_t T_, int64_t N) {
  constexpr int64_t W = WC;
  const int64_t D = a.channels, S = detail::conv_state_len(W, a.state_len);
  const int64_t blocks = (D + kChannelBlock - 1) / kChannelBlock;
  T* const state_base = a.conv_state.empty() ? nullptr : a.conv_state.data();
  const T* const x = a.x.data();
  const T* const weight = a.weight.data();
  const float* const bias = a.bias.empty() ? nullptr : a.bias.data();
  T* const y = a.y.data();
  const bool silu = a.silu;
  // Work items: (sequence, block of 64 channels), contiguous ranges per thread. Each output element
  // is z = bias + w_0 x_0 + ... + w_{W-1} x_{W-1} in that order (no FMA: this file is built for the
  // baseline ISA), then z / (1 + exp(-z)): the same bits on every thread count.
#pragma omp parallel for schedule(static) num_threads(resolve(threads)) if (N * blocks > 1)
  for (int64_t u = 0; u < N * blocks; ++u) {
    const int64_t n = u / blocks, c0 = (u % blocks) * kChannelBlock, nc = std::min(D, c0 + kChannelBlock) - c0;
    const int64_t t0 = a.cu_seqlens.empty() ? 0 : a.cu_seqlens[n];
    const int64_t t1 = a.cu_seqlens.empty() ? T_ : a.cu_seqlens[n + 1];
    // wt[i][j]: weight of tap i for channel c0 + j (transposed once: the tap loops run over j).
    // win[i][j]: the input at position t - W + 1 + i, shifted by one every token.
    float wt[kMaxConvWidth][kChannelBlock], win[kMaxConvWidth][kChannelBlock], z[kChannelBlock];
    for (int64_t j = 0; j < nc; ++j) {
      for (int64_t i = 0; i < W; ++i) wt[i][j] = load(weight[(c0 + j) * W + i]);
    }
    const T* st_row = state_base == nullptr ? nullptr : state_base + (n * D + c0) * S + (S - (W - 1));
    for (int64_t j = 0; j < nc; ++j) {
      for (int64_t i = 0; i < W - 1; ++i) win[i][j] = st_row == nullptr ? 0.0f : load(st_row[j * S + i]);
    }
    for (int64_t t = t0; t < t1; ++t) {
      const T* xt = x + t * D + c0;
      for (int64_t j = 0; j < nc; ++j) win[W - 1][j] = load(xt[j]);
      for (int64_t j = 0; j < nc; ++j) z[j] = bias == nullptr ? 0.0f : bias[c0 + j];
      for (int64_t i = 0; i < W; ++i) {
        for (int64_t j = 0; j < nc; ++j) z[j] += wt[i][j] * win[i][j];
      }
      T* yt = y + t * D + c0;
      if (silu) {  // the exponentials first (library calls), then one vectorizable pass
        float e[kChannelBlock];
        for (int64_t j = 0; j < nc; ++j) e[j] = std::exp(-z[j]);
        for (int64_t j = 0; j < nc; ++j) yt[j] = store<T>(z[j] / (1.0f + e[j]));
      } else {
        for (int64_t j = 0; j < nc; ++j) yt[j] = store<T>(z[j]);
      }
      for (int64_t i = 0; i + 1 < W; ++i) std::copy(win[i + 1], win[i + 1] + nc, win[i]);
    }
    if (state_base != nullptr) {  // the last S inputs: older state entries shift down, then the tokens
      const int64_t L = t1 - t0, keep = std::max<int64_t>(S - L, 0);
      T* const block = state_base + (n * D + c0) * S;  // [nc, S], contiguous
      if (keep > 0 && L > 0) {
        // One move of the whole block by L entries puts every row's entries k + L at k for k < keep
        // (the rest of each row is overwritten with the tokens below).
        std::memmove(block, block + L, static_cast<size_t>(nc * S - L) * sizeof(T));
      }
      for (int64_t k = keep; k < S; ++k) {
        const T* xk = x + (t1 - (S - k)) * D + c0;
        for (int64_t j = 0; j < nc; ++j) block[j * S + k] = xk[j];
      }
    }
  }
}

template <typename T, typename Args>
Status conv_impl(const Args& a, int threads, int64_t T_, int64_t N) {
  K3_RETURN_IF_ERROR(check_thread_count(threads));
  switch (a.width) {  // validated: 2..kMaxConvWidth
    case 2: conv_run<T, 2>(a, threads, T_, N); break;
    case 3: conv_run<T, 3>(a, threads, T_, N); break;
    case 4: conv_run<T, 4>(a, threads, T_, N); break;
    case 5: conv_run<T, 5>(a, threads, T_, N); break;
    case 6: conv_run<T, 6>(a, threads, T_, N); break;
    case 7: conv_run<T, 7>(a, threads, T_, N); break;
    default: conv_run<T, 8>(a, threads, T_, N); break;
  }
  return Status::ok();
}
static_assert(kMaxConvWidth == 8, "conv_impl dispatches widths 2..8");
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
  K3_RETURN_IF_ERROR(check_thread_count(threads));
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
