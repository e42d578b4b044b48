// k3/moe.hpp — the types that define a fused-MoE problem (docs/moe.md, "the fused-MoE contract").
// Shared by the oracles (src/core/ref), the CPU backend (src/cpu) and the CUDA backend (src/cuda).
// Everything here is a plain value or a non-owning view; nothing allocates.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "k3/status.hpp"

namespace k3 {

// Precision recipe of the two GEMMs.
enum class Recipe : uint8_t {
  kW4A8,   // x quantized to MXFP8 (RCEIL, RNE) per 32 along K; activation output re-quantized to MXFP8
  kW4A16,  // x stays BF16; activation output rounded to BF16
};

enum class ActivationKind : uint8_t {
  kSiTU,    // (b tanh(g/b) sigmoid(g)) * (lb tanh(u/lb)), Kimi-K3: b 4, lb 25
  kSwiGLU,  // GPT-OSS: g = min(g, L); u = clamp(u, -L, L); g sigmoid(alpha g) (u + beta)
  kSiLU,    // silu(g) * u
};

struct Activation {
  ActivationKind kind = ActivationKind::kSiTU;
  float situ_beta = 4.0f;          // b
  float situ_linear_beta = 25.0f;  // lb
  float swiglu_alpha = 1.702f;
  float swiglu_beta = 1.0f;
  float swiglu_limit = 7.0f;
};

enum class OutDType : uint8_t { kBF16, kFP16, kFP32 };

const char* recipe_name(Recipe r);              // "w4a8" / "w4a16"
const char* activation_name(ActivationKind a);  // "situ" / "swiglu" / "silu"
const char* out_dtype_name(OutDType d);         // "bf16" / "fp16" / "fp32"
int out_dtype_size(OutDType d);                 // 2 / 2 / 4
Result<Recipe> parse_recipe(const std::string& s);
Result<ActivationKind> parse_activation(const std::string& s);
Result<OutDType> parse_out_dtype(const std::string& s);

// The expert partition (docs/distributed.md, "Expert partition"): E experts over W ranks
// (1 <= W <= E) in contiguous, balanced ranges in rank order; the first E mod W ranks hold one
// expert more. Rank r holds [first, first + count) with
//   count = E / W + (r < E mod W ? 1 : 0),   first = r * (E / W) + min(r, E mod W).
// No expert storage is padded: ranks differ by at most one expert. The arguments are the
// caller's to check (validate_moe_shape does it for a MoeShape).
struct ExpertRange {
  int first = 0;
  int count = 0;
};
constexpr ExpertRange expert_range(int num_experts, int ep_size, int ep_rank) {
  const int base = num_experts / ep_size, extra = num_experts % ep_size;
  return {ep_rank * base + (ep_rank < extra ? ep_rank : extra), base + (ep_rank < extra ? 1 : 0)};
}
// The rank holding global expert `expert` (0 <= expert < num_experts).
constexpr int expert_owner(int num_experts, int ep_size, int expert) {
  const int base = num_experts / ep_size, extra = num_experts % ep_size, split = extra * (base + 1);
  return expert < split ? expert / (base + 1) : extra + (expert - split) / base;
}

// Shape of one MoE layer on one expert-parallel rank.
struct MoeShape {
  int64_t hidden = 3584;        // K: expert input / output width (Kimi-K3 routed latent width)
  int64_t intermediate = 3072;  // N: expert intermediate width; FC1 has 2N rows
  int num_experts = 896;        // E: global experts
  int top_k = 16;
  int ep_size = 1;
  int ep_rank = 0;
  int local_experts() const { return expert_range(num_experts, ep_size, ep_rank).count; }  // E_local
  int first_local_expert() const { return expert_range(num_experts, ep_size, ep_rank).first; }
  int owner_of(int expert) const { return expert_owner(num_experts, ep_size, expert); }
};

// Checks K, N multiples of 32 (and > 0), 1 <= E <= 4096, 1 <= top_k <= min(32, E),
// 1 <= ep_size <= E, 0 <= ep_rank < ep_size. The message names the field, limit and value.
Status validate_moe_shape(const MoeShape& s);

// Expert weights of one rank in the checkpoint layout (non-owning):
//   fc1_q     [E_local, 2N, K/2]  packed E2M1, rows [gate; up] (w1 then w3)
//   fc1_scale [E_local, 2N, K/32] E8M0, linear layout
//   fc2_q     [E_local, K, N/2]   packed E2M1 (w2)
//   fc2_scale [E_local, K, N/32]  E8M0
// situ_beta / situ_linear_beta: optional per-local-expert overrides (empty = Activation's values).
struct MoeWeightsView {
  std::span<const uint8_t> fc1_q;
  std::span<const uint8_t> fc1_scale;
  std::span<const uint8_t> fc2_q;
  std::span<const uint8_t> fc2_scale;
  std::span<const float> situ_beta;
  std::span<const float> situ_linear_beta;
};

// One call's token inputs (non-owning):
//   x            [M, K] BF16 bits
//   topk_ids     [M, top_k] int32 global expert ids; -1 = masked slot
//   topk_weights [M, top_k] FP32 routing weights
struct MoeInputsView {
  int64_t m = 0;
  std::span<const uint16_t> x;
  std::span<const int32_t> topk_ids;
  std::span<const float> topk_weights;
};

// W4A8 activation rows already quantized to MXFP8 (E4M3 codes + E8M0 scales per 32 along K, the
// quantizer of the fused-MoE contract), e.g. on the rank that sent them (k3/ep.hpp):
//   codes [rows, K], scales [rows, K/32].
struct Mxfp8Rows {
  std::span<const uint8_t> codes;
  std::span<const uint8_t> scales;
};

// Everything that fixes what a backend computes.
struct MoeProblem {
  MoeShape shape;
  Recipe recipe = Recipe::kW4A8;
  Activation activation;
  OutDType out_dtype = OutDType::kBF16;
};

// Checks every span of the weights against the problem's shape.
Status validate_moe_weights(const MoeProblem& p, const MoeWeightsView& w);
// Checks the inputs against the problem's shape: M >= 0, the spans' sizes, every expert id in
// [-1, E). The message names the argument, the limit and the value.
Status validate_moe_inputs(const MoeProblem& p, const MoeInputsView& in);
// Both.
Status validate_moe_buffers(const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in);

}  // namespace k3
