// KDA CPU backend: plans, prefill, decode and speculative verify. Threads over (sequence, head);
// each pair runs start to end on one thread with its own scratch, so the result does not depend
// on the thread count or the schedule. A chunked prefill with at least as many heads as threads
// runs chunk-major: each thread owns a contiguous range of heads and advances groups of 4 of
// them one chunk at a time, so that the q / k / v / g rows of a token are read together (head by
// head they are H * K elements apart per token: one page and one TLB miss per row).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "core/kda/kda_math.hpp"
#include "cpu/kda/kernels.hpp"
#include "k3/cpu_kda.hpp"
#include "k3/kda.hpp"
#include "k3/system.hpp"

namespace k3::cpu {

using namespace k3::kda;  // the op's types (this file implements k3/cpu_kda.hpp)

namespace kda_detail {

ScratchLayout scratch_layout(int64_t head_k, int64_t head_v) {
  ScratchLayout l;
  l.kp = round_up_pad(head_k);
  l.vp = round_up_pad(head_v);
  const int64_t big = std::max(l.kp, l.vp), c = kChunk;
  int64_t off = 0;
  auto take = [&off](int64_t n) {
    const int64_t at = off;
    off += round_up_pad(n);
    return at;
  };
  l.q = take(l.kp), l.k = take(l.kp), l.v = take(l.vp), l.g = take(l.kp), l.alpha = take(big), l.ak = take(big);
  l.vnew = take(l.vp), l.out = take(l.vp), l.bias = take(l.kp), l.tmp = take(big);
  l.vbad = take(l.vp), l.pstart = take(l.vp);
  l.cq = take(c * l.kp), l.ck = take(c * l.kp), l.cg = take(c * l.kp), l.cqg = take(c * l.kp);
  l.ckg = take(c * l.kp), l.cki = take(c * l.kp), l.ckl = take(c * l.kp);
  l.cr1 = take(c * l.kp), l.cr2 = take(c * l.kp), l.cr3 = take(c * l.kp);
  l.cv = take(c * l.vp), l.cp1 = take(c * l.vp), l.cp2 = take(c * l.vp), l.co = take(c * l.vp);
  l.cl = take(c * c), l.caqk = take(c * c), l.beta = take(c);
  l.state = take(l.kp * l.vp);
  l.total = off;
  return l;
}

}  // namespace kda_detail

namespace {

std::string num(int64_t v) { return std::to_string(v); }

const kda_detail::KernelTable& kernels_for(IsaLevel l) {
  switch (l) {
    case IsaLevel::kAvx512:
    case IsaLevel::kAvx512Bf16: return kda_detail::kernels_avx512();
    case IsaLevel::kAvx2: return kda_detail::kernels_avx2();
    default: return kda_detail::kernels_scalar();
  }
}

kda_detail::HeadCtx head_ctx(const KdaPlan& p, const KdaInputs& in, float* o, int64_t h) {
  const KdaConfig& c = p.cfg;
  kda_detail::HeadCtx x;
  x.q16 = in.q.is_bf16() ? in.q.bf16.data() : nullptr;
  x.q32 = in.q.is_bf16() ? nullptr : in.q.f32.data();
  x.k16 = in.k.is_bf16() ? in.k.bf16.data() : nullptr;
  x.k32 = in.k.is_bf16() ? nullptr : in.k.f32.data();
  x.v16 = in.v.is_bf16() ? in.v.bf16.data() : nullptr;
  x.v32 = in.v.is_bf16() ? nullptr : in.v.f32.data();
  x.g = in.g.data();
  x.beta = in.beta.data();
  const bool gated = c.gate != GateMode::kLogDecay;
  x.dt_bias = gated && !in.dt_bias.empty() ? in.dt_bias.data() + h * c.head_k : nullptr;
  x.o = o;
  x.num_heads = c.num_heads;
  x.head = h;
  x.head_k = c.head_k;
  x.head_v = c.head_v;
  x.gate = c.gate;
  x.a = gated ? std::exp(in.a_log[h]) : 0.0f;
  x.lower_bound = c.gate_lower_bound;
  x.scale = c.effective_scale();
  x.beta_logits = c.beta_logits;
  x.l2norm = c.l2norm_qk;
  x.lay = kda_detail::scratch_layout(c.head_k, c.head_v);
  return x;
}

// One head's state block (K * V floats in the configured layout) <-> the local K-first state
// [K, lds] whose columns from V to lds are zero.
void load_state(const KdaConfig& c, const float* src, float* s, int64_t lds) {
  const int64_t K = c.head_k, V = c.head_v;
  for (int64_t d = 0; d < K; ++d) {
    float* row = s + d * lds;
    if (src == nullptr) {
      std::fill(row, row + lds, 0.0f);
      continue;
    }
    if (c.layout == StateLayout::kKFirst) {
      std::copy(src + d * V, src + d * V + V, row);
    } else {
      for (int64_t j = 0; j < V; ++j) row[j] = src[j * K + d];
    }
    std::fill(row + V, row + lds, 0.0f);
  }
}

void store_state(const KdaConfig& c, const float* s, int64_t lds, float* dst) {
  const int64_t K = c.head_k, V = c.head_v;
  for (int64_t d = 0; d < K; ++d) {
    const float* row = s + d * lds;
    if (c.layout == StateLayout::kKFirst) {
      std::copy(row, row + V, dst + d * V);
    } else {
      for (int64_t j = 0; j < V; ++j) dst[j * K + d] = row[j];
    }
  }
}

// Per-thread scratch (with the state of the head being run), then the states of all heads for
// the chunk-major prefill.
int64_t workspace_floats_needed(const KdaConfig& c, int threads) {
  const kda_detail::ScratchLayout l = kda_detail::scratch_layout(c.head_k, c.head_v);
  return l.total * threads + c.num_heads * l.kp * l.vp;
}

// The workspace is bytes of any alignment: the floats start at the first 64-byte boundary.
constexpr int64_t kWsAlign = 64;
int64_t workspace_bytes_needed(const KdaConfig& c, int threads) {
  return workspace_floats_needed(c, threads) * static_cast<int64_t>(sizeof(float)) + kWsAlign;
}

Result<float*> workspace_floats(const KdaPlan& p, std::span<uint8_t> ws) {
  if (static_cast<int64_t>(ws.size()) < p.workspace_bytes) {
    return invalid_argument("workspace has " + num(static_cast<int64_t>(ws.size())) + " bytes, the plan needs " +
                            num(p.workspace_bytes) + " (plan.workspace_bytes)");
  }
  const auto at = reinterpret_cast<uintptr_t>(ws.data());
  return reinterpret_cast<float*>(ws.data() + ((kWsAlign - at % kWsAlign) % kWsAlign));
}

Status check_plan(const KdaPlan& p) {
  K3_RETURN_IF_ERROR(validate_config(p.cfg));
  if (p.threads < 1) return invalid_argument("plan.threads = " + std::to_string(p.threads) + " must be >= 1");
  if (static_cast<int>(p.isa) > static_cast<int>(best_isa_level())) {
    return unsupported(std::string("plan.isa = ") + isa_level_name(p.isa) + " is above this CPU's best level " +
                       isa_level_name(best_isa_level()));
  }
  const int64_t need = workspace_bytes_needed(p.cfg, p.threads);
  if (p.workspace_bytes < need) {
    return invalid_argument("plan.workspace_bytes = " + num(p.workspace_bytes) + " is below " + num(need) +
                            " (use k3::cpu::plan)");
  }
  return Status::ok();
}

}  // namespace

Result<KdaPlan> plan(const KdaConfig& cfg, const KdaOptions& opt) {
  K3_RETURN_IF_ERROR(validate_config(cfg));
  if (opt.threads < 0 || opt.threads > kKdaMaxThreads) {
    return invalid_argument("threads = " + std::to_string(opt.threads) + " must be in [0, " +
                            std::to_string(kKdaMaxThreads) + "] (0: all logical CPUs)");
  }
  if (opt.chunk_min_tokens < 1) {
    return invalid_argument("chunk_min_tokens = " + num(opt.chunk_min_tokens) + " must be >= 1");
  }
  KdaPlan p;
  p.cfg = cfg;
  if (opt.isa) {
    if (static_cast<int>(*opt.isa) > static_cast<int>(best_isa_level())) {
      return unsupported(std::string("isa = ") + isa_level_name(*opt.isa) + " is not supported by this CPU (best: " +
                         isa_level_name(best_isa_level()) + ")");
    }
    p.isa = *opt.isa;
  } else {
    p.isa = best_isa_level();  // a hardware fact: the library reads no K3_ISA (tools pass it in)
  }
  // 0: all logical CPUs of the machine, at most kKdaMaxThreads (a default never fails).
  p.threads = opt.threads > 0 ? opt.threads : std::min(hardware_thread_count(), kKdaMaxThreads);
  p.algorithm = opt.algorithm;
  p.chunk_min_tokens = opt.chunk_min_tokens;
  p.workspace_bytes = workspace_bytes_needed(cfg, p.threads);
  return p;
}

std::string KdaPlan::describe() const {
  return "kda cpu: H " + num(cfg.num_heads) + ", K " + num(cfg.head_k) + ", V " + num(cfg.head_v) + ", " +
         state_layout_name(cfg.layout) + ", gate " + gate_mode_name(cfg.gate) + ", isa " + isa_level_name(isa) +
         ", threads " + std::to_string(threads) + ", algorithm " + algorithm_name(algorithm) +
         (algorithm == Algorithm::kAuto ? " (chunked from " + num(chunk_min_tokens) + " tokens)" : std::string()) +
         ", workspace " + num(workspace_bytes) + " B";
}

Status prefill(const KdaPlan& p, const KdaInputs& in, const KdaOutputs& out, std::span<uint8_t> workspace) {
  K3_RETURN_IF_ERROR(check_plan(p));
  K3_ASSIGN_OR_RETURN(auto shape, validate_prefill(p.cfg, in, out));
  K3_ASSIGN_OR_RETURN(float* const ws, workspace_floats(p, workspace));
  const KdaConfig& c = p.cfg;
  const int64_t H = c.num_heads, N = shape.num_seqs, T = shape.num_tokens;
  const int64_t block = c.head_k * c.head_v;
  const kda_detail::KernelTable& kt = kernels_for(p.isa);
  const kda_detail::ScratchLayout lay = kda_detail::scratch_layout(c.head_k, c.head_v);
  const int64_t per_thread = lay.total, state_floats = lay.kp * lay.vp;
  float* head_states = ws + per_thread * p.threads;  // [H, kp, vp], chunk-major path
  auto seq_range = [&](int64_t n) {
    return std::pair<int64_t, int64_t>(in.cu_seqlens.empty() ? 0 : in.cu_seqlens[n],
                                       in.cu_seqlens.empty() ? T : in.cu_seqlens[n + 1]);
  };
  auto is_chunked = [&](int64_t n) {
    const auto [t0, t1] = seq_range(n);
    return p.algorithm == Algorithm::kChunked || (p.algorithm == Algorithm::kAuto && t1 - t0 >= p.chunk_min_tokens);
  };
  const bool chunk_major = H >= p.threads;
  // Heads advanced together: their states (4 x 64 KiB at K = V = 128) stay in L2 while the
  // token rows they read share pages.
  constexpr int64_t kHeadGroup = 4;
  // Head by head: recurrent sequences, and every sequence when there are fewer heads than threads.
#pragma omp parallel for schedule(dynamic, 1) num_threads(p.threads)
  for (int64_t u = 0; u < N * H; ++u) {
    const int64_t n = u / H, h = u % H;
    const bool chunked = is_chunked(n);
    if (chunked && chunk_major) continue;
    float* scratch = ws + omp_get_thread_num() * per_thread;
    const kda_detail::HeadCtx x = head_ctx(p, in, out.o.data(), h);
    float* s = scratch + x.lay.state;
    const auto [t0, t1] = seq_range(n);
    load_state(c, in.initial_state.empty() ? nullptr : in.initial_state.data() + u * block, s, x.lay.vp);
    if (chunked) {
      kt.chunked(x, t0, t1, s, scratch);
    } else {
      kt.recurrent(x, t0, t1, s, x.lay.vp, x.lay.vp, scratch);
    }
    if (!out.final_state.empty()) store_state(c, s, x.lay.vp, out.final_state.data() + u * block);
  }
  if (!chunk_major) return Status::ok();
  // Chunk-major: per sequence, thread i owns heads [H i / P, H (i + 1) / P) and runs chunk by
  // chunk over all of them (the same arithmetic per head as above: identical bits).
  for (int64_t n = 0; n < N; ++n) {
    if (!is_chunked(n)) continue;
    // Plain variables, not a structured binding: clang (the TSan and fuzz builds' compiler) does
    // not let an OpenMP region refer to one.
    const auto range = seq_range(n);
    const int64_t t0 = range.first, t1 = range.second;
#pragma omp parallel num_threads(p.threads)
    {
      const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t h0 = H * tid / nt, h1 = H * (tid + 1) / nt;
      float* scratch = ws + tid * per_thread;
      for (int64_t g0 = h0; g0 < h1; g0 += kHeadGroup) {
        const int64_t g1 = std::min(h1, g0 + kHeadGroup);
        for (int64_t h = g0; h < g1; ++h) {
          const int64_t u = n * H + h;
          load_state(c, in.initial_state.empty() ? nullptr : in.initial_state.data() + u * block,
                     head_states + h * state_floats, lay.vp);
        }
        for (int64_t t = t0; t < t1; t += kChunk) {
          const int64_t te = std::min(t1, t + kChunk);
          for (int64_t h = g0; h < g1; ++h) {
            kt.chunked(head_ctx(p, in, out.o.data(), h), t, te, head_states + h * state_floats, scratch);
          }
        }
        if (!out.final_state.empty()) {
          for (int64_t h = g0; h < g1; ++h) {
            store_state(c, head_states + h * state_floats, lay.vp, out.final_state.data() + (n * H + h) * block);
          }
        }
      }
    }
  }
  return Status::ok();
}

Status decode(const KdaPlan& p, const DecodeArgs& a, std::span<uint8_t> workspace) {
  K3_RETURN_IF_ERROR(check_plan(p));
  const KdaConfig& c = p.cfg;
  K3_ASSIGN_OR_RETURN(const auto shape, kda::check_decode_args(c, a));
  const int64_t N = shape.num_seqs, H = c.num_heads, block = c.head_k * c.head_v;
  K3_ASSIGN_OR_RETURN(float* const ws, workspace_floats(p, workspace));
  const kda_detail::KernelTable& kt = kernels_for(p.isa);
  const int64_t per_thread = kda_detail::scratch_layout(c.head_k, c.head_v).total;
  // K-first states whose rows are whole SIMD vectors are updated in place in the pool.
  const bool direct = c.layout == StateLayout::kKFirst && c.head_v % kda_detail::kPad == 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(p.threads)
  for (int64_t u = 0; u < N * H; ++u) {
    const int64_t n = u / H, h = u % H;
    const int64_t slot = a.state_indices[n];
    if (slot < 0) {
      std::fill(a.o.begin() + u * c.head_v, a.o.begin() + (u + 1) * c.head_v, 0.0f);
      continue;
    }
    float* scratch = ws + omp_get_thread_num() * per_thread;
    const kda_detail::HeadCtx x = head_ctx(p, a.in, a.o.data(), h);
    float* state = a.state_pool.data() + (slot * H + h) * block;
    if (direct) {
      kt.recurrent(x, n, n + 1, state, c.head_v, c.head_v, scratch);
    } else {
      float* s = scratch + x.lay.state;
      load_state(c, state, s, x.lay.vp);
      kt.recurrent(x, n, n + 1, s, x.lay.vp, x.lay.vp, scratch);
      store_state(c, s, x.lay.vp, state);
    }
  }
  return Status::ok();
}

Status verify(const KdaPlan& p, const VerifyArgs& a, std::span<uint8_t> workspace) {
  K3_RETURN_IF_ERROR(check_plan(p));
  const KdaConfig& c = p.cfg;
  K3_ASSIGN_OR_RETURN(const auto shape, kda::check_verify_args(c, a));
  const int64_t T = a.draft_tokens, N = shape.num_seqs, H = c.num_heads, block = c.head_k * c.head_v;
  K3_ASSIGN_OR_RETURN(float* const ws, workspace_floats(p, workspace));
  const kda_detail::KernelTable& kt = kernels_for(p.isa);
  const int64_t per_thread = kda_detail::scratch_layout(c.head_k, c.head_v).total;
#pragma omp parallel for schedule(dynamic, 1) num_threads(p.threads)
  for (int64_t u = 0; u < N * H; ++u) {
    const int64_t n = u / H, h = u % H;
    const int64_t read = a.state_indices[n * T + a.num_accepted[n] - 1];
    if (read < 0) {
      for (int64_t t = 0; t < T; ++t) {
        float* row = a.o.data() + ((n * T + t) * H + h) * c.head_v;
        std::fill(row, row + c.head_v, 0.0f);
      }
      continue;
    }
    float* scratch = ws + omp_get_thread_num() * per_thread;
    const kda_detail::HeadCtx x = head_ctx(p, a.in, a.o.data(), h);
    float* s = scratch + x.lay.state;
    // The read slot may also be one of this sequence's write slots: it is copied first.
    load_state(c, a.state_pool.data() + (read * H + h) * block, s, x.lay.vp);
    for (int64_t t = 0; t < T; ++t) {
      kt.recurrent(x, n * T + t, n * T + t + 1, s, x.lay.vp, x.lay.vp, scratch);
      const int64_t slot = a.state_indices[n * T + t];
      if (slot >= 0) store_state(c, s, x.lay.vp, a.state_pool.data() + (slot * H + h) * block);
    }
  }
  return Status::ok();
}

Status verify_replay(const KdaPlan& p, const ReplayVerifyArgs& a, std::span<uint8_t> workspace) {
  K3_RETURN_IF_ERROR(check_plan(p));
  const KdaConfig& c = p.cfg;
  K3_ASSIGN_OR_RETURN(const auto shape, kda::check_replay_verify_args(c, a));
  const int64_t N = shape.num_seqs, H = c.num_heads, block = c.head_k * c.head_v, Tw = a.window_tokens;
  const int64_t per_window = kda::replay_window_floats(c, Tw).value(), R = kda::replay_row_floats(c);
  K3_ASSIGN_OR_RETURN(float* const ws, workspace_floats(p, workspace));
  const kda_detail::KernelTable& kt = kernels_for(p.isa);
  const int64_t per_thread = kda_detail::scratch_layout(c.head_k, c.head_v).total;
  auto range = [&](int64_t n) {
    return a.in.cu_seqlens.empty() ? std::pair<int64_t, int64_t>(n * Tw, (n + 1) * Tw)
                                   : std::pair<int64_t, int64_t>(a.in.cu_seqlens[n], a.in.cu_seqlens[n + 1]);
  };
#pragma omp parallel for schedule(dynamic, 1) num_threads(p.threads)
  for (int64_t u = 0; u < N * H; ++u) {
    const int64_t n = u / H, h = u % H;
    const auto t = range(n);
    const int64_t t0 = t.first, t1 = t.second, slot = a.state_indices[n];
    if (slot < 0) {
      for (int64_t r = t0; r < t1; ++r) {
        float* row = a.o.data() + (r * H + h) * c.head_v;
        std::fill(row, row + c.head_v, 0.0f);
      }
      continue;
    }
    float* scratch = ws + omp_get_thread_num() * per_thread;
    kda_detail::HeadCtx x = head_ctx(p, a.in, a.o.data(), h);
    float* window = a.window_pool.data() + slot * per_window;
    x.window = window + h * R;
    float* s = scratch + x.lay.state;
    // A copy of the slot's state runs the draft tokens; the pool is not written.
    load_state(c, a.state_pool.data() + (slot * H + h) * block, s, x.lay.vp);
    kt.recurrent(x, t0, t1, s, x.lay.vp, x.lay.vp, scratch);
    if (h == 0) window[per_window - 1] = static_cast<float>(t1 - t0);
  }
  return Status::ok();
}

Status commit(const KdaPlan& p, const CommitArgs& a, std::span<uint8_t> workspace) {
  return kda_detail::commit_with_order(p, a, workspace, kda_detail::FoldOrder::kDecode);
}

namespace kda_detail {

Status commit_with_order(const KdaPlan& p, const CommitArgs& a, std::span<uint8_t> workspace, FoldOrder order) {
  K3_RETURN_IF_ERROR(check_plan(p));
  const KdaConfig& c = p.cfg;
  K3_ASSIGN_OR_RETURN(const auto shape, kda::check_commit_args(c, a));
  const int64_t N = shape.num_seqs, H = c.num_heads, block = c.head_k * c.head_v;
  const int64_t per_window = kda::replay_window_floats(c, a.window_tokens).value(), R = kda::replay_row_floats(c);
  K3_ASSIGN_OR_RETURN(float* const ws, workspace_floats(p, workspace));
  const KernelTable& kt = kernels_for(p.isa);
  const int64_t per_thread = scratch_layout(c.head_k, c.head_v).total;
  // As decode: K-first states whose rows are whole SIMD vectors are updated in place.
  const bool direct = c.layout == StateLayout::kKFirst && c.head_v % kPad == 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(p.threads)
  for (int64_t u = 0; u < N * H; ++u) {
    const int64_t n = u / H, h = u % H, slot = a.state_indices[n], accepted = a.num_accepted[n];
    if (slot < 0 || accepted == 0) continue;
    float* scratch = ws + omp_get_thread_num() * per_thread;
    HeadCtx x;  // what the fold reads: the shape and the scratch layout (the window holds the rest)
    x.num_heads = H;
    x.head = h;
    x.head_k = c.head_k;
    x.head_v = c.head_v;
    x.lay = scratch_layout(c.head_k, c.head_v);
    const float* rows = a.window_pool.data() + slot * per_window + h * R;
    float* state = a.state_pool.data() + (slot * H + h) * block;
    if (direct) {
      kt.commit(x, rows, accepted, state, c.head_v, c.head_v, scratch, order);
    } else {
      float* s = scratch + x.lay.state;
      load_state(c, state, s, x.lay.vp);
      kt.commit(x, rows, accepted, s, x.lay.vp, x.lay.vp, scratch, order);
      store_state(c, s, x.lay.vp, state);
    }
  }
  // Every named window is consumed: a second commit of it is refused until the next verify_replay.
  for (int64_t n = 0; n < N; ++n) {
    if (a.state_indices[n] >= 0) a.window_pool[static_cast<size_t>((a.state_indices[n] + 1) * per_window - 1)] = 0.0f;
  }
  return Status::ok();
}

}  // namespace kda_detail

Status prefill(const KdaConfig& cfg, const KdaInputs& in, const KdaOutputs& out, const KdaOptions& opt) {
  K3_ASSIGN_OR_RETURN(auto pl, plan(cfg, opt));
  std::vector<uint8_t> ws(static_cast<size_t>(pl.workspace_bytes));
  return prefill(pl, in, out, ws);
}

Status decode(const KdaConfig& cfg, const DecodeArgs& args, const KdaOptions& opt) {
  K3_ASSIGN_OR_RETURN(auto pl, plan(cfg, opt));
  std::vector<uint8_t> ws(static_cast<size_t>(pl.workspace_bytes));
  return decode(pl, args, ws);
}


Status verify(const KdaConfig& cfg, const VerifyArgs& args, const KdaOptions& opt) {
  K3_ASSIGN_OR_RETURN(auto pl, plan(cfg, opt));
  std::vector<uint8_t> ws(static_cast<size_t>(pl.workspace_bytes));
  return verify(pl, args, ws);
}

Status verify_replay(const KdaConfig& cfg, const ReplayVerifyArgs& args, const KdaOptions& opt) {
  K3_ASSIGN_OR_RETURN(auto pl, plan(cfg, opt));
  std::vector<uint8_t> ws(static_cast<size_t>(pl.workspace_bytes));
  return verify_replay(pl, args, ws);
}

Status commit(const KdaConfig& cfg, const CommitArgs& args, const KdaOptions& opt) {
  K3_ASSIGN_OR_RETURN(auto pl, plan(cfg, opt));
  std::vector<uint8_t> ws(static_cast<size_t>(pl.workspace_bytes));
  return commit(pl, args, ws);
}

}  // namespace k3::cpu
