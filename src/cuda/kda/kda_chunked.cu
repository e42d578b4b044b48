// The chunked KDA prefill kernel of the CUDA backend (docs/kda.md, "CUDA chunked prefill"). Ran
// on an H200 (sm_90, 2026-12-04): its tests and k3 validate pass, but it is slower than the
// recurrent kernel there (43.4 against 36.7 ms at T = 8192, H = 96), so kAuto keeps the recurrent
// one. Its chunk math (core/kda/kda_chunk_math.hpp) is also unit-tested on the host through an
// emulation of the tensor-core fragments. Never run on sm_120.
//
// One block of 4 warps per (32-column V tile, head, sequence) walks the sequence's chunks of 16
// tokens in order with its state slice S [K, 32] in shared memory (FP32). Per chunk: stage the
// rows (gate, L2 norm, beta, the non-finite policy, as kda_recurrent.cu and the CPU's
// prep_token), then chunk::chunk_compute (WY form, tensor-core products in 3xTF32), then store
// the output rows with the poison rules.
#include <cuda_runtime.h>

#include "core/kda/kda_chunk_math.hpp"
#include "core/kda/kda_math.hpp"
#include "cuda/common.cuh"
#include "cuda/kda/kda_launch.cuh"
#include "k3/cuda_kda.hpp"

