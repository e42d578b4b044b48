// The router on the GPU: one block of 256 threads per token. Ran on an H200 (2026-12-04): CudaRouting tests pass.
// Selection = top_k rounds of a block-wide arg-best under the router's total order; a selected
// expert's choice becomes NaN, which the order never selects again. The few serial steps (group
// ranking, the renormalization sum) run on thread 0 in exactly the CPU router's order.
#include "cuda/common.cuh"
#include "k3/cuda_routing.hpp"
#include "k3/portable_math.hpp"

namespace k3::cuda {
namespace {

constexpr int kThreads = 256;

// a before b: larger key first, NaN last, lower index on equal keys (k3/routing.hpp).
__device__ __forceinline__ bool better(float ka, int a, float kb, int b) {
  const bool na = ka != ka, nb = kb != kb;
  if (na != nb) return nb;
  if (!na && ka != kb) return ka > kb;
  return a < b;
}

__global__ void __launch_bounds__(kThreads) route_kernel(RoutingConfig cfg, const int32_t* __restrict__ m_ptr,
                                                         const float* __restrict__ logits,  // [M, E]
                                                         const float* __restrict__ bias,    // [E] or null
                                                         int32_t* __restrict__ ids, float* __restrict__ weights) {
  extern __shared__ float smem[];
  const int e_n = cfg.num_experts, groups = cfg.n_group;
  float* s = smem;                  // [E] sigmoid scores
  float* choice = smem + e_n;       // [E] biased choice; NaN = excluded
  float* gscore = smem + 2 * e_n;   // [G]
  int* gkept = reinterpret_cast<int*>(smem + 2 * e_n + groups);  // [G] 1 = group kept
  __shared__ int cand[32];
  __shared__ float red_key[kThreads / 32];
  __shared__ int red_idx[kThreads / 32];
  const int64_t t = blockIdx.x;
  if (t >= *m_ptr) return;
  const float* row = logits + t * e_n;
  for (int e = threadIdx.x; e < e_n; e += blockDim.x) {
    s[e] = sigmoid_f32(row[e]);
    choice[e] = bias == nullptr ? s[e] : s[e] + bias[e];
  }
  __syncthreads();
  if (groups > 1) {
    const int gsize = e_n / groups;
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {  // the CPU's scan, one group per thread
      int best = -1, second = -1;
      for (int e = g * gsize; e < (g + 1) * gsize; ++e) {
        if (choice[e] != choice[e]) continue;
        if (best < 0 || better(choice[e], e, choice[best], best)) {
          second = best;
          best = e;
        } else if (second < 0 || better(choice[e], e, choice[second], second)) {
          second = e;
        }
      }
      gscore[g] = best < 0 ? __int_as_float(0x7FC00000) : (second < 0 ? choice[best] : choice[best] + choice[second]);
    }
    __syncthreads();
    for (int g = threadIdx.x; g < groups; g += blockDim.x) gkept[g] = 0;
    __syncthreads();
    if (threadIdx.x == 0) {  // the topk_group best groups in the router's order; NaN groups never
      for (int i = 0; i < cfg.topk_group; ++i) {
        int best = -1;
        for (int g = 0; g < groups; ++g) {
          if (!gkept[g] && (best < 0 || better(gscore[g], g, gscore[best], best))) best = g;
        }
        if (best < 0 || gscore[best] != gscore[best]) break;
        gkept[best] = 1;
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < e_n; e += blockDim.x) {
      if (!gkept[e / gsize]) choice[e] = __int_as_float(0x7FC00000);  // never selected
    }
    __syncthreads();
  }
  // top_k rounds of a block-wide arg-best.
  __shared__ int take;
  if (threadIdx.x == 0) take = 0;
  __syncthreads();
  for (int i = 0; i < cfg.top_k; ++i) {
    float bk = __int_as_float(0x7FC00000);
    int bi = 0x7FFFFFFF;
    for (int e = threadIdx.x; e < e_n; e += blockDim.x) {
      if (better(choice[e], e, bk, bi)) {
        bk = choice[e];
        bi = e;
      }
    }
    for (int off = 16; off > 0; off >>= 1) {
      const float ok = __shfl_xor_sync(0xFFFFFFFFu, bk, off);
      const int oi = __shfl_xor_sync(0xFFFFFFFFu, bi, off);
      if (better(ok, oi, bk, bi)) {
        bk = ok;
        bi = oi;
      }
    }
    if ((threadIdx.x & 31) == 0) {
      red_key[threadIdx.x >> 5] = bk;
      red_idx[threadIdx.x >> 5] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kThreads / 32; ++w) {
        if (better(red_key[w], red_idx[w], bk, bi)) {
          bk = red_key[w];
          bi = red_idx[w];
        }
      }
      if (bk == bk && bi < e_n) {  // a non-NaN choice exists
        cand[i] = bi;
        choice[bi] = __int_as_float(0x7FC00000);
        take = i + 1;
      }
    }
    __syncthreads();
    if (take <= i) break;
  }
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int i = 0; i < take; ++i) sum += s[cand[i]];
    const float denom = sum + kRenormalizeEpsilon;
    for (int i = 0; i < cfg.top_k; ++i) {
      if (i >= take) {
        ids[t * cfg.top_k + i] = -1;
        weights[t * cfg.top_k + i] = 0.0f;
        continue;
      }
      ids[t * cfg.top_k + i] = cand[i];
      const float w = cfg.renormalize ? __fdiv_rn(s[cand[i]], denom) : s[cand[i]];
      weights[t * cfg.top_k + i] = __fmul_rn(w, cfg.routed_scaling_factor);
    }
  }
}

}  // namespace

