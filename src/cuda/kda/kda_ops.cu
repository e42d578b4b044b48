// The small KDA ops on the device (k3/cuda_kda_ops.hpp). Ran on an H200 (2026-12-04): tests and validate pass.
//
// conv1d: two kernels on one stream. conv_output_kernel: one block per token (grid-stride), its
// threads over channels (coalesced rows of x and y), one output element per thread from the W
// inputs in the CPU op's order; inputs before the sequence's first token come from the OLD
// conv_state. conv_state_kernel (launched after it, so no output reads a rewritten state): one
// thread per (sequence, channel) rolls that row of conv_state in place.
// gated RMSNorm: one warp per row; per-lane partial sums in a fixed order, then an xor butterfly
// (every lane ends with the same sum), then the row's outputs.
#include <algorithm>
#include <string>

#include "cuda/common.cuh"
#include "k3/cuda_kda_ops.hpp"

namespace k3::cuda {
namespace {

constexpr unsigned kConvThreads = 128;   // channels per block of the output kernel
constexpr unsigned kStateThreads = 256;  // (sequence, channel) rows per block of the state kernel
constexpr unsigned kNormThreads = 256;   // 8 warps: 8 rows per block
constexpr int64_t kMaxGridX = (int64_t{1} << 31) - 1;
constexpr int64_t kMaxGridY = 65535;

// cu_seqlens[i] clamped to [0, T]: entries are device data and may be anything.
__device__ __forceinline__ int64_t bound(const int64_t* __restrict__ cu, int64_t i, int64_t T) {
  const int64_t v = cu[i];
  return v < 0 ? 0 : (v > T ? T : v);
}

// The sequence of token t: the largest n in [0, N) whose clamped start is <= t. A binary search
// over [0, N - 1] that ends after at most log2(N) + 1 steps whatever the entries are.
__device__ __forceinline__ int64_t sequence_of(const int64_t* __restrict__ cu, int64_t N, int64_t T, int64_t t) {
  int64_t lo = 0, hi = N - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (bound(cu, mid, T) <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__global__ void conv_output_kernel(const float* __restrict__ x,        // [T, D]
                                   const float* __restrict__ weight,   // [D, W]
                                   const float* __restrict__ bias,     // [D] or null
                                   const int64_t* __restrict__ cu,     // [N + 1] or null (one sequence)
                                   const float* __restrict__ state,    // [N, D, W - 1] or null (zeros)
                                   int64_t T, int64_t D, int W, int64_t N, bool silu,
                                   float* __restrict__ y) {            // [T, D]
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    int64_t n = 0, t0 = 0, t1 = T;
    if (cu != nullptr) {
      n = sequence_of(cu, N, T, t);
      t0 = bound(cu, n, T);
      t1 = bound(cu, n + 1, T);
    }
    const bool inside = t0 <= t && t < t1;  // false only for malformed cu_seqlens
    const int64_t p = t - t0;               // position of t in its sequence (>= 0 when inside)
    for (int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; c < D;
         c += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      if (!inside) {
        y[t * D + c] = __int_as_float(0x7fc00000);  // quiet NaN
        continue;
      }
      const float* s = state != nullptr ? state + (n * D + c) * (W - 1) : nullptr;
      float z = bias != nullptr ? bias[c] : 0.0f;
      for (int i = 0; i < W; ++i) {
        const int64_t q = p - (W - 1) + i;  // sequence position of input i, >= -(W - 1)
        const float v = q >= 0 ? x[(t0 + q) * D + c] : (s != nullptr ? s[q + W - 1] : 0.0f);
        z = __fadd_rn(z, __fmul_rn(weight[c * W + i], v));  // the CPU op's roundings, no FMA
      }
      y[t * D + c] = silu ? z / (1.0f + expf(-z)) : z;
    }
  }
}

// After conv_output_kernel: conv_state[n, c, :] = the last W - 1 inputs of sequence n (its tokens,
// preceded by the old state when it has fewer than W - 1). Entry j takes the input at sequence
// position len - (W - 1) + j: x when >= 0, else the old entry len + j (>= j). Ascending j writes
// entry j only after every read of an entry <= j, so the update is in place.
__global__ void conv_state_kernel(const float* __restrict__ x,     // [T, D]
                                  const int64_t* __restrict__ cu,  // [N + 1] or null
                                  int64_t T, int64_t D, int W, int64_t N,
                                  float* state) {                  // [N, D, W - 1]
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < N * D;
       u += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = u / D, c = u % D;
    int64_t t0 = 0, t1 = T;
    if (cu != nullptr) {
      t0 = bound(cu, n, T);
      t1 = bound(cu, n + 1, T);
    }
    const int64_t len = t1 > t0 ? t1 - t0 : 0;  // a reversed (malformed) sequence is empty
    float* s = state + u * (W - 1);
    for (int j = 0; j < W - 1; ++j) {
      const int64_t q = len - (W - 1) + j;
      s[j] = q >= 0 ? x[(t0 + q) * D + c] : s[len + j];
    }
  }
}

__global__ void gated_rmsnorm_kernel(const float* __restrict__ x,       // [rows, D]
                                     const float* __restrict__ gate,    // [rows, D]
                                     const float* __restrict__ weight,  // [D]
                                     int64_t rows, int64_t D, float eps,
                                     float* __restrict__ y) {           // [rows, D]
  const unsigned lane = threadIdx.x % 32, warps_per_block = blockDim.x / 32;
  // r is the same for the 32 lanes of a warp: the shuffles below see full warps.
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * warps_per_block + threadIdx.x / 32; r < rows;
       r += static_cast<int64_t>(gridDim.x) * warps_per_block) {
    const float* xr = x + r * D;
    float ss = 0.0f;
    for (int64_t j = lane; j < D; j += 32) ss = __fmaf_rn(xr[j], xr[j], ss);
    for (int off = 16; off > 0; off >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, off));
    const float inv = 1.0f / sqrtf(__fadd_rn(ss / static_cast<float>(D), eps));
    for (int64_t j = lane; j < D; j += 32) {
      y[r * D + j] = xr[j] * inv * weight[j] / (1.0f + expf(-gate[r * D + j]));
    }
  }
}

