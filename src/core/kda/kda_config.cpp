// KDA configuration names, limits and the shape checks every backend shares.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "core/kda/kda_math.hpp"
#include "k3/kda.hpp"

namespace k3::kda {

namespace {
std::string num(int64_t v) { return std::to_string(v); }
std::string num(size_t v) { return std::to_string(v); }
std::string num(float v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.9g", static_cast<double>(v));
  return b;
}

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

std::array<int64_t, 4> state_shape(const KdaConfig& cfg, int64_t n) {
  if (cfg.layout == StateLayout::kVFirst) return {n, cfg.num_heads, cfg.head_v, cfg.head_k};
  return {n, cfg.num_heads, cfg.head_k, cfg.head_v};
}

float KdaConfig::effective_scale() const {
  return scale > 0.0f ? scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_k)));
}

Result<int64_t> checked_product(const std::string& what, std::initializer_list<int64_t> factors) {
  int64_t n = 1;
  bool overflow = false;
  for (const int64_t f : factors) {
    if (f < 0 || __builtin_mul_overflow(n, f, &n)) overflow = true;
  }
  if (overflow) {
    std::string fs;
    for (const int64_t f : factors) fs += (fs.empty() ? "" : " x ") + num(f);
    return invalid_argument(what + ": size " + fs + " is negative or overflows 64-bit element counts");
  }
  return n;
}

Status check_buffer_bytes(const std::string& what, int64_t count, int64_t elem_bytes) {
  auto bytes = checked_product(what, {count, elem_bytes});
  if (!bytes.is_ok()) return bytes.status();
  const int64_t b = bytes.value();
  if (b > kMaxBufferBytes) {
    return out_of_range(what + " needs " + num(b) + " bytes, above the limit of " + num(kMaxBufferBytes) +
                              " bytes (kda::kMaxBufferBytes)");
  }
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) {
    int64_t phys = 0;
    if (!__builtin_mul_overflow(static_cast<int64_t>(pages), static_cast<int64_t>(page), &phys) && b > phys) {
      return out_of_range(what + " needs " + num(b) + " bytes, more than this machine's " + num(phys) +
                                " bytes of physical memory");
    }
  }
  return Status::ok();
}

Status check_cu_seqlens(std::span<const int64_t> cu, int64_t t) {
  if (cu.size() < 2) {
    return invalid_argument("cu_seqlens has " + num(cu.size()) + " entries, needs at least 2 ([N + 1], N >= 1)");
  }
  if (cu[0] != 0) return invalid_argument("cu_seqlens[0] = " + num(cu[0]) + " must be 0");
  for (size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1]) {
      return invalid_argument("cu_seqlens[" + num(i) + "] = " + num(cu[i]) + " is below cu_seqlens[" + num(i - 1) +
                              "] = " + num(cu[i - 1]) + " (must be non-decreasing)");
    }
  }
  if (cu.back() != t) {
    return invalid_argument("cu_seqlens[" + num(cu.size() - 1) + "] (the last entry) = " + num(cu.back()) +
                            " must equal the token count T = " + num(t));
  }
  return Status::ok();
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

Status check_gate_inputs(const KdaConfig& c, std::span<const float> a_log, std::span<const float> dt_bias) {
  const int64_t h = c.num_heads, dk = c.head_k;
  if (c.gate == GateMode::kLogDecay) {
    if (!a_log.empty() || !dt_bias.empty()) {
      return invalid_argument("a_log / dt_bias are given but gate = log_decay takes the decay g directly");
    }
    return Status::ok();
  }
  if (static_cast<int64_t>(a_log.size()) < h) {
    return invalid_argument("a_log has " + num(a_log.size()) + " elements, gate = " + gate_mode_name(c.gate) +
                            " needs at least H = " + num(h));
  }
  if (!dt_bias.empty()) {
    K3_RETURN_IF_ERROR(check_size("dt_bias", static_cast<int64_t>(dt_bias.size()), h * dk, "([H, K])"));
  }
  for (int64_t i = 0; i < h; ++i) {
    const float a = a_log[static_cast<size_t>(i)];
    if (!(a >= kMinALog && a <= kMaxALog)) {  // NaN fails too
      return invalid_argument("a_log[" + num(i) + "] = " + num(a) + " is outside [" + num(kMinALog) + ", " +
                              num(kMaxALog) +
                              "] (exp(a_log) must be a normal FP32 number; gate = " + gate_mode_name(c.gate) + ")");
    }
  }
  return Status::ok();
}

