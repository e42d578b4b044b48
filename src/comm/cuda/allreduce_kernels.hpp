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

// The RMSNorm epilogue alone (the kernel launch_allreduce_rows uses with `norm`): for each of
// `rows` rows, out = RMSNorm(res) * gamma with the CPU all-reduce's operations. The one-shot IPC
// all-reduce (ipc_allreduce.cu) calls it after writing residual_out.
cudaError_t launch_rmsnorm_rows(const uint16_t* res, const uint16_t* gamma, int64_t rows, int64_t cols, float eps,
                                uint16_t* out, cudaStream_t stream);

}  // namespace k3::comm::detail
