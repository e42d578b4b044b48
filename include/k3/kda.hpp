// k3/kda.hpp — Kimi Delta Attention (KDA) core: the op's types, checks and references (docs/kda.md).
// The CPU backend is in k3/cpu_kda.hpp (k3::cpu::plan / prefill / decode / verify).
//
// Per head (key dim K, value dim V, FP32 state S [K, V]) and token t:
//   S <- Diag(exp(g_t)) S;  v' = beta_t (v_t - S^T k_t);  S <- S + k_t v'^T;  o_t = S^T (scale q_t)
// with q, k L2-normalized per head (x / sqrt(sum x^2 + 1e-6)) and scale = K^-0.5 by default.
//
// Every type here is a plain value or a non-owning view; tensors are token-major and dense.
// A backend is used in two steps: a plan (checks the configuration once, fixes the thread count,
// SIMD level and workspace size) and run calls on caller-owned buffers. The CPU prefill does not
// allocate when given a workspace (decode / verify allocate only the slot list they check for
// duplicates); a CUDA backend can offer the same calls with device spans.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include "k3/status.hpp"
#include "k3/system.hpp"

namespace k3::kda {

// How the gate input tensor `g` of KdaInputs is turned into the log-space decay g_t (<= 0).
enum class GateMode : uint8_t {
  kLogDecay,  // g is already the log-space decay (used as is)
  kSafe,      // Kimi-K3: g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias[h, :])), lb = gate_lower_bound
  kSoftplus,  // Kimi-Linear: g = -exp(A_log[h]) * softplus(f + dt_bias[h, :]) (softplus(x) = x for x > 20)
};

// Layout of every state tensor (initial, final, pool slots).
enum class StateLayout : uint8_t {
  kKFirst,  // [.., H, K, V] (fla default)
  kVFirst,  // [.., H, V, K] (FlashKDA)
};

enum class Algorithm : uint8_t {
  kAuto,       // chunked for sequences of at least KdaOptions::chunk_min_tokens tokens, else recurrent
  kRecurrent,  // token by token
  kChunked,    // chunks of kChunk tokens (docs/kda.md)
};

const char* gate_mode_name(GateMode m);        // "log_decay", "safe", "softplus"
const char* state_layout_name(StateLayout l);  // "k_first", "v_first"
const char* algorithm_name(Algorithm a);       // "auto", "recurrent", "chunked"
Result<GateMode> parse_gate_mode(const std::string& s);
Result<StateLayout> parse_state_layout(const std::string& s);
Result<Algorithm> parse_algorithm(const std::string& s);

// Limits of the configuration (checked by validate_config).
inline constexpr int64_t kMaxHeads = 1024;
inline constexpr int64_t kMaxHeadDim = 512;
// Log-space decays below this are clamped to it: exp() of it is 0 in FP32 and FP64 alike, and
// the clamp keeps differences of cumulative sums finite (no -inf - -inf).
inline constexpr float kMinLogDecay = -1.0e4f;
// Non-finite values (docs/kda.md, "Non-finite values"): a log decay above this (NaN and +inf
// included) poisons the token's write like a non-finite k or beta: exp(88) = 1.65e38 is the
// largest decay factor every backend represents (exp overflows FP32 at 88.72).
inline constexpr float kMaxLogDecay = 88.0f;
// A_log (the gated modes) must lie in this range, so that exp(A_log) is a normal FP32 number in
// every backend (refused otherwise: validate_prefill names the entry and its value).
inline constexpr float kMinALog = -87.0f;
inline constexpr float kMaxALog = 88.0f;
// Tokens per chunk of the chunked CPU prefill.
inline constexpr int64_t kChunk = 16;

struct KdaConfig {
  int64_t num_heads = 96;  // H
  int64_t head_k = 128;    // K
  int64_t head_v = 128;    // V
  GateMode gate = GateMode::kSafe;
  float gate_lower_bound = -5.0f;  // lb of the safe gate (< 0)
  bool beta_logits = true;         // beta holds logits b (beta = sigmoid(b)); else beta itself
  bool l2norm_qk = true;           // L2-normalize q and k inside (false: used as given)
  float scale = 0.0f;              // output scale; 0 selects K^-0.5
  StateLayout layout = StateLayout::kKFirst;
  float effective_scale() const;
};

// The shape of n states in the config's layout: [n, H, K, V] (k_first) or [n, H, V, K] (v_first).
// Every state tensor (initial, final, a pool of n slots) has it.
std::array<int64_t, 4> state_shape(const KdaConfig& cfg, int64_t n);

// Largest buffer (a state, an input, an output, in bytes) k3 allocates for KDA from sizes it is
// given (a file's shapes, command-line flags); the machine's physical memory lowers it further.
inline constexpr int64_t kMaxBufferBytes = int64_t{64} << 30;  // 64 GiB

// Checks that `count` elements of `elem_bytes` each can be allocated: the product does not
// overflow, and is at most kMaxBufferBytes and the physical memory (sysconf). Call it before
// allocating a buffer whose size comes from input; the error names `what`, the bytes and the limit.
Status check_buffer_bytes(const std::string& what, int64_t count, int64_t elem_bytes);

// count = a * b * ... with overflow checks; the error names `what` and the factors.
Result<int64_t> checked_product(const std::string& what, std::initializer_list<int64_t> factors);

// Checks variable-length boundaries for T tokens: at least 2 entries, cu_seqlens[0] = 0,
// non-decreasing, last = T. The error names the offending index and the values.
Status check_cu_seqlens(std::span<const int64_t> cu_seqlens, int64_t num_tokens);

// Checks 1 <= H <= kMaxHeads, 1 <= K, V <= kMaxHeadDim, lb < 0 and finite, scale >= 0 and finite.
Status validate_config(const KdaConfig& cfg);

// The gate's parameters for cfg.gate: none for log_decay; for the gated modes a_log [H] (each in
// [kMinALog, kMaxALog]) and an optional dt_bias [H, K]. Every backend's entry calls this.
Status check_gate_inputs(const KdaConfig& cfg, std::span<const float> a_log, std::span<const float> dt_bias);

// A read-only activation tensor, BF16 (bit patterns) or FP32: set exactly one of the spans.
// Both empty means an empty tensor (T = 0).
struct ActSpan {
  std::span<const uint16_t> bf16;
  std::span<const float> f32;
  static ActSpan of(std::span<const uint16_t> s) { return {s, {}}; }
  static ActSpan of(std::span<const float> s) { return {{}, s}; }
  bool is_bf16() const { return !bf16.empty(); }
  int64_t size() const { return static_cast<int64_t>(bf16.empty() ? f32.size() : bf16.size()); }
};

// Inputs of a prefill (T tokens of N sequences flattened; sequence n owns tokens
// [cu_seqlens[n], cu_seqlens[n+1])). Decode and verify use the same struct with cu_seqlens and
// initial_state empty.
struct KdaInputs {
  ActSpan q;                             // [T, H, K]
  ActSpan k;                             // [T, H, K]
  ActSpan v;                             // [T, H, V]
  std::span<const float> g;              // [T, H, K] log-space decay (kLogDecay) or gate input f
  std::span<const float> beta;           // [T, H] logits (beta_logits) or beta
  std::span<const float> a_log;          // [>= H] (kSafe, kSoftplus; first H used), else empty
  std::span<const float> dt_bias;        // [H, K] (kSafe, kSoftplus; empty = zeros), else empty
  std::span<const int64_t> cu_seqlens;   // [N + 1]: 0 = c[0] <= c[1] <= ... <= c[N] = T; empty: N = 1
  std::span<const float> initial_state;  // [N, H, K, V] or [N, H, V, K] FP32; empty: zeros
};

struct KdaOutputs {
  std::span<float> o;            // [T, H, V] FP32
  std::span<float> final_state;  // [N, H, K, V] or [N, H, V, K] FP32; empty: not returned
};

// Shape facts of a checked prefill call.
struct PrefillShape {
  int64_t num_tokens = 0;  // T
  int64_t num_seqs = 0;    // N
};
// Checks every span against the configuration; the message names the tensor, the expected and
// the actual size (or the offending cu_seqlens entry), and a_log[h] (h < H) against
// [kMinALog, kMaxALog]. Non-finite values in the other tensors are not errors: they follow the
// policy of docs/kda.md ("Non-finite values"), the same in every backend.
Result<PrefillShape> validate_prefill(const KdaConfig& cfg, const KdaInputs& in, const KdaOutputs& out);

// ---- references (token-recurrent, exactly the recurrence above) ----------------------------
// Threads over (sequence, head): `threads`, 0 = all logical CPUs (hardware_thread_count()); the
// results do not depend on the thread count.
// FP64: every input widened exactly, all arithmetic in double.
Status reference_fp64(const KdaConfig& cfg, const KdaInputs& in, std::span<double> o /* [T, H, V] */,
                      std::span<double> final_state /* like KdaOutputs::final_state; may be empty */,
                      int threads = 0);
// FP32: all arithmetic in float, in the order of the recurrence.
Status reference_fp32(const KdaConfig& cfg, const KdaInputs& in, const KdaOutputs& out, int threads = 0);

// ---- decode and speculative verify arguments (every backend) --------------------------------

// Decode, one token per sequence, state pool updated in place. Slots not named are not touched.
struct DecodeArgs {
  KdaInputs in;                            // N tokens ([N, H, K] ...); cu_seqlens, initial_state empty
  std::span<float> state_pool;             // [slots, H, K, V] or [slots, H, V, K] FP32
  std::span<const int32_t> state_indices;  // [N] distinct slots; < 0: padding row (skipped, o row = 0)
  std::span<float> o;                      // [N, H, V]
  // BF16 state storage (FP32 math), instead of state_pool: an option of the cuda backend (the cpu
  // backend refuses it). States are widened exactly on load and rounded to nearest-even on store.
  std::span<uint16_t> state_pool_bf16 = {};  // [slots, H, K, V] or [slots, H, V, K] BF16
};
// Speculative verify: T draft tokens per sequence (sequence n owns tokens [n T, (n + 1) T)).
// Reads the state of slot state_indices[n, num_accepted[n] - 1], runs the T tokens and writes
// the state after token t to slot state_indices[n, t] (< 0: not stored). A sequence whose read
// slot is < 0 is skipped (its o rows are 0). Written slots must be distinct over the batch (the
// read slot is one of the sequence's own, so it is read before it is overwritten).
struct VerifyArgs {
  KdaInputs in;                            // [N * T, H, *]; cu_seqlens, initial_state empty
  int64_t draft_tokens = 0;                // T >= 1
  std::span<float> state_pool;             // [slots, H, K, V] or [slots, H, V, K] FP32
  std::span<const int32_t> state_indices;  // [N, T]
  std::span<const int32_t> num_accepted;   // [N], each in [1, T]
  std::span<float> o;                      // [N * T, H, V]
  std::span<uint16_t> state_pool_bf16 = {};  // BF16 state storage instead of state_pool (as DecodeArgs)
};

// ---- speculative verify without snapshots: the replay window and the commit -------------------
// verify_replay runs each sequence's draft tokens from its slot's state without writing any state:
// it returns the outputs and keeps, per token and head, the inputs the state update needs (after
// the L2 norm, the gate and the non-finite policy) in a caller-owned window pool indexed like the
// state pool. commit then folds the first num_accepted tokens of each window into the state, in
// place, with the arithmetic of decode in its order: the state is bit-identical to decode run
// token by token on the accepted tokens (docs/kda.md, "Speculative decoding").
//
// Window slot (FP32, replay_window_floats(cfg, Tw) floats): rows [Tw, H, R] with
// R = 2K + V + 2 = [k (L2-normalized) K | alpha = exp(g) K | v V | beta | poisoned (0 or 1)], then
// one float holding the number of draft tokens verified and not yet committed (an integer; 0 in a
// zero-filled pool). commit sets it back to 0, so a window is committed at most once.
inline constexpr int64_t kReplayRowExtra = 2;     // beta, poisoned
inline constexpr int64_t kMaxWindowTokens = 64;  // the largest window_tokens (draft tokens per window slot)
int64_t replay_row_floats(const KdaConfig& cfg);                           // R = 2K + V + 2
Result<int64_t> replay_window_floats(const KdaConfig& cfg, int64_t window_tokens);  // Tw * H * R + 1

struct ReplayVerifyArgs {
  // [tokens, H, *]; initial_state empty. cu_seqlens [N + 1]: sequence n's draft tokens are
  // [c[n], c[n + 1]), each at most window_tokens (varlen); empty: window_tokens tokens each.
  KdaInputs in;
  int64_t window_tokens = 0;               // Tw >= 1: the capacity of a window slot
  std::span<const float> state_pool;       // [slots, H, K, V] or [slots, H, V, K] FP32, read only
  std::span<const int32_t> state_indices;  // [N] distinct; < 0: padding (o rows 0, no window written)
  std::span<float> window_pool;            // [slots, replay_window_floats(cfg, Tw)]: as many slots as state_pool
  std::span<float> o;                      // [tokens, H, V]
};
struct CommitArgs {
  int64_t window_tokens = 0;               // Tw of the verify_replay that filled the windows
  std::span<float> state_pool;             // [slots, H, K, V] or [slots, H, V, K] FP32, updated in place
  std::span<float> window_pool;            // as ReplayVerifyArgs; each named window's count is reset to 0
  std::span<const int32_t> state_indices;  // [N] distinct; < 0: padding (skipped)
  std::span<const int32_t> num_accepted;   // [N], each in [0, the tokens verified into that window]
};
Result<PrefillShape> check_replay_verify_args(const KdaConfig& cfg, const ReplayVerifyArgs& args);
Result<PrefillShape> check_commit_args(const KdaConfig& cfg, const CommitArgs& args);

// Decode / verify argument checks every backend's host entry runs (sizes, then the values:
// state_indices within the pool's slots, written slots distinct over the batch, num_accepted in
// [1, T]). Exactly one of state_pool / state_pool_bf16; the BF16 pool only where bf16_pool_ok (the
// cuda backend). Returns num_tokens = the token count and num_seqs = N.
Result<PrefillShape> check_decode_args(const KdaConfig& cfg, const DecodeArgs& args, bool bf16_pool_ok = false);
Result<PrefillShape> check_verify_args(const KdaConfig& cfg, const VerifyArgs& args, bool bf16_pool_ok = false);
// The pool's slot count from its element count: a positive multiple of H * K * V; names `what`.
Result<int64_t> pool_slot_count(const KdaConfig& cfg, int64_t elements, const char* what);
// Which pool a decode / verify call uses: exactly one of the FP32 and the BF16 pool, the BF16 one
// only where bf16_ok. Returns its slot count.
Result<int64_t> check_pool_choice(const KdaConfig& cfg, std::span<const float> f32, std::span<const uint16_t> bf16,
                                  bool bf16_ok);
}  // namespace k3::kda