Status prefixed(const char* op, Status st) {
  if (st.is_ok()) return st;
  return {st.code(), std::string(op) + ": " + st.message()};
}

// Device buffer holding a copy of a host span (nothing for an empty one).
template <typename T>
Status to_device(std::span<const T> host, detail::DeviceBuffer<T>& dev, const char* what) {
  K3_RETURN_IF_ERROR(dev.allocate(host.size()));
  if (host.empty()) return Status::ok();
  return detail::from_cuda(cudaMemcpy(dev.get(), host.data(), host.size_bytes(), cudaMemcpyHostToDevice), what);
}

// The device kernels keep the state as W - 1 entries per channel (fla's layout); a longer state
// (transformers' cache, state_len = W) is a CPU feature.
Status cuda_state_len(const kda::ConvArgs& a) {
  if (a.state_len == 0 || a.state_len == a.width - 1) return Status::ok();
  return invalid_argument("state_len = " + std::to_string(a.state_len) + " is not supported on CUDA (only W - 1 = " +
                          std::to_string(a.width - 1) + ", or 0)");
}

}  // namespace

Status causal_conv1d(const kda::ConvArgs& a, void* stream) {
  int64_t T = 0, N = 0;
  K3_RETURN_IF_ERROR(prefixed("cuda::causal_conv1d", kda::detail::validate_conv_sizes(a, &T, &N)));
  K3_RETURN_IF_ERROR(prefixed("cuda::causal_conv1d", cuda_state_len(a)));
  if (T == 0) return Status::ok();  // no output, every sequence is empty: conv_state stays as it is
  const int64_t D = a.channels;
  const int W = static_cast<int>(a.width);
  const int64_t* cu = a.cu_seqlens.empty() ? nullptr : a.cu_seqlens.data();
  const auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(std::min(T, kMaxGridX)),
                  static_cast<unsigned>(std::min((D + kConvThreads - 1) / kConvThreads, kMaxGridY)));
  conv_output_kernel<<<grid, kConvThreads, 0, s>>>(a.x.data(), a.weight.data(), a.bias.empty() ? nullptr : a.bias.data(),
                                                   cu, a.conv_state.empty() ? nullptr : a.conv_state.data(), T, D, W, N,
                                                   a.silu, a.y.data());
  K3_CUDA_TRY(cudaGetLastError(), "cuda::causal_conv1d: conv_output_kernel launch");
  if (a.conv_state.empty()) return Status::ok();
  const int64_t blocks = std::min((N * D + kStateThreads - 1) / kStateThreads, kMaxGridX);
  conv_state_kernel<<<static_cast<unsigned>(blocks), kStateThreads, 0, s>>>(a.x.data(), cu, T, D, W, N,
                                                                            a.conv_state.data());
  return detail::from_cuda(cudaGetLastError(), "cuda::causal_conv1d: conv_state_kernel launch");
}

