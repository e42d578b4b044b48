// The arguments of the CUDA KDA kernels (device pointers and the configuration), shared by the
// recurrent and chunked kernels. Internal to src/cuda/kda.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "k3/cuda_kda.hpp"
#include "k3/formats.hpp"

namespace k3::cuda::kda_detail {

struct Launch {
  int heads = 0, dk = 0, dv = 0, warps = 0, rows = 0;
  kda::GateMode gate = kda::GateMode::kLogDecay;
  float lower_bound = 0.0f, scale = 1.0f;
  bool beta_logits = true, l2norm = true, kfirst = true;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  bool q_bf16 = false, k_bf16 = false, v_bf16 = false;
  const float* g = nullptr;
  const float* beta = nullptr;
  const float* a_log = nullptr;    // [H] (gated modes) or null
  const float* dt_bias = nullptr;  // [H, K] or null
  float* o = nullptr;              // [T, H, V]
  int64_t num_tokens = 0;          // T (prefill), N (decode), N * draft (verify)
  int64_t num_seqs = 0;            // N
  const int64_t* cu_seqlens = nullptr;  // prefill, [N + 1] or null (one sequence)
  const float* initial_state = nullptr; // prefill, or null (zeros)
  float* final_state = nullptr;         // prefill, or null (not returned)
  float* pool = nullptr;                // decode / verify: FP32 state storage, or
  uint16_t* pool16 = nullptr;           // BF16 state storage (FP32 math; RNE on store)
  int64_t pool_slots = 0;
  const int32_t* state_indices = nullptr;  // [N] (decode) or [N, draft] (verify)
  const int32_t* num_accepted = nullptr;   // [N] (verify)
  int64_t draft = 1;
  uint32_t* status = nullptr;    // workspace: KdaStatusBit
  int32_t* seq_flags = nullptr;  // workspace: [N] per-sequence bits (decode / verify)
};

__device__ __forceinline__ float load_act(const void* p, bool bf16, int64_t i) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

// A pool entry widened to FP32, and stored back (BF16: round to nearest even, NaN kept).
__device__ __forceinline__ float load_pool(const Launch& L, int64_t i) {
  return L.pool16 != nullptr ? bf16_to_f32(L.pool16[i]) : L.pool[i];
}
__device__ __forceinline__ void store_pool(const Launch& L, int64_t i, float x) {
  if (L.pool16 != nullptr) {
    L.pool16[i] = bf16_from_f32(x);
  } else {
    L.pool[i] = x;
  }
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The chunked prefill (kda_chunked.cu; ran on an H200, 2026-12-04): one block of chunk::kThreads per
// (32-column V tile, head, sequence), plan.chunk_smem_bytes of dynamic shared memory. Enqueues
// only (the caller has reset the status word and run the cu_seqlens check).
Status launch_chunked_prefill(const KdaPlan& plan, const Launch& L, cudaStream_t stream);

}  // namespace k3::cuda::kda_detail
