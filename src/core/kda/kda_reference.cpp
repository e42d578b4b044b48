// Token-recurrent KDA references in FP64 and FP32: the recurrence of docs/kda.md, literally.
// Threads over (sequence, head); each pair is computed by one thread in token order, so the
// results do not depend on the thread count.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/kda/kda_math.hpp"
#include "k3/kda.hpp"

namespace k3::kda {
namespace {

template <typename T>
void reference_unit(const KdaConfig& c, const KdaInputs& in, int64_t n, int64_t h, int64_t t0, int64_t t1, T* o,
                    T* final_state) {
  const int64_t H = c.num_heads, K = c.head_k, V = c.head_v;
  const bool kfirst = c.layout == StateLayout::kKFirst;
  std::vector<T> s(K * V, T(0)), q(K), k(K), v(V), g(K), kv(V);  // s: [K, V]
  std::vector<char> vbad(V);
  const int64_t state_off = (n * H + h) * K * V;
  if (!in.initial_state.empty()) {
    for (int64_t d = 0; d < K; ++d) {
      for (int64_t j = 0; j < V; ++j) {
        s[d * V + j] = static_cast<T>(in.initial_state[state_off + (kfirst ? d * V + j : j * K + d)]);
      }
    }
  }
  const bool gated = c.gate != GateMode::kLogDecay;
  const T a = gated ? std::exp(static_cast<T>(in.a_log[h])) : T(0);
  const T lb = static_cast<T>(c.gate_lower_bound);
  // K^-0.5 in the reference's own precision (effective_scale() is its FP32 rounding).
  const T scale = c.scale > 0.0f ? static_cast<T>(c.scale) : T(1) / std::sqrt(static_cast<T>(K));
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t qk_off = (t * H + h) * K, v_off = (t * H + h) * V;
    // Non-finite inputs (docs/kda.md, "Non-finite values"): the token is computed with them
    // replaced by 0 and the entries that depend on them are set to NaN below.
    bool q_bad = false, whole = false;
    for (int64_t d = 0; d < K; ++d) {
      q[d] = static_cast<T>(detail::act_at(in.q, qk_off + d));
      k[d] = static_cast<T>(detail::act_at(in.k, qk_off + d));
      q_bad = q_bad || !std::isfinite(q[d]);
      whole = whole || !std::isfinite(k[d]);
    }
    T qq = 0, kk = 0;
    for (int64_t d = 0; d < K; ++d) {
      if (q_bad) q[d] = T(0);
      if (whole) k[d] = T(0);
      qq += q[d] * q[d];
      kk += k[d] * k[d];
    }
    // L2 normalization with the epsilon inside the square root (fla's l2norm).
    const T qn = c.l2norm_qk ? T(1) / std::sqrt(qq + T(1e-6)) : T(1);
    const T kn = c.l2norm_qk ? T(1) / std::sqrt(kk + T(1e-6)) : T(1);
    for (int64_t d = 0; d < K; ++d) {
      q[d] = q[d] * qn * scale;
      k[d] = k[d] * kn;
      const T bias = gated && !in.dt_bias.empty() ? static_cast<T>(in.dt_bias[h * K + d]) : T(0);
      g[d] = detail::log_decay<T>(c.gate, static_cast<T>(in.g[qk_off + d]), a, bias, lb);
      whole = whole || detail::decay_poisons(g[d]);
    }
    for (int64_t j = 0; j < V; ++j) {
      v[j] = static_cast<T>(detail::act_at(in.v, v_off + j));
      vbad[j] = !std::isfinite(v[j]);
      if (vbad[j]) v[j] = T(0);
    }
    const T braw = static_cast<T>(in.beta[t * H + h]);
    T beta = c.beta_logits ? detail::sigmoid<T>(braw) : braw;
    whole = whole || !std::isfinite(beta);
    if (whole) {  // k, the decay or beta: the whole write is poisoned
      for (int64_t d = 0; d < K; ++d) k[d] = g[d] = T(0);
      beta = T(0);
    }
    // Decay first, then the prediction of v by the decayed state.
    for (int64_t j = 0; j < V; ++j) kv[j] = T(0);
    for (int64_t d = 0; d < K; ++d) {
      const T alpha = std::exp(g[d]);
      for (int64_t j = 0; j < V; ++j) {
        s[d * V + j] *= alpha;
        kv[j] += s[d * V + j] * k[d];
      }
    }
    for (int64_t j = 0; j < V; ++j) {
      v[j] = beta * (v[j] - kv[j]);  // v'
      // A poisoned column: a non-finite v, the whole write, or a non-finite state entry in the
      // column (it makes the prediction kv[j] non-finite). NaN in v' makes the column of the state
      // and of o NaN below.
      if (whole || vbad[j] || !std::isfinite(v[j])) v[j] = nan;
    }
    // Delta-rule write, then the output, which includes this token's write.
    for (int64_t j = 0; j < V; ++j) kv[j] = T(0);
    for (int64_t d = 0; d < K; ++d) {
      for (int64_t j = 0; j < V; ++j) {
        s[d * V + j] += k[d] * v[j];
        kv[j] += s[d * V + j] * q[d];
      }
    }
    for (int64_t j = 0; j < V; ++j) o[v_off + j] = q_bad ? nan : kv[j];
  }
  if (final_state != nullptr) {
    for (int64_t d = 0; d < K; ++d) {
      for (int64_t j = 0; j < V; ++j) final_state[state_off + (kfirst ? d * V + j : j * K + d)] = s[d * V + j];
    }
  }
}

template <typename T>
void reference_all(const KdaConfig& c, const KdaInputs& in, const PrefillShape& s, T* o, T* final_state,
                   int threads) {
  const int64_t units = s.num_seqs * c.num_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t n = u / c.num_heads, h = u % c.num_heads;
    const int64_t t0 = in.cu_seqlens.empty() ? 0 : in.cu_seqlens[n];
    const int64_t t1 = in.cu_seqlens.empty() ? s.num_tokens : in.cu_seqlens[n + 1];
    reference_unit<T>(c, in, n, h, t0, t1, o, final_state);
  }
}

// 0: all logical CPUs (the library reads no K3_NUM_THREADS).
Result<int> resolve_threads(int threads) {
  if (threads < 0) {
    return invalid_argument("threads = " + std::to_string(threads) + " must be >= 0 (0: all logical CPUs)");
  }
  return threads > 0 ? threads : hardware_thread_count();
}

}  // namespace

Status reference_fp64(const KdaConfig& cfg, const KdaInputs& in, std::span<double> o, std::span<double> final_state,
                      int threads) {
  K3_ASSIGN_OR_RETURN(const int nt, resolve_threads(threads));
  auto shape = detail::validate_prefill_sizes(cfg, in, static_cast<int64_t>(o.size()),
                                             static_cast<int64_t>(final_state.size()));
  if (!shape.is_ok()) return shape.status();
  reference_all<double>(cfg, in, shape.value(), o.data(), final_state.empty() ? nullptr : final_state.data(), nt);
  return Status::ok();
}

Status reference_fp32(const KdaConfig& cfg, const KdaInputs& in, const KdaOutputs& out, int threads) {
  K3_ASSIGN_OR_RETURN(const int nt, resolve_threads(threads));
  auto shape = validate_prefill(cfg, in, out);
  if (!shape.is_ok()) return shape.status();
  reference_all<float>(cfg, in, shape.value(), out.o.data(), out.final_state.empty() ? nullptr : out.final_state.data(),
                       nt);
  return Status::ok();
}

}  // namespace k3::kda