Status gated_rmsnorm(const kda::GatedRmsNormArgs& a, void* stream) {
  int64_t rows = 0;
  K3_RETURN_IF_ERROR(prefixed("cuda::gated_rmsnorm", kda::detail::validate_rmsnorm(a, &rows)));
  if (rows == 0) return Status::ok();
  const int64_t rows_per_block = kNormThreads / 32;
  const int64_t blocks = std::min((rows + rows_per_block - 1) / rows_per_block, kMaxGridX);
  gated_rmsnorm_kernel<<<static_cast<unsigned>(blocks), kNormThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      a.x.data(), a.gate.data(), a.weight.data(), rows, a.dim, a.eps, a.y.data());
  return detail::from_cuda(cudaGetLastError(), "cuda::gated_rmsnorm: gated_rmsnorm_kernel launch");
}

Status causal_conv1d_host(const kda::ConvArgs& a) {
  int64_t T = 0, N = 0;
  K3_RETURN_IF_ERROR(prefixed("cuda::causal_conv1d_host", kda::detail::validate_conv(a, &T, &N)));
  K3_RETURN_IF_ERROR(prefixed("cuda::causal_conv1d_host", cuda_state_len(a)));
  K3_RETURN_IF_ERROR(detail::require_device());
  if (T == 0) return Status::ok();
  detail::DeviceBuffer<float> dx, dw, db, ds, dy;
  detail::DeviceBuffer<int64_t> dcu;
  K3_RETURN_IF_ERROR(to_device(a.x, dx, "copy x"));
  K3_RETURN_IF_ERROR(to_device(a.weight, dw, "copy weight"));
  K3_RETURN_IF_ERROR(to_device(a.bias, db, "copy bias"));
  K3_RETURN_IF_ERROR(to_device(a.cu_seqlens, dcu, "copy cu_seqlens"));
  K3_RETURN_IF_ERROR(to_device(std::span<const float>(a.conv_state), ds, "copy conv_state"));
  K3_RETURN_IF_ERROR(dy.allocate(a.y.size()));
  kda::ConvArgs d = a;
  d.x = {dx.get(), a.x.size()};
  d.weight = {dw.get(), a.weight.size()};
  d.bias = {db.get(), a.bias.size()};
  d.cu_seqlens = {dcu.get(), a.cu_seqlens.size()};
  d.conv_state = {ds.get(), a.conv_state.size()};
  d.y = {dy.get(), a.y.size()};
  K3_RETURN_IF_ERROR(causal_conv1d(d, nullptr));
  K3_CUDA_TRY(cudaDeviceSynchronize(), "cuda::causal_conv1d_host: run");
  K3_CUDA_TRY(cudaMemcpy(a.y.data(), dy.get(), a.y.size_bytes(), cudaMemcpyDeviceToHost), "copy y");
  if (!a.conv_state.empty()) {
    K3_CUDA_TRY(cudaMemcpy(a.conv_state.data(), ds.get(), a.conv_state.size_bytes(), cudaMemcpyDeviceToHost),
                "copy conv_state");
  }
  return Status::ok();
}

Status gated_rmsnorm_host(const kda::GatedRmsNormArgs& a) {
  int64_t rows = 0;
  K3_RETURN_IF_ERROR(prefixed("cuda::gated_rmsnorm_host", kda::detail::validate_rmsnorm(a, &rows)));
  K3_RETURN_IF_ERROR(detail::require_device());
  if (rows == 0) return Status::ok();
  detail::DeviceBuffer<float> dx, dg, dw, dy;
  K3_RETURN_IF_ERROR(to_device(a.x, dx, "copy x"));
  K3_RETURN_IF_ERROR(to_device(a.gate, dg, "copy gate"));
  K3_RETURN_IF_ERROR(to_device(a.weight, dw, "copy weight"));
  K3_RETURN_IF_ERROR(dy.allocate(a.y.size()));
  kda::GatedRmsNormArgs d = a;
  d.x = {dx.get(), a.x.size()};
  d.gate = {dg.get(), a.gate.size()};
  d.weight = {dw.get(), a.weight.size()};
  d.y = {dy.get(), a.y.size()};
  K3_RETURN_IF_ERROR(gated_rmsnorm(d, nullptr));
  K3_CUDA_TRY(cudaDeviceSynchronize(), "cuda::gated_rmsnorm_host: run");
  K3_CUDA_TRY(cudaMemcpy(a.y.data(), dy.get(), a.y.size_bytes(), cudaMemcpyDeviceToHost), "copy y");
  return Status::ok();
}

}  // namespace k3::cuda
