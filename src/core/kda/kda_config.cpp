// KDA configuration names, limits and the shape checks every backend shares.
#include <cmath>
#include <string>

#include "core/kda/kda_math.hpp"
#include "k3/kda.hpp"

namespace k3::kda {

namespace {
std::string num(int64_t v) { return std::to_string(v); }
std::string num(size_t v) { return std::to_string(v); }

Status check_size(const char* name, int64_t actual, int64_t expected, const char* shape) {
  if (actual != expected) {
    return invalid_argument(std::string(name) + " has " + num(actual) + " elements, expected " + num(expected) + " " +
                            shape);
  }
  return Status::ok();
}
Status check_act(const char* name, const ActSpan& a) {
  if (!a.bf16.empty() && !a.f32.empty()) {
    return invalid_argument(std::string(name) + ": set either the bf16 or the f32 span, not both");
  }
  return Status::ok();
}
}  // namespace

const char* gate_mode_name(GateMode m) {
  switch (m) {
    case GateMode::kLogDecay: return "log_decay";
    case GateMode::kSafe: return "safe";
    case GateMode::kSoftplus: return "softplus";
  }
  return "?";
}
const char* state_layout_name(StateLayout l) { return l == StateLayout::kKFirst ? "k_first" : "v_first"; }
const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::kAuto: return "auto";
    case Algorithm::kRecurrent: return "recurrent";
    case Algorithm::kChunked: return "chunked";
  }
  return "?";
}
Result<GateMode> parse_gate_mode(const std::string& s) {
  for (GateMode m : {GateMode::kLogDecay, GateMode::kSafe, GateMode::kSoftplus}) {
    if (s == gate_mode_name(m)) return m;
  }
  return invalid_argument("gate '" + s + "' is unknown (expected log_decay, safe or softplus)");
}
Result<StateLayout> parse_state_layout(const std::string& s) {
  if (s == "k_first") return StateLayout::kKFirst;
  if (s == "v_first") return StateLayout::kVFirst;
  return invalid_argument("state layout '" + s + "' is unknown (expected k_first or v_first)");
}
Result<Algorithm> parse_algorithm(const std::string& s) {
  for (Algorithm a : {Algorithm::kAuto, Algorithm::kRecurrent, Algorithm::kChunked}) {
    if (s == algorithm_name(a)) return a;
  }
  return invalid_argument("algorithm '" + s + "' is unknown (expected auto, recurrent or chunked)");
}

float KdaConfig::effective_scale() const {
  return scale > 0.0f ? scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_k)));
}

Status validate_config(const KdaConfig& c) {
  if (c.num_heads < 1 || c.num_heads > kMaxHeads) {
    return invalid_argument("num_heads = " + num(c.num_heads) + " must be in [1, " + num(kMaxHeads) + "]");
  }
  if (c.head_k < 1 || c.head_k > kMaxHeadDim) {
    return invalid_argument("head_k = " + num(c.head_k) + " must be in [1, " + num(kMaxHeadDim) + "]");
  }
  if (c.head_v < 1 || c.head_v > kMaxHeadDim) {
    return invalid_argument("head_v = " + num(c.head_v) + " must be in [1, " + num(kMaxHeadDim) + "]");
  }
  if (!(c.gate_lower_bound < 0.0f) || !std::isfinite(c.gate_lower_bound)) {
    return invalid_argument("gate_lower_bound = " + std::to_string(c.gate_lower_bound) + " must be finite and < 0");
  }
  if (!(c.scale >= 0.0f) || !std::isfinite(c.scale)) {
    return invalid_argument("scale = " + std::to_string(c.scale) + " must be finite and >= 0 (0: K^-0.5)");
  }
  return Status::ok();
}

