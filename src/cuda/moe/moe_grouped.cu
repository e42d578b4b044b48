// Kernels of grouped-GEMM MoE paths that need no CUTLASS (moe_grouped.cuh): the row gather in
// front of a TMA-fed GEMM and the activation over GEMM1's FP32 rows. Ran on an H200 (2026-12-04).
//
// Both are plain, grid-strided and correctness-first: the activation kernel gives one thread one
// (row, 32-column block), reads its 2 x 128 contiguous bytes of gate / up itself (twice for W4A8)
// and writes 2-byte values (no local arrays: ptxas forbids local memory here). It is the
// extra FP32 round trip a fused GEMM1 epilogue would remove (docs/cuda_moe.md).
#include "cuda/moe/moe_grouped.cuh"

namespace k3::cuda::moe_detail {

#if defined(K3_HAVE_CUTLASS)
bool sm90_grouped_built() { return true; }
#else
// Without CUTLASS the plan refuses prefill-sm90 (DeviceCaps::has_sm90_grouped is false); these
// stubs keep run() linkable and say why if reached anyway.
bool sm90_grouped_built() { return false; }
size_t sm90_group_arrays_bytes(int) { return 0; }
size_t sm90_cutlass_workspace_bytes(int) { return 0; }
Status launch_sm90_gemm1(const Sm90GroupedIo&, cudaStream_t) {
  return unsupported("the prefill-sm90 path is not in this build; rebuild after scripts/setup.sh fetched CUTLASS");
}
Status launch_sm90_gemm2(const Sm90GroupedIo&, cudaStream_t) {
  return unsupported("the prefill-sm90 path is not in this build; rebuild after scripts/setup.sh fetched CUTLASS");
}
#endif

namespace {

constexpr int kGroupedThreads = 256;

// One thread per 16 bytes (8 BF16) of a permuted row.
__global__ void gather_rows_kernel(Dims d, const int32_t* __restrict__ row_token, const uint16_t* __restrict__ x,
                                   uint16_t* __restrict__ xg) {
  const int64_t per_row = d.k / 8;
  const int64_t total = d.max_tiles * d.block_m * per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t row = i / per_row, part = i % per_row;
    const int32_t token = row_token[row];
    if (token < 0) continue;  // padding: the GEMM's group ends at the expert's count
    const uint4 v = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(token) * d.k)[part];
    reinterpret_cast<uint4*>(xg + row * d.k)[part] = v;
  }
}

// One thread per (permuted row, 32-column block of N).
__global__ void grouped_act_kernel(Dims d, Recipe recipe, ActParams p, const int32_t* __restrict__ row_token,
                                   const int32_t* __restrict__ tile_expert, const float* __restrict__ h,
                                   uint16_t* __restrict__ act, int* __restrict__ status) {
  const int64_t per_row = d.n / kMxBlock;
  const int64_t total = d.max_tiles * d.block_m * per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  bool exact = true;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t row = i / per_row, blk = i % per_row;
    if (row_token[row] < 0) continue;  // padding rows hold no GEMM1 output
    const int expert = tile_expert[row / d.block_m];
    const bool situ = p.kind == ActivationKind::kSiTU;
    const float b = situ ? p.situ_beta[expert] : 1.0f, lb = situ ? p.situ_linear_beta[expert] : 1.0f;
    const float* hr = h + row * 2 * d.n + blk * kMxBlock;
    exact = grouped_act_block(recipe, p.kind, p.swiglu_alpha, p.swiglu_beta, p.swiglu_limit, b, lb, hr, hr + d.n,
                              act + row * d.n + blk * kMxBlock) &&
            exact;  // moe_grouped.hpp (host-tested)
  }
  if (!exact) atomicOr(status, kStatusInexactAct);
}

uint32_t grid_for(int64_t items) {
  return grid_dim((items + kGroupedThreads - 1) / kGroupedThreads, kMaxGridX);
}

}  // namespace

void launch_gather_rows(const Dims& d, const int32_t* row_token, const uint16_t* x_bf16, uint16_t* xg,
                        cudaStream_t s) {
  gather_rows_kernel<<<grid_for(d.max_tiles * d.block_m * (d.k / 8)), kGroupedThreads, 0, s>>>(d, row_token, x_bf16,
                                                                                                 xg);
}

void launch_grouped_act(const Dims& d, Recipe recipe, const ActParams& act, const int32_t* row_token,
                        const int32_t* tile_expert, const float* h, uint16_t* act_out, int* status, cudaStream_t s) {
  grouped_act_kernel<<<grid_for(d.max_tiles * d.block_m * (d.n / kMxBlock)), kGroupedThreads, 0, s>>>(
      d, recipe, act, row_token, tile_expert, h, act_out, status);
}

}  // namespace k3::cuda::moe_detail
