// Kernels of the CUDA fused-MoE backend (declarations shared by the .cu files).
//
// Ran on an H200 (sm_90, 2026-12-04): the CUDA tests and k3 validate pass on every sm_90 path
// (docs/cuda_moe.md, "First GPU run"). Never run on sm_120.
//
// Pipeline (every launch has a fixed grid derived from the plan; the real M is read from device
// memory, so a captured graph replays for any M <= max_m):
//   prep_x        x -> BF16 operand (W4A8: MXFP8 quantize + exact dequantize; W4A16: copy)
//   slot_hist     per-chunk histogram of token-slots over local experts
//   slot_scan     per-expert counts, padding to block_m, expert offsets, tile -> expert map
//   slot_scatter  stable counting sort: (token, slot) -> permuted row; row -> token
//   moe_gemm<FC1> gathered x rows x [gate; up] MXFP4 -> activation -> MXFP8/BF16 act rows
//   moe_gemm<FC2> act rows x FC2 MXFP4 -> FP32 y rows
//   finalize      out[t] = sum_k w[t,k] * y[row(t,k)] in slot order, FP32, one rounding
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/moe/moe_shared.hpp"  // Dims, ActParams, status bits, geometry (host + device)
#include "k3/moe.hpp"
#include "k3/mx.hpp"

namespace k3::cuda::moe_detail {

// The tools' run-time knobs of run_host and the bench (never read by cuda::plan / run):
// K3_CUDA_MOE_PATH=<path name>; an unknown name is an error.
// options.path from a path name ("" leaves the plan's choice); the error names `path`.
Status apply_path_option(const std::string& name, MoeOptions& options);

void launch_prep_x(const Dims& d, Recipe recipe, const int32_t* m, const uint16_t* x, uint16_t* x_bf16, int* status,
                   cudaStream_t s);
void launch_sort(const Dims& d, const int32_t* m, const int32_t* topk_ids, int32_t* chunk_hist, int32_t* counts,
                 int32_t* tile_expert, int32_t* row_token, int32_t* slot_row, cudaStream_t s);
void launch_fc1(const Dims& d, int block_n, Recipe recipe, const ActParams& act, const uint16_t* x_bf16,
                const int32_t* row_token, const int32_t* tile_expert, const uint8_t* fc1_q, const uint8_t* fc1_scale,
                uint16_t* act_out, int* status, cudaStream_t s);
void launch_fc2(const Dims& d, int block_n, const uint16_t* act_in, const int32_t* tile_expert, const uint8_t* fc2_q,
                const uint8_t* fc2_scale, float* y, cudaStream_t s);
void launch_finalize(const Dims& d, OutDType dtype, const int32_t* m, const int32_t* slot_row,
                     const float* topk_weights, const float* y, void* out, cudaStream_t s);

}  // namespace k3::cuda::moe_detail

namespace k3::cuda::moe_detail {

// decode-splitk path (moe_gemm_splitk.cu): swap AB, split-K over the warps of a CTA, weights in the
// fragment-native layout of moe_pack.hpp, launched with programmatic dependent launch.
// Ran on an H200 (2026-12-04).
cudaError_t launch_fc1_splitk(const Dims& d, Recipe recipe, const ActParams& act, const uint16_t* x_bf16,
                              const int32_t* row_token, const int32_t* tile_expert, const uint8_t* fc1_pq,
                              const uint32_t* fc1_ps, uint16_t* act_out, int* status, cudaStream_t s);
cudaError_t launch_fc2_splitk(const Dims& d, const uint16_t* act_in, const int32_t* row_token,
                              const int32_t* tile_expert, const uint8_t* fc2_pq, const uint32_t* fc2_ps, float* y,
                              cudaStream_t s);

}  // namespace k3::cuda::moe_detail

namespace k3::cuda::moe_detail {

// D += A x B on the tensor cores: mma.sync.m16n8k16, BF16 inputs, FP32 accumulators (sm_80+,
// so one source serves sm_90a and sm_120a). a: the 4 A-fragment registers, b0 / b1: B's 2.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Merges the MX block accumulators of the 4 lanes of a quad (lanes 4q .. 4q+3 hold the 32 columns
// of one row in the mma.sync accumulator layout): every lane ends with the block's amax and NaN flag.
__device__ inline void quad_merge(MxBlockAmax& block) {
#pragma unroll
  for (int lane_mask = 1; lane_mask <= 2; lane_mask <<= 1) {
    const float other_amax = __shfl_xor_sync(0xFFFFFFFFu, block.amax, lane_mask);
    const int other_nan = __shfl_xor_sync(0xFFFFFFFFu, static_cast<int>(block.nan), lane_mask);
    block.merge(other_amax, other_nan != 0);
  }
}

}  // namespace k3::cuda::moe_detail