Result<PrefillShape> detail::validate_prefill_sizes(const KdaConfig& c, const KdaInputs& in, int64_t o_size,
                                                   int64_t final_state_size, bool host_values) {
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
  if (host_values) {
    K3_RETURN_IF_ERROR(check_gate_inputs(c, in.a_log, in.dt_bias));
  } else if (c.gate == GateMode::kLogDecay) {
    K3_RETURN_IF_ERROR(check_gate_inputs(c, in.a_log, in.dt_bias));  // reads no value: both must be empty
  } else {
    if (static_cast<int64_t>(in.a_log.size()) < h) {
      return invalid_argument("a_log has " + num(in.a_log.size()) + " elements, gate = " + gate_mode_name(c.gate) +
                              " needs at least H = " + num(h));
    }
    if (!in.dt_bias.empty()) K3_RETURN_IF_ERROR(check_size("dt_bias", static_cast<int64_t>(in.dt_bias.size()), h * dk, "([H, K])"));
  }
  if (in.cu_seqlens.empty()) {
    s.num_seqs = 1;
  } else if (!host_values) {
    if (in.cu_seqlens.size() < 2) {
      return invalid_argument("cu_seqlens has " + num(in.cu_seqlens.size()) + " entries, needs at least 2 ([N + 1], N >= 1)");
    }
    s.num_seqs = static_cast<int64_t>(in.cu_seqlens.size()) - 1;
  } else {
    K3_RETURN_IF_ERROR(check_cu_seqlens(in.cu_seqlens, t));
    s.num_seqs = static_cast<int64_t>(in.cu_seqlens.size()) - 1;
  }
  auto state_elems = checked_product("state [N, H, K, V]", {s.num_seqs, h, dk, dv});
  if (!state_elems.is_ok()) return state_elems.status();
  const int64_t state = state_elems.value();
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


namespace {

// The token inputs of decode / verify (cu_seqlens and initial_state empty): the token count.
Result<int64_t> check_pool_inputs(const KdaConfig& c, const KdaInputs& in, std::span<float> o, const char* what) {
  if (!in.cu_seqlens.empty() || !in.initial_state.empty()) {
    return invalid_argument(std::string(what) + ": cu_seqlens and initial_state must be empty (the state pool holds the states)");
  }
  K3_ASSIGN_OR_RETURN(auto s, detail::validate_prefill_sizes(c, in, static_cast<int64_t>(o.size()), 0));
  return s.num_tokens;
}


// (slot, owner) pairs of the written slots must be distinct. (A sequence's read slot is one of
// its own write slots, so no other sequence can write it.)
Status check_distinct_writes(std::vector<std::pair<int64_t, int64_t>> writes, const char* verb = "written") {
  std::sort(writes.begin(), writes.end());
  for (size_t i = 1; i < writes.size(); ++i) {
    if (writes[i].first == writes[i - 1].first) {
      return invalid_argument("state_indices: state slot " + num(writes[i].first) + " is " + verb +
                              " twice (sequences " + num(writes[i - 1].second) + " and " + num(writes[i].second) + ")");
    }
  }
  return Status::ok();
}

}  // namespace

Result<int64_t> pool_slot_count(const KdaConfig& c, int64_t elements, const char* what) {
  const int64_t per_slot = c.num_heads * c.head_k * c.head_v;
  if (elements <= 0 || elements % per_slot != 0) {
    return invalid_argument(std::string(what) + " has " + num(elements) +
                            " elements, expected a positive multiple of H * K * V = " + num(per_slot) +
                            " ([slots, H, K, V] or [slots, H, V, K])");
  }
  return elements / per_slot;
}

Result<int64_t> check_pool_choice(const KdaConfig& c, std::span<const float> f32, std::span<const uint16_t> bf16,
                                  bool bf16_ok) {
  if (bf16.empty()) return pool_slot_count(c, static_cast<int64_t>(f32.size()), "state_pool");
  if (!bf16_ok) {
    return unsupported("state_pool_bf16: BF16 state storage is an option of the cuda backend; this backend keeps "
                       "FP32 states (pass state_pool)");
  }
  if (!f32.empty()) return invalid_argument("state_pool and state_pool_bf16 are both given: pass exactly one");
  return pool_slot_count(c, static_cast<int64_t>(bf16.size()), "state_pool_bf16");
}

Result<PrefillShape> check_decode_args(const KdaConfig& c, const DecodeArgs& a, bool bf16_pool_ok) {
  K3_ASSIGN_OR_RETURN(auto tokens, check_pool_inputs(c, a.in, a.o, "decode"));
  K3_ASSIGN_OR_RETURN(auto slots, check_pool_choice(c, a.state_pool, a.state_pool_bf16, bf16_pool_ok));
  const int64_t N = tokens;
  if (static_cast<int64_t>(a.state_indices.size()) != N) {
    return invalid_argument("state_indices has " + num(static_cast<int64_t>(a.state_indices.size())) +
                            " entries, expected N = " + num(N) + " ([N])");
  }
  std::vector<std::pair<int64_t, int64_t>> writes;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t slot = a.state_indices[n];
    if (slot >= slots) {
      return out_of_range("state_indices[" + num(n) + "] = " + num(slot) + " is past the pool's " +
                          num(slots) + " slots");
    }
    if (slot >= 0) writes.emplace_back(slot, n);
  }
  K3_RETURN_IF_ERROR(check_distinct_writes(std::move(writes)));
  PrefillShape shape;
  shape.num_tokens = N;
  shape.num_seqs = N;
  return shape;
}

