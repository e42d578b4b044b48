// prep_x and the stable counting sort of token-slots by local expert.
// Ran on an H200 (sm_90, 2026-12-04); never on sm_120.
//
// The sort is deterministic and stable (slot order preserved within each expert) without any
// order-dependent atomics: shared-memory atomics only count; ranks come from warp match masks
// and a fixed warp order.
#include "cuda/moe/moe_kernels.cuh"
#include "k3/mx.hpp"

namespace k3::cuda::moe_detail {
namespace {

// One thread per (token, 32-element block of K), grid-stride over the live blocks.
__global__ void prep_x_kernel(Dims d, Recipe recipe, const int32_t* __restrict__ m_ptr,
                              const uint16_t* __restrict__ x,  // [M, K] BF16
                              uint16_t* __restrict__ x_bf16,   // [M, K] BF16 operand
                              int* __restrict__ status) {
  const int64_t nblk = d.k / kMxBlock;
  const int64_t live = clamp_tokens(*m_ptr, d.max_m) * nblk;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  bool exact = true;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < live; i += stride) {
    const uint16_t* src = x + i * kMxBlock;
    uint16_t* dst = x_bf16 + i * kMxBlock;
    if (recipe == Recipe::kW4A16) {
      for (int j = 0; j < kMxBlock; ++j) dst[j] = src[j];
    } else {
      exact = w4a8_prep_block(src, dst) && exact;  // moe_shared.hpp (host-tested)
    }
  }
  if (!exact) atomicOr(status, kStatusInexactX);
}

// Local expert of a token-slot, or -1 (masked, remote, or past the real M).
__device__ int local_expert(const Dims& d, const int32_t* ids, int64_t slot, int64_t live_slots) {
  if (slot >= live_slots) return -1;
  const int e = ids[slot] - d.first_local;
  return (e >= 0 && e < d.e_local) ? e : -1;
}

// grid = chunks, block = 256; smem = e_local ints.
__global__ void slot_hist_kernel(Dims d, const int32_t* __restrict__ m_ptr, const int32_t* __restrict__ ids,
                                 int32_t* __restrict__ chunk_hist) {  // [E_local, chunks]
  extern __shared__ int32_t hist[];
  for (int e = threadIdx.x; e < d.e_local; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t live = clamp_tokens(*m_ptr, d.max_m) * d.top_k;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * d.chunk;
  for (int i = threadIdx.x; i < d.chunk; i += blockDim.x) {
    const int e = local_expert(d, ids, base + i, live);
    if (e >= 0) atomicAdd(&hist[e], 1);  // counting only: the order of additions cannot matter
  }
  __syncthreads();
  for (int e = threadIdx.x; e < d.e_local; e += blockDim.x) chunk_hist[static_cast<int64_t>(e) * d.chunks + blockIdx.x] = hist[e];
}

// Single block of 1024 threads. counts: [E_local] rows, then [E_local] padded start row.
__global__ void slot_scan_kernel(Dims d, int32_t* __restrict__ chunk_hist, int32_t* __restrict__ counts,
                                 int32_t* __restrict__ tile_expert,  // [max_tiles]
                                 int32_t* __restrict__ row_token) {  // [max_tiles * block_m]
  int32_t* start = counts + d.e_local;
  for (int e = threadIdx.x; e < d.e_local; e += blockDim.x) {
    int32_t run = 0;
    int32_t* h = chunk_hist + static_cast<int64_t>(e) * d.chunks;
    for (int b = 0; b < d.chunks; ++b) {
      const int32_t c = h[b];
      h[b] = run;  // exclusive prefix within the expert
      run += c;
    }
    counts[e] = run;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t off = 0;
    for (int e = 0; e < d.e_local; ++e) {
      start[e] = off;
      off += (counts[e] + d.block_m - 1) / d.block_m * d.block_m;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < d.e_local; e += blockDim.x) {
    int32_t* h = chunk_hist + static_cast<int64_t>(e) * d.chunks;
    for (int b = 0; b < d.chunks; ++b) h[b] += start[e];
  }
  for (int64_t t = threadIdx.x; t < d.max_tiles; t += blockDim.x) tile_expert[t] = -1;
  for (int64_t r = threadIdx.x; r < d.max_tiles * d.block_m; r += blockDim.x) row_token[r] = -1;
  __syncthreads();
  for (int e = threadIdx.x; e < d.e_local; e += blockDim.x) {
    const int32_t first_tile = start[e] / d.block_m;
    const int32_t tiles = (counts[e] + d.block_m - 1) / d.block_m;
    for (int32_t t = 0; t < tiles; ++t) tile_expert[first_tile + t] = e;
  }
}

// grid = chunks, block = 1024 (= chunk: one slot per thread); smem = e_local ints.
__global__ void slot_scatter_kernel(Dims d, const int32_t* __restrict__ m_ptr, const int32_t* __restrict__ ids,
                                    const int32_t* __restrict__ chunk_hist, int32_t* __restrict__ row_token,
                                    int32_t* __restrict__ slot_row) {  // [max_slots]
  extern __shared__ int32_t base[];
  for (int e = threadIdx.x; e < d.e_local; e += blockDim.x) {
    base[e] = chunk_hist[static_cast<int64_t>(e) * d.chunks + blockIdx.x];
  }
  __syncthreads();
  const int64_t live = clamp_tokens(*m_ptr, d.max_m) * d.top_k;
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * d.chunk + threadIdx.x;
  const int e = local_expert(d, ids, slot, live);
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const unsigned peers = __match_any_sync(0xFFFFFFFFu, e);
  const int rank = __popc(peers & ((1u << lane) - 1u));
  const int group = __popc(peers);
  // Warps take their turn in index order, so rows follow slot order within every expert.
  for (unsigned w = 0; w < blockDim.x / 32; ++w) {
    int32_t row = -1;
    if (warp == w && e >= 0) row = base[e] + rank;
    __syncwarp();
    if (warp == w && e >= 0 && rank == 0) base[e] += group;
    if (warp == w && slot < d.max_slots) {
      slot_row[slot] = row;
      if (row >= 0) row_token[row] = static_cast<int32_t>(slot / d.top_k);
    }
    __syncthreads();
  }
}

}  // namespace

void launch_prep_x(const Dims& d, Recipe recipe, const int32_t* m, const uint16_t* x, uint16_t* x_bf16, int* status,
                   cudaStream_t s) {
  const Grid g = prep_grid(d);
  prep_x_kernel<<<g.x, kPrepThreads, 0, s>>>(d, recipe, m, x, x_bf16, status);
}

void launch_sort(const Dims& d, const int32_t* m, const int32_t* topk_ids, int32_t* chunk_hist, int32_t* counts,
                 int32_t* tile_expert, int32_t* row_token, int32_t* slot_row, cudaStream_t s) {
  const size_t smem = static_cast<size_t>(d.e_local) * sizeof(int32_t);
  slot_hist_kernel<<<d.chunks, 256, smem, s>>>(d, m, topk_ids, chunk_hist);
  slot_scan_kernel<<<1, 1024, 0, s>>>(d, chunk_hist, counts, tile_expert, row_token);
  slot_scatter_kernel<<<d.chunks, d.chunk, smem, s>>>(d, m, topk_ids, chunk_hist, row_token, slot_row);
}

}  // namespace k3::cuda::moe_detail
