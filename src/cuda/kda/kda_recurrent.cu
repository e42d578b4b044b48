// The token-recurrent KDA kernel of the CUDA backend: prefill (variable lengths), decode on a
// state pool and speculative verify (k3/cuda_kda.hpp). Ran on an H200 (2026-12-04): tests and validate pass.
//
// Every column j of the state S [K, V] evolves independently given the token's q, k, g and beta
// (S <- Diag(exp g) S; v'_j = beta (v_j - S[:, j] . k); S[:, j] += k v'_j; o_j = S[:, j] . q), so a
// block owns 32 columns (one per lane) of one head of one sequence, for all the sequence's
// tokens. Warp w keeps rows [w R, (w + 1) R) of its lane's column in registers (R <= 32), so the
// state is read once and written once per call. The two dot products per token are reduced over
// the warps through shared memory in a fixed order: the bits do not depend on timing. The
// token's rows are loaded by thread d < K (prefetched one token ahead), with the gate, the L2
// norms and the non-finite policy of docs/kda.md computed the way the FP32 reference does.
#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/kda/kda_math.hpp"
#include "cuda/common.cuh"
#include "cuda/kda/kda_launch.cuh"
#include "k3/cuda_kda.hpp"
#include "k3/formats.hpp"

namespace k3::cuda {
namespace {

using kda_detail::Launch;
using kda_detail::load_act;
using kda_detail::warp_sum;

enum class Mode { kPrefill, kDecode, kVerify };

constexpr int kMaxRows = 32;     // state rows per thread (R = ceil(K / warps) <= 32)
constexpr int kMaxThreads = 512; // 16 warps for K = 512

// Pre-pass of a prefill with cu_seqlens: a malformed array (any entry) stops the whole call, so
// that no two sequences can claim the same token rows.
__global__ void check_seqlens_kernel(const int64_t* __restrict__ cu, int64_t n_seqs, int64_t tokens,
                                     uint32_t* status) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i > n_seqs) return;
  const int64_t c = cu[i];
  bool bad = c < 0 || c > tokens;
  if (i == 0) bad = bad || c != 0;
  if (i == n_seqs) bad = bad || c != tokens;
  if (i > 0) bad = bad || c < cu[i - 1];
  if (bad) atomicOr(status, kKdaBadSeqlens);
}

// Pre-pass of decode / verify: entry e = (n, t) of state_indices. Marks sequence n when its slot
// is past the pool, when another entry writes the same slot, or when num_accepted[n] is outside
// [1, T]. O(entries^2) compares: a warp reads the same entry at once (a broadcast), so N * T up to
// a few thousand costs microseconds.
__global__ void check_slots_kernel(const int32_t* __restrict__ idx, const int32_t* __restrict__ accepted,
                                   int64_t n_seqs, int64_t draft, int64_t slots, int32_t* flags, uint32_t* status) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t entries = n_seqs * draft;
  if (e >= entries) return;
  const int64_t n = e / draft, t = e % draft;
  const int32_t slot = idx[e];
  uint32_t bits = 0;
  if (slot >= slots) bits |= kKdaSlotOutOfRange;
  if (slot >= 0) {
    for (int64_t f = 0; f < entries; ++f) {
      if (f != e && idx[f] == slot) {
        bits |= kKdaDuplicateSlot;
        break;
      }
    }
  }
  if (accepted != nullptr && t == 0 && (accepted[n] < 1 || accepted[n] > draft)) bits |= kKdaBadAccepted;
  if (bits != 0) {
    atomicOr(reinterpret_cast<unsigned int*>(flags) + n, bits);
    atomicOr(status, bits);
  }
}

