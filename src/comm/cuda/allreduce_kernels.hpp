// Kernels of the device TP all-reduce (k3/comm_nccl.hpp): the exact sum of W received planes
// of [mine, cols] BF16 rows (plane q from rank q) and the epilogue — out_stage = bf16(sum), or
// with `norm` res_stage = bf16(sum + residual) and out_stage = RMSNorm(res_stage) * gamma —
// with the bits of the CPU all-reduce (same exact-sum code, IEEE operations only).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace k3::comm::detail {

cudaError_t launch_allreduce_rows(const uint16_t* recv, int w, int64_t mine, int64_t cols, const uint16_t* residual,
                                  bool norm, const uint16_t* gamma, float eps, uint16_t* out_stage, uint16_t* res_stage,
                                  cudaStream_t stream);

}  // namespace k3::comm::detail
