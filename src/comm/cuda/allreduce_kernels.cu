// The kernels of the device TP all-reduce (k3/comm_nccl.hpp). Ran at world size 1 on an H200 (2026-12-04); never across GPUs.
#include "comm/cuda/allreduce_kernels.hpp"
#include "comm/ops/exact_sum.hpp"
#include "k3/formats.hpp"

namespace k3::comm::detail {
namespace {

// recv: W planes of [mine, cols] BF16 (plane q from rank q). One thread per element: the exact
// sum (exact_sum.hpp, the CPU's definition), then the element-wise epilogue.
__global__ void reduce_kernel(const uint16_t* recv, int w, int64_t mine, int64_t cols, const uint16_t* residual,
                              bool norm, uint16_t* out_stage, uint16_t* res_stage) {
  const int64_t n = mine * cols;
  const int64_t plane = n;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float sum = exact_sum_bf16(recv + i, plane, w);
    if (!norm) {
      out_stage[i] = bf16_from_f32(sum);
    } else {
      // __fadd_rn: one IEEE FP32 addition (never contracted), as on the CPU.
      res_stage[i] = bf16_from_f32(residual != nullptr ? __fadd_rn(sum, bf16_to_f32(residual[i])) : sum);
    }
  }
}

// One block per row: the FP64 sum of squares in column order (a serial chain by contract: one
// thread), then the scaled output. __dmul_rn / __dadd_rn keep every step an IEEE operation.
__global__ void rmsnorm_kernel(const uint16_t* res_stage, const uint16_t* gamma, int64_t cols, float eps,
                               uint16_t* out_stage) {
  __shared__ double rstd;
  const uint16_t* ro = res_stage + blockIdx.x * cols;
  if (threadIdx.x == 0) {
    double acc = 0.0;
    for (int64_t j = 0; j < cols; ++j) {
      const double r = static_cast<double>(bf16_to_f32(ro[j]));
      acc = __dadd_rn(acc, __dmul_rn(r, r));
    }
    rstd = 1.0 / sqrt(__dadd_rn(acc / static_cast<double>(cols), static_cast<double>(eps)));
  }
  __syncthreads();
  uint16_t* o = out_stage + blockIdx.x * cols;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const double y = __dmul_rn(__dmul_rn(static_cast<double>(bf16_to_f32(ro[j])), rstd),
                               static_cast<double>(bf16_to_f32(gamma[j])));
    o[j] = bf16_from_f32(f32_from_f64(y));
  }
}

}  // namespace

cudaError_t launch_allreduce_rows(const uint16_t* recv, int w, int64_t mine, int64_t cols, const uint16_t* residual,
                                  bool norm, const uint16_t* gamma, float eps, uint16_t* out_stage, uint16_t* res_stage,
                                  cudaStream_t stream) {
  const int64_t n = mine * cols;
  if (n == 0) return cudaSuccess;
  const int blocks = static_cast<int>((n + 255) / 256 < 65535 ? (n + 255) / 256 : 65535);
  reduce_kernel<<<blocks, 256, 0, stream>>>(recv, w, mine, cols, residual, norm, out_stage, res_stage);
  if (norm) rmsnorm_kernel<<<static_cast<unsigned>(mine), 256, 0, stream>>>(res_stage, gamma, cols, eps, out_stage);
  return cudaGetLastError();
}

cudaError_t launch_rmsnorm_rows(const uint16_t* res, const uint16_t* gamma, int64_t rows, int64_t cols, float eps,
                                uint16_t* out, cudaStream_t stream) {
  if (rows * cols == 0) return cudaSuccess;
  rmsnorm_kernel<<<static_cast<unsigned>(rows), 256, 0, stream>>>(res, gamma, cols, eps, out);
  return cudaGetLastError();
}

}  // namespace k3::comm::detail
