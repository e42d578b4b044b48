// The small synthetic Kimi-format checkpoint of the checkpoint, `k3 moe run` and input-file tests:
// K 64, N 32, E 8, top-3, hidden 96, MoE layer 1, every expert stored.
#pragma once

#include <cstdint>
#include <string>

#include "k3/harness/checkpoint_synth.hpp"

namespace k3::test {

inline SynthOptions small_synth_options(const std::string& dir, uint64_t seed = 3) {
  SynthOptions o;
  o.output_dir = dir;
  o.hidden_size = 96;
  o.expert_hidden = 64;
  o.intermediate = 32;
  o.num_experts = 8;
  o.top_k = 3;
  o.layers = {1};
  o.seed = seed;
  return o;
}

}  // namespace k3::test