template <Mode M>
__global__ void __launch_bounds__(kMaxThreads, 1) kda_recurrent_kernel(const Launch L) {
  extern __shared__ float smem[];
  const int K = L.dk, V = L.dv, H = L.heads, R = L.rows, NW = L.warps;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, tid = threadIdx.x;
  const int h = blockIdx.y;
  const int64_t n = blockIdx.z;
  const int j = blockIdx.x * kKdaVTile + lane;
  const bool col_ok = j < V;
  float* qs = smem;           // [K] raw q (sanitized later)
  float* ks = qs + K;         // [K] raw k
  float* as = ks + K;         // [K] exp(g)
  float* vs = as + K;         // [32]
  float* red1 = vs + kKdaVTile;        // [NW, 32]
  float* red2 = red1 + NW * kKdaVTile; // [NW, 32]
  float* nq = red2 + NW * kKdaVTile;   // [NW]
  float* nk = nq + NW;                 // [NW]
  int* nflag = reinterpret_cast<int*>(nk + NW);  // [NW]
  float* misc = reinterpret_cast<float*>(nflag + NW);  // [0] beta input
  const int64_t head_elems = static_cast<int64_t>(K) * V;
  const float nan = __int_as_float(0x7fc00000);

  // The sequence's tokens [t0, t1), where its state comes from, and whether it runs at all.
  int64_t t0 = 0, t1 = 0;
  const float* src = nullptr;  // prefill: the initial state of this head
  int64_t src_slot = -1;       // decode / verify: the pool slot read
  bool skip_nan = false, skip_zero = false;
  if constexpr (M == Mode::kPrefill) {
    if (L.cu_seqlens != nullptr) {
      if (*L.status & kKdaBadSeqlens) {
        skip_nan = true;
      } else {
        t0 = L.cu_seqlens[n];
        t1 = L.cu_seqlens[n + 1];
      }
    } else {
      t1 = L.num_tokens;
    }
    if (L.initial_state != nullptr) src = L.initial_state + (n * H + h) * head_elems;
  } else if constexpr (M == Mode::kDecode) {
    t0 = n;
    t1 = n + 1;
    const int32_t slot = L.state_indices[n];
    if (L.seq_flags[n] != 0) {
      skip_nan = true;
    } else if (slot < 0) {
      skip_zero = true;
    } else {
      src_slot = slot;
    }
  } else {
    t0 = n * L.draft;
    t1 = t0 + L.draft;
    if (L.seq_flags[n] != 0) {
      skip_nan = true;
    } else {
      const int32_t read = L.state_indices[n * L.draft + L.num_accepted[n] - 1];
      if (read < 0) {
        skip_zero = true;
      } else {
        src_slot = read;
      }
    }
  }
  // This thread's state entries: rows d = w R + i, i < nrows, of column j, at sbase + i sstride
  // within a head's [K, V] (K-first) or [V, K] (V-first) block (< 2^18 elements: int offsets).
  const int nrows = min(R, K - w * R);
  const int sbase = L.kfirst ? w * R * V + j : j * K + w * R;
  const int sstride = L.kfirst ? V : 1;
  if (skip_nan || skip_zero) {
    if constexpr (M == Mode::kPrefill) {
      if (L.final_state != nullptr && col_ok) {  // bad cu_seqlens: the final state is NaN
        float* dst = L.final_state + (n * H + h) * head_elems + sbase;
        for (int i = 0; i < nrows; ++i) dst[i * sstride] = nan;
      }
    } else {
      if (w == 0 && col_ok) {
        for (int64_t t = t0; t < t1; ++t) L.o[(t * H + h) * V + j] = skip_nan ? nan : 0.0f;
      }
    }
    return;
  }

  float s[kMaxRows];
  const int64_t slot_base = (src_slot * H + h) * head_elems + sbase;
#pragma unroll
  for (int i = 0; i < kMaxRows; ++i) {
    float x = 0.0f;
    if (i < nrows && col_ok) {
      if (src != nullptr) {
        x = src[sbase + i * sstride];
      } else if (src_slot >= 0) {
        x = kda_detail::load_pool(L, slot_base + i * sstride);
      }
    }
    s[i] = x;
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
  const float bias = (gated && L.dt_bias != nullptr && tid < K) ? L.dt_bias[h * K + tid] : 0.0f;

  // Token inputs of thread tid < K, loaded one token ahead.
  float pq = 0.0f, pk = 0.0f, pf = 0.0f, pv = 0.0f, pb = 0.0f;
  auto prefetch = [&](int64_t t) {
    if (t >= t1) return;
    const int64_t qk = (t * H + h) * K;
    if (tid < K) {
      pq = load_act(L.q, L.q_bf16, qk + tid);
      pk = load_act(L.k, L.k_bf16, qk + tid);
      pf = L.g[qk + tid];
    }
    if (w == 0 && col_ok) pv = load_act(L.v, L.v_bf16, (t * H + h) * V + j);
    if (tid == 0) pb = L.beta[t * H + h];
  };
  prefetch(t0);

  for (int64_t t = t0; t < t1; ++t) {
    // Phase A: the token's rows into shared memory, the L2 sums and the non-finite flags.
    float sq = 0.0f, sk = 0.0f;
    int fl = 0;
    if (tid < K) {
      const float gv = kda::detail::log_decay<float>(L.gate, pf, a, bias, L.lower_bound);
      const bool qb = !isfinite(pq), kb = !isfinite(pk);
      fl = (qb ? 1 : 0) | (kb ? 2 : 0) | (kda::detail::decay_poisons(gv) ? 4 : 0);
      qs[tid] = pq;
      ks[tid] = pk;
      as[tid] = kda::detail::gate_exp(gv);
      sq = qb ? 0.0f : pq * pq;
      sk = kb ? 0.0f : pk * pk;
    }
    if (w == 0) vs[lane] = col_ok ? pv : 0.0f;
    if (tid == 0) misc[0] = pb;
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    fl = static_cast<int>(__reduce_or_sync(0xffffffffu, static_cast<unsigned>(fl)));
    if (lane == 0) {
      nq[w] = sq;
      nk[w] = sk;
      nflag[w] = fl;
    }
    __syncthreads();
    prefetch(t + 1);

    // Phase B: decay, then the prediction S^T k of this thread's rows.
    float qq = 0.0f, kk = 0.0f;
    int flags = 0;
    for (int x = 0; x < NW; ++x) {
      qq += nq[x];
      kk += nk[x];
      flags |= nflag[x];
    }
    const bool q_bad = (flags & 1) != 0;
    bool whole = (flags & 6) != 0 || head_bad;
    const float qn = L.l2norm ? 1.0f / sqrtf(qq + 1e-6f) : 1.0f;
    const float kn = L.l2norm ? 1.0f / sqrtf(kk + 1e-6f) : 1.0f;
    const float braw = misc[0];
    float beta = L.beta_logits ? kda::detail::sigmoid<float>(braw) : braw;
    whole = whole || !isfinite(beta);
    if (whole) beta = 0.0f;
    float part = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxRows; ++i) {
      const int d = w * R + i;
      if (i < nrows) {
        const float kd = whole ? 0.0f : ks[d] * kn;
        s[i] *= whole ? 1.0f : as[d];
        part += s[i] * kd;
      }
    }
    red1[w * kKdaVTile + lane] = part;
    __syncthreads();

    // Phase C: v' = beta (v - S^T k) with the poison rules, the rank-1 write and S^T q.
    float pred = 0.0f;
    for (int x = 0; x < NW; ++x) pred += red1[x * kKdaVTile + lane];
    float vj = vs[lane];
    const bool vbad = !isfinite(vj);
    if (vbad) vj = 0.0f;
    float vp = beta * (vj - pred);
    if (whole || vbad || !isfinite(vp)) vp = nan;
    const float qscale = qn * L.scale;
    float part2 = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxRows; ++i) {
      const int d = w * R + i;
      if (i < nrows) {
        const float kd = whole ? 0.0f : ks[d] * kn;
        const float qd = q_bad ? 0.0f : qs[d] * qscale;
        s[i] += kd * vp;
        part2 += s[i] * qd;
      }
    }
    red2[w * kKdaVTile + lane] = part2;
    if constexpr (M == Mode::kVerify) {  // every prefix state to its own slot (< 0: not stored)
      const int32_t slot = L.state_indices[t];
      if (slot >= 0 && col_ok) {
        const int64_t dst = (static_cast<int64_t>(slot) * H + h) * head_elems + sbase;
#pragma unroll
        for (int i = 0; i < kMaxRows; ++i) {
          if (i < nrows) kda_detail::store_pool(L, dst + i * sstride, s[i]);
        }
      }
    }
    __syncthreads();

    // Phase D: the output row.
    if (w == 0 && col_ok) {
      float o = 0.0f;
      for (int x = 0; x < NW; ++x) o += red2[x * kKdaVTile + lane];
      L.o[(t * H + h) * V + j] = q_bad ? nan : o;
    }
  }

  if constexpr (M == Mode::kPrefill) {
    if (L.final_state != nullptr && col_ok) {
      float* dst = L.final_state + (n * H + h) * head_elems + sbase;
#pragma unroll
      for (int i = 0; i < kMaxRows; ++i) {
        if (i < nrows) dst[i * sstride] = s[i];
      }
    }
  } else if constexpr (M == Mode::kDecode) {
    if (col_ok) {  // the slot read is the slot written
#pragma unroll
      for (int i = 0; i < kMaxRows; ++i) {
        if (i < nrows) kda_detail::store_pool(L, slot_base + i * sstride, s[i]);
      }
    }
  }
}

