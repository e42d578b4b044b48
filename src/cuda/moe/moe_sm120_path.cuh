// The w4a8-sm120-cutlass path of the CUDA fused MoE (MoePath::kW4a8Sm120Cutlass): the CUTLASS
// sm_120a block-scaled grouped GEMM (src/cuda_cutlass/moe_sm120_blockscaled.cuh) wired between
// the stable sort and the finalize. NEVER RUN ON ANY GPU: no sm_120 machine exists where k3 is
// developed. Forced only (MoeOptions::path); the plan never picks it.
//
// After the sort (moe_kernels.cuh):
//   gather_compact  x rows (BF16 -> FP32, exact) into compact expert order: expert e's rows from
//                   GEMM1's compact_start[e], in the sort's row order
//   GEMM1           quantize_a (MXFP8, RCEIL: the W4A8 x quantization) + grouped block-scaled GEMM
//                   with [gate; up] -> FP32 [rows, 2N] at GEMM1's padded_start[e]
//   act_compact     the shared activation_f32 on FP32 gate / up -> FP32 compact rows [.., N]
//   GEMM2           quantize_a (the W4A8 activation re-quantization) + GEMM with FC2 -> FP32 [rows, K]
//   scatter_y       GEMM2's rows -> y at the sort's permuted rows (workspace ws_y), so finalize, the
//                   slot -> row map and the EP seam are those of every other path
// Both GEMMs are given the same counts, so their row placements are the same.
//
// Its scratch (compact rows, MXFP8 operands, GEMM outputs, CUTLASS's per-group arrays) lives in
// the DeviceWeights, sized for max_tokens x top_k rows at prepack: a DeviceWeights of this path
// serves one stream at a time.
#pragma once

#include <cuda_runtime.h>

#include <memory>

#include "cuda/moe/moe_kernels.cuh"
#include "k3/cuda_moe.hpp"
#include "k3/status.hpp"

namespace k3::cuda::moe_detail {

struct Sm120PathState;
struct Sm120PathDeleter {
  void operator()(Sm120PathState* s) const;
};
using Sm120Path = std::unique_ptr<Sm120PathState, Sm120PathDeleter>;

// Re-lays out the weights for CUTLASS (codes unchanged, scales in its scale-factor layout),
// allocates the scratch and builds both GEMMs on the current device (must be sm_120).
// kUnsupported in builds without the CUTLASS headers.
Result<Sm120Path> sm120_path_prepack(const MoePlan& plan, const MoeWeightsView& w);

// Enqueues gather -> GEMM1 -> activation -> GEMM2 -> scatter on `s` after the sort: `counts` is
// the sort's [E_local] rows then [E_local] padded offsets; y the workspace's FP32 rows.
Status sm120_path_run(const MoePlan& plan, const Sm120PathState& st, const ActParams& act, const uint16_t* x,
                      const int32_t* counts, const int32_t* row_token, const int32_t* tile_expert, float* y,
                      cudaStream_t s);

}  // namespace k3::cuda::moe_detail