Result<PrefillShape> check_verify_args(const KdaConfig& c, const VerifyArgs& a, bool bf16_pool_ok) {
  K3_ASSIGN_OR_RETURN(auto tokens, check_pool_inputs(c, a.in, a.o, "verify"));
  K3_ASSIGN_OR_RETURN(auto slots, check_pool_choice(c, a.state_pool, a.state_pool_bf16, bf16_pool_ok));
  const int64_t T = a.draft_tokens;
  if (T < 1 || tokens % T != 0) {
    return invalid_argument("draft_tokens = " + num(T) + " must be >= 1 and divide the token count " +
                            num(tokens));
  }
  const int64_t N = tokens / T;
  if (static_cast<int64_t>(a.state_indices.size()) != N * T) {
    return invalid_argument("state_indices has " + num(static_cast<int64_t>(a.state_indices.size())) +
                            " entries, expected N * T = " + num(N * T) + " ([N, T])");
  }
  if (static_cast<int64_t>(a.num_accepted.size()) != N) {
    return invalid_argument("num_accepted has " + num(static_cast<int64_t>(a.num_accepted.size())) +
                            " entries, expected N = " + num(N) + " ([N])");
  }
  std::vector<std::pair<int64_t, int64_t>> writes;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t acc = a.num_accepted[n];
    if (acc < 1 || acc > T) {
      return invalid_argument("num_accepted[" + num(n) + "] = " + num(acc) + " must be in [1, T = " + num(T) + "]");
    }
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = a.state_indices[n * T + t];
      if (slot >= slots) {
        return out_of_range("state_indices[" + num(n) + ", " + num(t) + "] = " + num(slot) + " is past the pool's " +
                            num(slots) + " slots");
      }
      if (slot >= 0) writes.emplace_back(slot, n);
    }
  }
  K3_RETURN_IF_ERROR(check_distinct_writes(std::move(writes)));

  PrefillShape shape;
  shape.num_tokens = tokens;
  shape.num_seqs = N;
  return shape;
}


int64_t replay_row_floats(const KdaConfig& c) { return 2 * c.head_k + c.head_v + kReplayRowExtra; }

Result<int64_t> replay_window_floats(const KdaConfig& c, int64_t window_tokens) {
  if (window_tokens < 1 || window_tokens > kMaxWindowTokens) {
    return invalid_argument("window_tokens = " + num(window_tokens) + " must be in [1, " + num(kMaxWindowTokens) +
                            "] (draft tokens a window slot holds)");
  }
  K3_ASSIGN_OR_RETURN(const int64_t rows,
                      checked_product("window slot [Tw, H, 2K + V + 2]", {window_tokens, c.num_heads, replay_row_floats(c)}));
  return rows + 1;
}

namespace {

// The window pool against the state pool: a whole number of window slots, as many as state slots.
Status check_window_pool(const KdaConfig& c, int64_t window_tokens, int64_t window_elems, int64_t state_slots) {
  K3_ASSIGN_OR_RETURN(const int64_t per_slot, replay_window_floats(c, window_tokens));
  if (window_elems != state_slots * per_slot) {
    return invalid_argument("window_pool has " + num(window_elems) + " floats, expected " + num(state_slots) +
                            " slots (the state pool's) x " + num(per_slot) +
                            " (replay_window_floats: Tw * H * (2K + V + 2) + 1 with Tw = " + num(window_tokens) + ")");
  }
  return Status::ok();
}

// state_indices [N]: within the pool, and no slot named twice.
Status check_slot_list(std::span<const int32_t> idx, int64_t slots) {
  std::vector<std::pair<int64_t, int64_t>> named;
  for (size_t n = 0; n < idx.size(); ++n) {
    const int64_t slot = idx[n];
    if (slot >= slots) {
      return out_of_range("state_indices[" + num(static_cast<int64_t>(n)) + "] = " + num(slot) + " is past the pool's " +
                          num(slots) + " slots");
    }
    if (slot >= 0) named.emplace_back(slot, static_cast<int64_t>(n));
  }
  return check_distinct_writes(std::move(named), "named");
}

}  // namespace