Launch make_launch(const KdaPlan& p, const kda::KdaInputs& in, float* o, void* workspace) {
  const kda::KdaConfig& c = p.cfg;
  Launch L;
  L.heads = static_cast<int>(c.num_heads);
  L.dk = static_cast<int>(c.head_k);
  L.dv = static_cast<int>(c.head_v);
  L.warps = p.warps;
  L.rows = p.rows_per_thread;
  L.gate = c.gate;
  L.lower_bound = c.gate_lower_bound;
  L.scale = c.effective_scale();
  L.beta_logits = c.beta_logits;
  L.l2norm = c.l2norm_qk;
  L.kfirst = c.layout == kda::StateLayout::kKFirst;
  L.q_bf16 = in.q.is_bf16();
  L.k_bf16 = in.k.is_bf16();
  L.v_bf16 = in.v.is_bf16();
  L.q = L.q_bf16 ? static_cast<const void*>(in.q.bf16.data()) : in.q.f32.data();
  L.k = L.k_bf16 ? static_cast<const void*>(in.k.bf16.data()) : in.k.f32.data();
  L.v = L.v_bf16 ? static_cast<const void*>(in.v.bf16.data()) : in.v.f32.data();
  L.g = in.g.data();
  L.beta = in.beta.data();
  L.a_log = c.gate != kda::GateMode::kLogDecay ? in.a_log.data() : nullptr;
  L.dt_bias = in.dt_bias.empty() ? nullptr : in.dt_bias.data();
  L.o = o;
  L.num_tokens = in.q.size() / (c.num_heads * c.head_k);
  auto* ws = static_cast<uint8_t*>(workspace);
  L.status = reinterpret_cast<uint32_t*>(ws + p.ws_status);
  L.seq_flags = reinterpret_cast<int32_t*>(ws + p.ws_seq_flags);
  return L;
}

