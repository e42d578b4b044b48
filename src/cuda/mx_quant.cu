// MX quantize / dequantize on the GPU. One thread per 32-element block; the math is the shared
// constexpr codec of k3/mx.hpp, so results are bit-identical to the host. Plain global loads:
// this kernel is a correctness anchor for the CUDA build, not a tuned kernel.
// Supports: MXFP4 and MXFP8, RCEIL and FLOOR, linear scale layout. Architecture-independent
// (compiled for every entry of K3_CUDA_ARCHS).
#include "cuda/common.cuh"
#include "k3/cuda.hpp"

namespace k3::cuda {
using detail::grid_for;
using detail::require_device;

namespace {

__global__ void mx_quantize_kernel(const float* __restrict__ x,  // [rows, cols]
                                   int64_t rows, int64_t cols, MxElement e, ScaleRule rule,
                                   uint8_t* __restrict__ q,        // [rows, row_bytes]
                                   uint8_t* __restrict__ scales) {  // [rows, cols/32]
  const int64_t nblk = cols / kMxBlock;
  const int64_t blk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (blk >= rows * nblk) return;
  const int64_t r = blk / nblk, b = blk % nblk;
  const float* src = x + r * cols + b * kMxBlock;
  // Two passes over the block straight from global memory: no per-thread arrays, so nothing
  // spills to local memory. Same decisions as mx_quantize_block (NaN block -> scale 0xFF).
  MxBlockAmax block;
  for (int i = 0; i < kMxBlock; ++i) block.add(src[i]);
  const uint8_t scale = block.scale_code(e, rule);
  scales[blk] = scale;
  if (e == MxElement::kE2M1) {
    uint8_t* dst = q + r * (cols / 2) + b * (kMxBlock / 2);
    for (int i = 0; i < kMxBlock; i += 2) {
      dst[i / 2] = fp4_pack(mx_encode_element(src[i], scale, e), mx_encode_element(src[i + 1], scale, e));
    }
  } else {
    uint8_t* dst = q + r * cols + b * kMxBlock;
    for (int i = 0; i < kMxBlock; ++i) dst[i] = mx_encode_element(src[i], scale, e);
  }
}

__global__ void mx_dequantize_kernel(const uint8_t* __restrict__ q, const uint8_t* __restrict__ scales,
                                     int64_t rows, int64_t cols, MxElement e, float* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  const int64_t r = i / cols, c = i % cols;
  uint8_t code;
  if (e == MxElement::kE2M1) {
    const uint8_t byte = q[r * (cols / 2) + c / 2];
    code = (c & 1) ? fp4_high(byte) : fp4_low(byte);
  } else {
    code = q[i];
  }
  out[i] = mx_decode_element(code, scales[r * (cols / kMxBlock) + c / kMxBlock], e);
}

}  // namespace

Status mx_quantize(std::span<const float> x, int64_t rows, int64_t cols, MxElement e, ScaleRule rule,
                   std::span<uint8_t> q, std::span<uint8_t> scales) {
  K3_RETURN_IF_ERROR(mx_check_shape(rows, cols, "cuda::mx_quantize"));
  if (static_cast<int64_t>(x.size()) < rows * cols || static_cast<int64_t>(q.size()) < rows * mx_row_bytes(e, cols) ||
      static_cast<int64_t>(scales.size()) < rows * mx_scale_cols(cols)) {
    return invalid_argument("cuda::mx_quantize: x, q or scales is smaller than the [rows, cols] shape requires");
  }
  K3_RETURN_IF_ERROR(require_device());
  if (rows == 0) return Status::ok();
  detail::DeviceBuffer<float> dx;
  detail::DeviceBuffer<uint8_t> dq, ds;
  const int64_t qn = rows * mx_row_bytes(e, cols), sn = rows * mx_scale_cols(cols);
  K3_RETURN_IF_ERROR(dx.allocate(rows * cols));
  K3_RETURN_IF_ERROR(dq.allocate(qn));
  K3_RETURN_IF_ERROR(ds.allocate(sn));
  K3_CUDA_TRY(cudaMemcpy(dx.get(), x.data(), rows * cols * sizeof(float), cudaMemcpyHostToDevice), "copy x");
  const unsigned block = 128;
  mx_quantize_kernel<<<grid_for(sn, block), block>>>(dx.get(), rows, cols, e, rule, dq.get(), ds.get());
  K3_CUDA_TRY(cudaGetLastError(), "mx_quantize_kernel launch");
  K3_CUDA_TRY(cudaMemcpy(q.data(), dq.get(), qn, cudaMemcpyDeviceToHost), "copy q");
  K3_CUDA_TRY(cudaMemcpy(scales.data(), ds.get(), sn, cudaMemcpyDeviceToHost), "copy scales");
  return Status::ok();
}

Status mx_dequantize(std::span<const uint8_t> q, std::span<const uint8_t> scales, int64_t rows, int64_t cols,
                     MxElement e, std::span<float> out) {
  K3_RETURN_IF_ERROR(mx_check_shape(rows, cols, "cuda::mx_dequantize"));
  const int64_t qn = rows * mx_row_bytes(e, cols), sn = rows * mx_scale_cols(cols);
  if (static_cast<int64_t>(q.size()) < qn || static_cast<int64_t>(scales.size()) < sn ||
      static_cast<int64_t>(out.size()) < rows * cols) {
    return invalid_argument("cuda::mx_dequantize: q, scales or out is smaller than the [rows, cols] shape requires");
  }
  K3_RETURN_IF_ERROR(require_device());
  if (rows == 0) return Status::ok();
  detail::DeviceBuffer<uint8_t> dq, ds;
  detail::DeviceBuffer<float> dout;
  K3_RETURN_IF_ERROR(dq.allocate(qn));
  K3_RETURN_IF_ERROR(ds.allocate(sn));
  K3_RETURN_IF_ERROR(dout.allocate(rows * cols));
  K3_CUDA_TRY(cudaMemcpy(dq.get(), q.data(), qn, cudaMemcpyHostToDevice), "copy q");
  K3_CUDA_TRY(cudaMemcpy(ds.get(), scales.data(), sn, cudaMemcpyHostToDevice), "copy scales");
  const unsigned block = 256;
  mx_dequantize_kernel<<<grid_for(rows * cols, block), block>>>(dq.get(), ds.get(), rows, cols, e, dout.get());
  K3_CUDA_TRY(cudaGetLastError(), "mx_dequantize_kernel launch");
  K3_CUDA_TRY(cudaMemcpy(out.data(), dout.get(), rows * cols * sizeof(float), cudaMemcpyDeviceToHost), "copy out");
  return Status::ok();
}

}  // namespace k3::cuda
