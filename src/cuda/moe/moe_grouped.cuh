// The sm_90a grouped prefill path (MoePath::kPrefillSm90): kernels shared by grouped-GEMM paths
// (moe_grouped.cu) and the CUTLASS grouped GEMMs (src/cuda_cutlass/moe_sm90_grouped.cu, built only
// when CMake found the CUTLASS headers: K3_HAVE_CUTLASS). Ran on an H200 (2026-12-04).
//
// Pipeline after prep_x and the sort (moe_kernels.cuh):
//   gather_rows   x_bf16 rows -> expert-contiguous operand rows xg (TMA cannot gather)
//   sm90 GEMM1    per local expert: h^T = [gate; up] x xg^T -> FP32 h rows [rows, 2N]
//   grouped_act   h -> activation (+ W4A8 MXFP8 re-quantization) -> BF16 act rows [rows, N]
//   sm90 GEMM2    per local expert: y^T = FC2 x act^T -> FP32 y rows [rows, K] (the rows the
//                 sort's slot -> row map names, so finalize and the EP seam are unchanged)
// The per-group shapes / pointers / strides are written on the device from the sort's counts
// (no host read of M), so the whole path is capturable in a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/moe/moe_grouped.hpp"
#include "cuda/moe/moe_kernels.cuh"
#include "k3/status.hpp"

namespace k3::cuda::moe_detail {

// xg[r] = x_bf16[row_token[r]] for every permuted row r with a token (padding rows untouched).
void launch_gather_rows(const Dims& d, const int32_t* row_token, const uint16_t* x_bf16, uint16_t* xg,
                        cudaStream_t s);

// act[r, c] for every permuted row r with a token: grouped_act_block over h[r, c] (gate) and
// h[r, N + c] (up); W4A8 values BF16 does not hold as normal numbers set kStatusInexactAct.
void launch_grouped_act(const Dims& d, Recipe recipe, const ActParams& act, const int32_t* row_token,
                        const int32_t* tile_expert, const float* h, uint16_t* act_out, int* status, cudaStream_t s);

// ---- the CUTLASS part (src/cuda_cutlass/moe_sm90_grouped.cu; without CUTLASS, moe_grouped.cu's
// stubs return kUnsupported) ----

struct Sm90GroupedIo {
  Dims d;
  int sm_count = 0;                  // the persistent grid (the plan's device)
  const int32_t* counts = nullptr;   // the sort's [E_local] rows, then [E_local] padded first rows
  const uint8_t* fc1_w = nullptr;    // [E_local, 2N, K] E4M3 (sm90_encode_row)
  const uint16_t* fc1_s = nullptr;   // [E_local, ceil(K/64), 2N] BF16 group scales (MN-major)
  const uint8_t* fc2_w = nullptr;    // [E_local, K, N] E4M3
  const uint16_t* fc2_s = nullptr;   // [E_local, ceil(N/64), K] BF16
  const uint16_t* xg = nullptr;      // [rows, K] BF16 gathered operand rows
  float* h = nullptr;                // [rows, 2N] FP32 GEMM1 output
  const uint16_t* act = nullptr;     // [rows, N] BF16 GEMM2 operand
  float* y = nullptr;                // [rows, K] FP32 GEMM2 output
  void* arrays = nullptr;            // per-group shapes / pointers / strides of both GEMMs
  size_t arrays_bytes = 0;
  void* cutlass_ws = nullptr;        // CUTLASS's own workspace (TMA descriptors per SM), both GEMMs
  size_t cutlass_ws_bytes = 0;
};

// sm90_grouped_built, sm90_group_arrays_bytes, sm90_cutlass_workspace_bytes: moe_grouped.hpp.
// Builds the group arrays on the device and enqueues GEMM1; then GEMM2 (after the caller's
// activation kernel). No allocation, no synchronization; errors name the limit.
Status launch_sm90_gemm1(const Sm90GroupedIo& io, cudaStream_t s);
Status launch_sm90_gemm2(const Sm90GroupedIo& io, cudaStream_t s);

}  // namespace k3::cuda::moe_detail