template <Mode M>
Status launch_main(const KdaPlan& p, const Launch& L, cudaStream_t stream) {
  if (L.num_seqs == 0) return Status::ok();
  const dim3 grid(static_cast<unsigned>(p.v_tiles), static_cast<unsigned>(p.cfg.num_heads),
                  static_cast<unsigned>(L.num_seqs));
  kda_recurrent_kernel<M><<<grid, static_cast<unsigned>(p.warps * 32), static_cast<size_t>(p.smem_bytes), stream>>>(L);
  return detail::from_cuda(cudaGetLastError(), "kda_recurrent_kernel launch");
}

Status reset_status(const KdaPlan& p, void* workspace, int64_t seqs, cudaStream_t stream) {
  auto* ws = static_cast<uint8_t*>(workspace);
  K3_CUDA_TRY(cudaMemsetAsync(ws + p.ws_status, 0, sizeof(uint32_t), stream), "kda: reset the status word");
  if (seqs > 0) {
    K3_CUDA_TRY(cudaMemsetAsync(ws + p.ws_seq_flags, 0, static_cast<size_t>(seqs) * sizeof(int32_t), stream),
                "kda: reset the sequence flags");
  }
  return Status::ok();
}

Status check_workspace(void* workspace) {
  if (workspace == nullptr) return invalid_argument("workspace is null: pass a device buffer of plan.workspace_bytes");
  return Status::ok();
}

}  // namespace

Status prefill(const KdaPlan& p, const kda::KdaInputs& in, const kda::KdaOutputs& out, void* workspace,
               void* stream) {
  K3_RETURN_IF_ERROR(check_prefill_sizes(p, in, out));
  K3_RETURN_IF_ERROR(check_workspace(workspace));
  auto s = static_cast<cudaStream_t>(stream);
  Launch L = make_launch(p, in, out.o.data(), workspace);
  L.num_seqs = in.cu_seqlens.empty() ? 1 : static_cast<int64_t>(in.cu_seqlens.size()) - 1;
  L.cu_seqlens = in.cu_seqlens.empty() ? nullptr : in.cu_seqlens.data();
  L.initial_state = in.initial_state.empty() ? nullptr : in.initial_state.data();
  L.final_state = out.final_state.empty() ? nullptr : out.final_state.data();
  K3_RETURN_IF_ERROR(reset_status(p, workspace, 0, s));
  if (L.cu_seqlens != nullptr) {
    const unsigned block = 256;
    check_seqlens_kernel<<<detail::grid_for(L.num_seqs + 1, block), block, 0, s>>>(L.cu_seqlens, L.num_seqs,
                                                                                  L.num_tokens, L.status);
    K3_CUDA_TRY(cudaGetLastError(), "kda check_seqlens_kernel launch");
  }
  if (p.algorithm == kda::Algorithm::kChunked) return kda_detail::launch_chunked_prefill(p, L, s);
  return launch_main<Mode::kPrefill>(p, L, s);
}