Result<PrefillShape> check_replay_verify_args(const KdaConfig& c, const ReplayVerifyArgs& a) {
  if (!a.in.initial_state.empty()) {
    return invalid_argument("verify_replay: initial_state must be empty (the state pool holds the states)");
  }
  K3_ASSIGN_OR_RETURN(auto shape, detail::validate_prefill_sizes(c, a.in, static_cast<int64_t>(a.o.size()), 0));
  K3_ASSIGN_OR_RETURN(const int64_t slots, pool_slot_count(c, static_cast<int64_t>(a.state_pool.size()), "state_pool"));
  K3_RETURN_IF_ERROR(check_window_pool(c, a.window_tokens, static_cast<int64_t>(a.window_pool.size()), slots));
  const int64_t Tw = a.window_tokens;
  if (a.in.cu_seqlens.empty()) {
    if (shape.num_tokens % Tw != 0) {
      return invalid_argument("the token count " + num(shape.num_tokens) + " is not a multiple of window_tokens = " +
                              num(Tw) + " (without cu_seqlens every sequence has Tw draft tokens)");
    }
    shape.num_seqs = shape.num_tokens / Tw;
  } else {
    for (int64_t n = 0; n < shape.num_seqs; ++n) {
      const int64_t len = a.in.cu_seqlens[n + 1] - a.in.cu_seqlens[n];
      if (len > Tw) {
        return invalid_argument("sequence " + num(n) + " has " + num(len) + " draft tokens (cu_seqlens), more than window_tokens = " +
                                num(Tw));
      }
    }
  }
  if (static_cast<int64_t>(a.state_indices.size()) != shape.num_seqs) {
    return invalid_argument("state_indices has " + num(static_cast<int64_t>(a.state_indices.size())) +
                            " entries, expected N = " + num(shape.num_seqs) + " ([N])");
  }
  K3_RETURN_IF_ERROR(check_slot_list(a.state_indices, slots));
  return shape;
}

Result<PrefillShape> check_commit_args(const KdaConfig& c, const CommitArgs& a) {
  K3_ASSIGN_OR_RETURN(const int64_t slots, pool_slot_count(c, static_cast<int64_t>(a.state_pool.size()), "state_pool"));
  K3_RETURN_IF_ERROR(check_window_pool(c, a.window_tokens, static_cast<int64_t>(a.window_pool.size()), slots));
  const int64_t N = static_cast<int64_t>(a.state_indices.size());
  if (static_cast<int64_t>(a.num_accepted.size()) != N) {
    return invalid_argument("num_accepted has " + num(static_cast<int64_t>(a.num_accepted.size())) +
                            " entries, expected N = " + num(N) + " (one per state_indices entry)");
  }
  K3_RETURN_IF_ERROR(check_slot_list(a.state_indices, slots));
  const int64_t per_slot = replay_window_floats(c, a.window_tokens).value();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t acc = a.num_accepted[n];
    if (acc < 0 || acc > a.window_tokens) {
      return invalid_argument("num_accepted[" + num(n) + "] = " + num(acc) + " must be in [0, window_tokens = " +
                              num(a.window_tokens) + "]");
    }
    const int64_t slot = a.state_indices[n];
    if (slot < 0) continue;
    const float held = a.window_pool[static_cast<size_t>((slot + 1) * per_slot - 1)];
    if (!(held >= 0.0f && held <= static_cast<float>(a.window_tokens)) || held != std::floor(held)) {
      return invalid_argument("window slot " + num(slot) + " holds a draft-token count of " + std::to_string(held) +
                              ", not an integer in [0, window_tokens = " + num(a.window_tokens) +
                              "] (a window pool written by something other than verify_replay, or another Tw)");
    }
    if (acc > static_cast<int64_t>(held)) {
      return invalid_argument("num_accepted[" + num(n) + "] = " + num(acc) + " exceeds the " +
                              num(static_cast<int64_t>(held)) + " draft tokens verified into window slot " + num(slot) +
                              " and not yet committed (a window is committed once, after its verify_replay)");
    }
  }
  PrefillShape shape;
  shape.num_tokens = 0;
  shape.num_seqs = N;
  return shape;
}

}  // namespace k3::kda
