// k3/harness/moe_case.hpp — seeded, self-contained fused-MoE problems (weights, x, routing) for the
// validation matrix, benchmarks and tests (docs/moe.md, "The correctness matrix").
//
// The weights are generated directly as MXFP4 codes and E8M0 scales (no pre-quantization floats
// exist, so no oracle can read them): element codes follow a rounded N(0, 2.5) in element units,
// block scales jitter by one binade around a base chosen so that FC1 outputs have a standard
// deviation of about 3 (the SiTU / SwiGLU non-linear range) and FC2 preserves the scale of its
// input. x ~ N(0, 1) in BF16. Everything is a pure function of the spec (bit-identical for any
// thread count).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "k3/moe.hpp"
#include "k3/status.hpp"

namespace k3 {

enum class RoutingPattern : uint8_t {
  kUniform,      // top_k distinct global experts, uniform
  kSkewed,       // Zipf(s) popularity, the most popular experts being this rank's
  kEpMixed,      // exactly `local_slots` local + (top_k - local_slots) remote slots per token
  kEmptyExpert,  // uniform, but one local expert (the middle one) never receives a token
  kMasked,       // uniform, then ~1/4 of the slots masked (-1) and token 0 fully masked
};
const char* routing_pattern_name(RoutingPattern r);  // "uniform", "skewed", "ep_mixed", "empty_expert", "masked"

struct MoeCaseSpec {
  MoeProblem problem;
  int64_t m = 1;
  RoutingPattern routing = RoutingPattern::kUniform;
  int local_slots = 0;          // kEpMixed only: 0 <= local_slots <= top_k, <= E_local, top_k - local_slots <= E - E_local
  double zipf_s = 1.2;          // kSkewed only
  bool situ_overrides = false;  // per-local-expert SiTU betas (b in [2, 6], lb in [15, 35])
  uint64_t seed = 1;
};

// An owning fused-MoE problem. Tensors as in k3/moe.hpp.
struct MoeCase {
  MoeProblem problem;
  int64_t m = 0;
  std::vector<uint8_t> fc1_q;         // [E_local, 2N, K/2] packed E2M1, rows [gate; up]
  std::vector<uint8_t> fc1_scale;     // [E_local, 2N, K/32] E8M0
  std::vector<uint8_t> fc2_q;         // [E_local, K, N/2]
  std::vector<uint8_t> fc2_scale;     // [E_local, K, N/32]
  std::vector<float> situ_beta;       // [E_local] or empty
  std::vector<float> situ_linear_beta;  // [E_local] or empty
  std::vector<uint16_t> x;            // [M, K] BF16
  std::vector<int32_t> topk_ids;      // [M, top_k] global ids, -1 masked
  std::vector<float> topk_weights;    // [M, top_k] positive, summing to 1 over the token's slots
  MoeWeightsView weights() const;
  MoeInputsView inputs() const;
};

// Generates the weights (which depend only on shape, seed and situ_overrides) and the inputs.
Result<MoeCase> make_moe_case(const MoeCaseSpec& spec);
// Replaces the inputs only (x, ids, weights) of an existing case, keeping its weights: the cheap
// way to sweep M or routing at Kimi shapes. spec.problem.shape must equal c.problem.shape.
Status regenerate_inputs(const MoeCaseSpec& spec, MoeCase& c);

}  // namespace k3