Status route_device(const RoutingConfig& cfg, const int32_t* m_device, int64_t max_tokens, const float* logits,
                    const float* bias, int32_t* ids, float* weights, void* stream) {
  K3_RETURN_IF_ERROR(validate_routing_config(cfg));
  if (max_tokens < 0 || max_tokens > (int64_t{1} << 31) - 1) {
    return invalid_argument("route_device: max_tokens = " + std::to_string(max_tokens) + " must be in [0, 2^31)");
  }
  if (max_tokens == 0) return Status::ok();
  const size_t smem = (2 * static_cast<size_t>(cfg.num_experts) + 2 * static_cast<size_t>(cfg.n_group)) * sizeof(float);
  if (smem > 48 * 1024) {
    K3_CUDA_TRY(cudaFuncSetAttribute(route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
                "cudaFuncSetAttribute(route_kernel)");
  }
  route_kernel<<<static_cast<unsigned>(max_tokens), kThreads, smem, static_cast<cudaStream_t>(stream)>>>(
      cfg, m_device, logits, bias, ids, weights);
  return detail::from_cuda(cudaGetLastError(), "route_kernel launch");
}

Status route_host(const RoutingConfig& cfg, int64_t m, std::span<const float> logits, std::span<const float> bias,
                  std::span<int32_t> ids, std::span<float> weights) {
  K3_RETURN_IF_ERROR(validate_routing_config(cfg));
  const int64_t e = cfg.num_experts, k = cfg.top_k;
  if (m < 0 || static_cast<int64_t>(logits.size()) != m * e || static_cast<int64_t>(ids.size()) != m * k ||
      static_cast<int64_t>(weights.size()) != m * k || (!bias.empty() && static_cast<int64_t>(bias.size()) != e)) {
    return invalid_argument("route_host: logits must be [M, E], bias [E] or empty, ids and weights [M, top_k]");
  }
  if (m == 0) return Status::ok();
  detail::DeviceBuffer<float> dl, db, dw;
  detail::DeviceBuffer<int32_t> di, dm;
  K3_RETURN_IF_ERROR(dl.allocate(logits.size()));
  K3_RETURN_IF_ERROR(db.allocate(bias.size()));
  K3_RETURN_IF_ERROR(dw.allocate(weights.size()));
  K3_RETURN_IF_ERROR(di.allocate(ids.size()));
  K3_RETURN_IF_ERROR(dm.allocate(1));
  const int32_t m32 = static_cast<int32_t>(m);
  K3_CUDA_TRY(cudaMemcpy(dl.get(), logits.data(), logits.size_bytes(), cudaMemcpyHostToDevice), "copy logits");
  if (!bias.empty()) K3_CUDA_TRY(cudaMemcpy(db.get(), bias.data(), bias.size_bytes(), cudaMemcpyHostToDevice), "copy bias");
  K3_CUDA_TRY(cudaMemcpy(dm.get(), &m32, 4, cudaMemcpyHostToDevice), "copy m");
  K3_RETURN_IF_ERROR(route_device(cfg, dm.get(), m, dl.get(), bias.empty() ? nullptr : db.get(), di.get(), dw.get(), nullptr));
  K3_CUDA_TRY(cudaDeviceSynchronize(), "route");
  K3_CUDA_TRY(cudaMemcpy(ids.data(), di.get(), ids.size_bytes(), cudaMemcpyDeviceToHost), "copy ids");
  K3_CUDA_TRY(cudaMemcpy(weights.data(), dw.get(), weights.size_bytes(), cudaMemcpyDeviceToHost), "copy weights");
  return Status::ok();
}

}  // namespace k3::cuda
