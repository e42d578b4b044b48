// k3/routing.hpp — the Kimi-K3 / DeepSeek-V3 ("noaux_tc") router (docs/moe.md, "Routing").
//
// Per token, all in FP32:
//   s      = sigmoid(logits) = 1 / (1 + exp(-logit))        per expert (k3::sigmoid_f32)
//   choice = s + e_score_correction_bias                      the bias only ranks experts
//   groups (n_group > 1): experts [g*E/n_group, (g+1)*E/n_group) form group g; its score is the
//          sum of its two best choices (the best one if a group holds one expert); the topk_group
//          best groups are kept and experts of other groups are never selected
//   ids    = the top_k best choices, best first; equal choices: the LOWER expert index wins
//          (-0.0 and +0.0 are equal)
//   w      = s[ids]; if renormalize: w = w / (sum(w) + 1e-20), sum in slot order
//   w      = w * routed_scaling_factor
//
// Non-finite logits / biases (a defined result, identical for every caller):
//   * +Inf logit -> s = 1, -Inf logit -> s = 0: ordinary values, ranked like any other.
//   * A NaN choice (NaN logit, NaN bias, or Inf + -Inf) is NEVER selected. If fewer than top_k
//     experts (of the kept groups) have a non-NaN choice, the remaining slots, at the end of the
//     row, are masked: id -1, weight 0. A token whose logits are all NaN gets only masked slots
//     (the fused MoE then writes a zero row for it). The renormalization sums the selected
//     (non-NaN) scores only.
//   * Groups rank by the same rule: a group with no non-NaN choice has a NaN score, ranks last
//     and contributes no expert.
//   * +-Inf choices (from an infinite bias) rank first / last among the non-NaN ones.
//
// Any 1 <= E <= 4096 and 1 <= top_k <= min(32, E). Tokens are independent: OpenMP over tokens,
// bit-identical for any thread count.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "k3/status.hpp"

namespace k3 {

struct RoutingConfig {
  int num_experts = 896;
  int top_k = 16;
  int n_group = 1;
  int topk_group = 1;
  bool renormalize = true;
  float routed_scaling_factor = 1.0f;
};

inline constexpr int kMaxRoutingExperts = 4096;
inline constexpr int kMaxTopK = 32;
inline constexpr float kRenormalizeEpsilon = 1e-20f;

// Checks every field (ranges above, n_group divides E, 1 <= topk_group <= n_group,
// topk_group * E / n_group >= top_k, finite scaling factor). Names the field, limit and value.
Status validate_routing_config(const RoutingConfig& cfg);

// logits [M, E] FP32, bias [E] FP32 (may be empty = zero) -> ids [M, top_k] int32 (global expert
// ids, best first, -1 only under the NaN policy), weights [M, top_k] FP32.
Status route(const RoutingConfig& cfg, int64_t m, std::span<const float> logits, std::span<const float> bias,
             std::span<int32_t> ids, std::span<float> weights);

// Router logits: x [M, hidden] BF16 bits, gate [E, hidden] BF16 bits -> logits [M, E] FP32.
// Each logit is an FP64 dot product (BF16 products are exact in FP64) rounded once to FP32, so
// the result does not depend on a summation order an FP32 engine would pick.
Status router_logits(int64_t m, int64_t hidden, int num_experts, std::span<const uint16_t> x,
                     std::span<const uint16_t> gate, std::span<float> logits);

// The FP32 sigmoid used by route(): k3::sigmoid_f32 (k3/portable_math.hpp), 1 / (1 + exp(-x)) from
// IEEE operations only, so CPU and CUDA routers agree bit for bit.
float router_sigmoid(float x);

}  // namespace k3
