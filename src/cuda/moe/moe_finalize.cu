// Deterministic finalize: out[t, c] = sum over slots k = 0..top_k-1 of w[t,k] * y[row(t,k), c],
// FP32 fused multiply-add in slot order, one rounding to the output dtype. Each output element is
// produced by one thread, so the result never depends on scheduling. Rows whose slots are all
// masked or remote come out as exact zeros. Rows are grid-strided (gridDim.y <= 65535 < the
// largest max_m, 65536), and the token count read from device memory is clamped to max_m.
// Ran on an H200 (sm_90, 2026-12-04).
#include "cuda/moe/moe_kernels.cuh"
#include "k3/formats.hpp"

namespace k3::cuda::moe_detail {
namespace {

__global__ void finalize_kernel(Dims d, OutDType dtype, const int32_t* __restrict__ m_ptr,
                                const int32_t* __restrict__ slot_row,       // [max_slots]
                                const float* __restrict__ topk_weights,     // [max_m, top_k]
                                const float* __restrict__ y,                // [rows, K]
                                void* __restrict__ out) {                   // [max_m, K]
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= d.k) return;
  const int64_t m = clamp_tokens(*m_ptr, d.max_m);
  for (int64_t t = blockIdx.y; t < m; t += gridDim.y) {
    float acc = 0.0f;
    for (int k = 0; k < d.top_k; ++k) {
      const int32_t row = slot_row[t * d.top_k + k];
      if (row >= 0) acc = __fmaf_rn(topk_weights[t * d.top_k + k], y[static_cast<int64_t>(row) * d.k + c], acc);
    }
    switch (dtype) {
      case OutDType::kFP32: static_cast<float*>(out)[t * d.k + c] = acc; break;
      case OutDType::kBF16: static_cast<uint16_t*>(out)[t * d.k + c] = bf16_from_f32(acc); break;
      case OutDType::kFP16: static_cast<uint16_t*>(out)[t * d.k + c] = fp16_from_f32(acc); break;
    }
  }
}

}  // namespace

void launch_finalize(const Dims& d, OutDType dtype, const int32_t* m, const int32_t* slot_row,
                     const float* topk_weights, const float* y, void* out, cudaStream_t s) {
  const Grid g = finalize_grid(d);
  finalize_kernel<<<dim3(g.x, g.y, g.z), kFinalizeThreads, 0, s>>>(d, dtype, m, slot_row, topk_weights, y, out);
}

}  // namespace k3::cuda::moe_detail