Status decode(const KdaPlan& p, const kda::DecodeArgs& a, void* workspace, void* stream) {
  K3_RETURN_IF_ERROR(check_decode_sizes(p, a));
  K3_RETURN_IF_ERROR(check_workspace(workspace));
  auto s = static_cast<cudaStream_t>(stream);
  Launch L = make_launch(p, a.in, a.o.data(), workspace);
  L.num_seqs = L.num_tokens;
  L.pool = a.state_pool.empty() ? nullptr : a.state_pool.data();
  L.pool16 = a.state_pool_bf16.empty() ? nullptr : a.state_pool_bf16.data();
  L.pool_slots = static_cast<int64_t>(a.state_pool.size() + a.state_pool_bf16.size()) /
                 (p.cfg.num_heads * p.cfg.head_k * p.cfg.head_v);
  L.state_indices = a.state_indices.data();
  L.draft = 1;
  K3_RETURN_IF_ERROR(reset_status(p, workspace, L.num_seqs, s));
  if (L.num_seqs == 0) return Status::ok();
  const unsigned block = 256;
  check_slots_kernel<<<detail::grid_for(L.num_seqs, block), block, 0, s>>>(L.state_indices, nullptr, L.num_seqs, 1,
                                                                          L.pool_slots, L.seq_flags, L.status);
  K3_CUDA_TRY(cudaGetLastError(), "kda check_slots_kernel launch");
  return launch_main<Mode::kDecode>(p, L, s);
}

Status verify(const KdaPlan& p, const kda::VerifyArgs& a, void* workspace, void* stream) {
  K3_RETURN_IF_ERROR(check_verify_sizes(p, a));
  K3_RETURN_IF_ERROR(check_workspace(workspace));
  auto s = static_cast<cudaStream_t>(stream);
  Launch L = make_launch(p, a.in, a.o.data(), workspace);
  L.draft = a.draft_tokens;
  L.num_seqs = L.num_tokens / L.draft;
  L.pool = a.state_pool.empty() ? nullptr : a.state_pool.data();
  L.pool16 = a.state_pool_bf16.empty() ? nullptr : a.state_pool_bf16.data();
  L.pool_slots = static_cast<int64_t>(a.state_pool.size() + a.state_pool_bf16.size()) /
                 (p.cfg.num_heads * p.cfg.head_k * p.cfg.head_v);
  L.state_indices = a.state_indices.data();
  L.num_accepted = a.num_accepted.data();
  K3_RETURN_IF_ERROR(reset_status(p, workspace, L.num_seqs, s));
  if (L.num_seqs == 0) return Status::ok();
  const unsigned block = 256;
  check_slots_kernel<<<detail::grid_for(L.num_seqs * L.draft, block), block, 0, s>>>(
      L.state_indices, L.num_accepted, L.num_seqs, L.draft, L.pool_slots, L.seq_flags, L.status);
  K3_CUDA_TRY(cudaGetLastError(), "kda check_slots_kernel launch");
  return launch_main<Mode::kVerify>(p, L, s);
}

Status kda_status(const KdaPlan& p, const void* workspace, void* stream) {
  K3_RETURN_IF_ERROR(check_workspace(const_cast<void*>(workspace)));
  uint32_t bits = 0;
  auto s = static_cast<cudaStream_t>(stream);
  K3_CUDA_TRY(cudaMemcpyAsync(&bits, static_cast<const uint8_t*>(workspace) + p.ws_status, sizeof(bits),
                              cudaMemcpyDeviceToHost, s),
              "kda: read the status word");
  K3_CUDA_TRY(cudaStreamSynchronize(s), "kda: synchronize");
  if (bits != 0) return invalid_argument("cuda kda: the last call on this workspace reported: " + kda_status_string(bits));
  return Status::ok();
}

}  // namespace k3::cuda
