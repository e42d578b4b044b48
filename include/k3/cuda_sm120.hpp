// k3/cuda_sm120.hpp — what this build contains for sm_120 (RTX 50-series / RTX PRO Blackwell)
// beyond the default kernels. No CUDA header; in a build without CUDA every answer is "no".
#pragma once

namespace k3::cuda {

// True when this build contains the CUTLASS sm_120a block-scaled grouped GEMM (MXFP8 activations x
// MXFP4 weights, UE8M0 scales, src/cuda_cutlass/moe_sm120_blockscaled.cu): the CUTLASS headers
// were present at build time and sm_120a is among the compiled architectures. It is an opt-in
// building block that has NEVER RUN ON A GPU (no sm_120 machine exists where k3 is developed).
bool has_sm120_blockscaled_gemm();

}  // namespace k3::cuda