Result<PrefillShape> detail::validate_prefill_sizes(const KdaConfig& c, const KdaInputs& in, int64_t o_size,
                                                   int64_t final_state_size) {
  K3_RETURN_IF_ERROR(validate_config(c));
  K3_RETURN_IF_ERROR(check_act("q", in.q));
  K3_RETURN_IF_ERROR(check_act("k", in.k));
  K3_RETURN_IF_ERROR(check_act("v", in.v));
  const int64_t h = c.num_heads, dk = c.head_k, dv = c.head_v;
  if (in.q.size() % (h * dk) != 0) {
    return invalid_argument("q has " + num(in.q.size()) + " elements, not a multiple of H * K = " + num(h * dk) +
                            " ([T, H, K])");
  }
  PrefillShape s;
  s.num_tokens = in.q.size() / (h * dk);
  const int64_t t = s.num_tokens;
  K3_RETURN_IF_ERROR(check_size("k", in.k.size(), t * h * dk, "([T, H, K])"));
  K3_RETURN_IF_ERROR(check_size("v", in.v.size(), t * h * dv, "([T, H, V])"));
  K3_RETURN_IF_ERROR(check_size("g", static_cast<int64_t>(in.g.size()), t * h * dk, "([T, H, K])"));
  K3_RETURN_IF_ERROR(check_size("beta", static_cast<int64_t>(in.beta.size()), t * h, "([T, H])"));
  if (c.gate == GateMode::kLogDecay) {
    if (!in.a_log.empty() || !in.dt_bias.empty()) {
      return invalid_argument("a_log / dt_bias are given but gate = log_decay takes the decay g directly");
    }
  } else {
    if (static_cast<int64_t>(in.a_log.size()) < h) {
      return invalid_argument("a_log has " + num(in.a_log.size()) + " elements, gate = " + gate_mode_name(c.gate) +
                              " needs at least H = " + num(h));
    }
    if (!in.dt_bias.empty()) {
      K3_RETURN_IF_ERROR(check_size("dt_bias", static_cast<int64_t>(in.dt_bias.size()), h * dk, "([H, K])"));
    }
  }
  if (in.cu_seqlens.empty()) {
    s.num_seqs = 1;
  } else {
    const auto& cu = in.cu_seqlens;
    if (cu.size() < 2) return invalid_argument("cu_seqlens has " + num(cu.size()) + " entries, needs at least 2");
    if (cu[0] != 0) return invalid_argument("cu_seqlens[0] = " + num(cu[0]) + " must be 0");
    for (size_t i = 1; i < cu.size(); ++i) {
      if (cu[i] < cu[i - 1]) {
        return invalid_argument("cu_seqlens[" + num(i) + "] = " + num(cu[i]) + " is below cu_seqlens[" + num(i - 1) +
                                "] = " + num(cu[i - 1]) + " (must be non-decreasing)");
      }
    }
    if (cu.back() != t) {
      return invalid_argument("cu_seqlens[N] = " + num(cu.back()) + " must equal the token count T = " + num(t));
    }
    s.num_seqs = static_cast<int64_t>(cu.size()) - 1;
  }
  const int64_t state = s.num_seqs * h * dk * dv;
  const char* sshape = c.layout == StateLayout::kKFirst ? "([N, H, K, V])" : "([N, H, V, K])";
  if (!in.initial_state.empty()) {
    K3_RETURN_IF_ERROR(check_size("initial_state", static_cast<int64_t>(in.initial_state.size()), state, sshape));
  }
  K3_RETURN_IF_ERROR(check_size("o", o_size, t * h * dv, "([T, H, V])"));
  if (final_state_size != 0) K3_RETURN_IF_ERROR(check_size("final_state", final_state_size, state, sshape));
  return s;
}

Result<PrefillShape> validate_prefill(const KdaConfig& c, const KdaInputs& in, const KdaOutputs& out) {
  return detail::validate_prefill_sizes(c, in, static_cast<int64_t>(out.o.size()),
                                        static_cast<int64_t>(out.final_state.size()));
}

}  // namespace k3::kda