namespace k3::cuda {
namespace kda_detail {
namespace {

namespace ch = kda::chunk;

// The block as chunk_compute's executor: items strided over the threads, tiles over the warps
// (all 32 lanes of a warp take the same tiles, so every mma is warp-uniform), barriers.
struct DeviceExec {
  int tid, warp, lane;
  template <class F>
  __device__ bool columns_or(int n, F f) {
    bool any = false;
    for (int i = tid; i < n; i += ch::kThreads) any = f(i) || any;
    return __syncthreads_or(any ? 1 : 0) != 0;
  }
  template <class F>
  __device__ void columns(int n, F f) {
    for (int i = tid; i < n; i += ch::kThreads) f(i);
  }
  template <class F>
  __device__ void tiles(int n, F f) {
    for (int t = warp; t < n; t += ch::kWarps) f(t, lane);
  }
  __device__ void sync() { __syncthreads(); }
};

__global__ void __launch_bounds__(ch::kThreads, 1) kda_chunked_kernel(const Launch L) {
  extern __shared__ float4 smem4[];  // float4: 16-byte alignment of the regions
  float* smem = reinterpret_cast<float*>(smem4);
  const int K = L.dk, V = L.dv, H = L.heads;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int h = blockIdx.y;
  const int64_t n = blockIdx.z;
  const int j0 = blockIdx.x * ch::kVt;
  ch::View s = ch::make_view(smem, K);
  const int kp = s.kp, ldk = s.ldk;
  const int64_t head_elems = static_cast<int64_t>(K) * V;
  const float nan = __int_as_float(0x7fc00000);

  int64_t t0 = 0, t1 = L.num_tokens;
  if (L.cu_seqlens != nullptr) {
    if (*L.status & kKdaBadSeqlens) {  // no well-defined rows: no output, a NaN final state
      if (L.final_state != nullptr) {
        float* dst = L.final_state + (n * H + h) * head_elems;
        for (int x = tid; x < K * ch::kVt; x += ch::kThreads) {
          const int d = x / ch::kVt, j = j0 + x % ch::kVt;
          if (j < V) dst[L.kfirst ? d * V + j : j * K + d] = nan;
        }
      }
      return;
    }
    t0 = L.cu_seqlens[n];
    t1 = L.cu_seqlens[n + 1];
  }

  const bool gated = L.gate != kda::GateMode::kLogDecay;
  float a = 0.0f;
  bool head_bad = false;
  if (gated) {
    const float al = L.a_log[h];
    head_bad = !(al >= kda::kMinALog && al <= kda::kMaxALog);
    a = kda::detail::gate_exp(al);
    if (head_bad && tid == 0) atomicOr(L.status, kKdaBadALog);
  }
  for (int d = tid; d < kp; d += ch::kThreads) {
    s.bias[d] = (gated && L.dt_bias != nullptr && d < K) ? L.dt_bias[h * K + d] : 0.0f;
  }
  // The state slice: rows d < K, columns j0 + j < V; zero elsewhere (padding stays zero).
  const float* src = L.initial_state != nullptr ? L.initial_state + (n * H + h) * head_elems : nullptr;
  for (int x = tid; x < kp * ch::kVt; x += ch::kThreads) {
    const int d = x / ch::kVt, j = j0 + x % ch::kVt;
    s.S[d * ch::kLdV + x % ch::kVt] =
        (src != nullptr && d < K && j < V) ? src[L.kfirst ? d * V + j : j * K + d] : 0.0f;
  }
  __syncthreads();

  DeviceExec ex{tid, warp, lane};
  for (int64_t t = t0; t < t1; t += ch::kC) {
    const int c = static_cast<int>(t1 - t < ch::kC ? t1 - t : ch::kC);
    s.c = c;
    // Stage rows i = warp, warp + 4, ... (rows >= c zero). The lanes hold columns d = lane + 32 r.
    for (int i = warp; i < ch::kC; i += ch::kWarps) {
      const bool real = i < c;
      const int64_t tok = t + i;
      const int64_t qk = (tok * H + h) * K;
      float sq = 0.0f, sk = 0.0f;
      bool qb = false, kb = false, gb = false;
      for (int d = lane; d < kp; d += 32) {
        float qv = 0.0f, kv = 0.0f, gv = 0.0f;
        if (real && d < K) {
          qv = load_act(L.q, L.q_bf16, qk + d);
          kv = load_act(L.k, L.k_bf16, qk + d);
          gv = kda::detail::log_decay<float>(L.gate, L.g[qk + d], a, s.bias[d], L.lower_bound);
        }
        qb = qb || !ch::finite(qv);
        kb = kb || !ch::finite(kv);
        gb = gb || kda::detail::decay_poisons(gv);
        s.q[i * ldk + d] = qv;
        s.k[i * ldk + d] = kv;
        s.g[i * ldk + d] = gv;
        sq += qv * qv;
        sk += kv * kv;
      }
      qb = __any_sync(0xffffffffu, qb);
      kb = __any_sync(0xffffffffu, kb);
      gb = __any_sync(0xffffffffu, gb);
      sq = warp_sum(sq);
      sk = warp_sum(sk);
      float beta = 0.0f;
      if (real) {
        const float braw = L.beta[tok * H + h];
        beta = L.beta_logits ? kda::detail::sigmoid<float>(braw) : braw;
      }
      const bool whole = real && (kb || gb || !ch::finite(beta) || head_bad);
      if (qb) sq = 0.0f;
      if (whole) sk = 0.0f;
      // eps inside the square root, as the CPU backend and fla's l2norm
      const float qscale = L.l2norm ? L.scale / sqrtf(sq + 1e-6f) : L.scale;
      const float kscale = L.l2norm ? 1.0f / sqrtf(sk + 1e-6f) : 1.0f;
      for (int d = lane; d < kp; d += 32) {  // each lane rescales the entries it wrote
        s.q[i * ldk + d] = qb ? 0.0f : s.q[i * ldk + d] * qscale;
        s.k[i * ldk + d] = whole ? 0.0f : s.k[i * ldk + d] * kscale;
        if (whole) s.g[i * ldk + d] = 0.0f;
      }
      float vv = 0.0f;
      if (real && j0 + lane < V) vv = load_act(L.v, L.v_bf16, (tok * H + h) * V + j0 + lane);
      const bool vb = !ch::finite(vv);
      s.vs[i * ch::kLdV + lane] = vb ? 0.0f : vv;
      const unsigned vmask = __ballot_sync(0xffffffffu, vb);
      if (lane == 0) {
        s.beta[i] = whole ? 0.0f : beta;
        s.rowflag[i] = (real && qb ? ch::kRowQBad : 0) | (whole ? ch::kRowWhole : 0);
        s.vbad[i] = vmask;
      }
    }
    __syncthreads();
    ch::chunk_compute(s, ex);
    // The output rows: NaN from a column's first poisoned row and in rows with a non-finite q.
    // (os, pstart and rowflag were written before chunk_compute's last barrier.)
    for (int x = tid; x < c * ch::kVt; x += ch::kThreads) {
      const int i = x / ch::kVt, j = x % ch::kVt;
      if (j0 + j < V) {
        const bool bad = (s.rowflag[i] & ch::kRowQBad) != 0 || i >= s.pstart[j];
        L.o[((t + i) * H + h) * V + j0 + j] = bad ? nan : s.os[i * ch::kLdV + j];
      }
    }
    __syncthreads();
  }

  if (L.final_state != nullptr) {
    float* dst = L.final_state + (n * H + h) * head_elems;
    for (int x = tid; x < K * ch::kVt; x += ch::kThreads) {
      const int d = x / ch::kVt, j = j0 + x % ch::kVt;
      if (j < V) dst[L.kfirst ? d * V + j : j * K + d] = s.S[d * ch::kLdV + x % ch::kVt];
    }
  }
}

}  // namespace

Status launch_chunked_prefill(const KdaPlan& p, const Launch& L, cudaStream_t stream) {
  if (L.num_seqs == 0) return Status::ok();
  if (p.chunk_smem_bytes <= 0 || p.chunk_smem_bytes != ch::smem_bytes(L.dk)) {
    return invalid_argument("the KDA plan has no chunked kernel geometry: plan with algorithm = chunked");
  }
  // Above 48 KB of dynamic shared memory needs the opt-in (the plan checked the device's limit).
  K3_CUDA_TRY(cudaFuncSetAttribute(kda_chunked_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(p.chunk_smem_bytes)),
              "kda_chunked_kernel: set the dynamic shared memory size");
  const dim3 grid(static_cast<unsigned>((p.cfg.head_v + ch::kVt - 1) / ch::kVt),
                  static_cast<unsigned>(p.cfg.num_heads), static_cast<unsigned>(L.num_seqs));
  kda_chunked_kernel<<<grid, ch::kThreads, static_cast<size_t>(p.chunk_smem_bytes), stream>>>(L);
  return detail::from_cuda(cudaGetLastError(), "kda_chunked_kernel launch");
}

}  // namespace kda_detail
}  // namespace k3::cuda
