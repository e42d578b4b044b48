// A checkpoint's MoE layer as the fused-MoE problem the backends take: shape from the loaded
// layer, activation and routing from its config.json (never from flags).
#pragma once

#include <string>

#include "k3/checkpoint.hpp"
#include "k3/moe.hpp"
#include "k3/routing.hpp"
#include "k3/status.hpp"

namespace k3::tool {

// The --ep-size / --ep-rank flags of a command that loads `checkpoint`: ep_size >= 1, ep_rank in
// [0, ep_size), and ep_size divides the checkpoint's num_experts (read from its config.json; if
// that cannot be read the loader reports it). Errors name the flags and their values, not the
// config file, which is not what is wrong.
Status check_ep_flags(int ep_size, int ep_rank, const std::string& checkpoint);

// Activation from hidden_act ("situ" with the config's betas, "swiglu", "silu"); anything else is
// an error naming the value and the config file.
Result<Activation> activation_from_config(const MoeModelConfig& c);
// The routing facts, for commands that route logits; scoring_func must be "sigmoid" (the only
// scoring k3's router implements): anything else is an error naming the value, the config file
// and that reason. Inputs that bring topk_ids / topk_weights are not routed and need none of it.
Result<RoutingConfig> routing_from_config(const MoeModelConfig& c);
// The problem of a loaded layer under a recipe and output dtype.
Result<MoeProblem> problem_from_layer(const MoeLayerWeights& l, Recipe recipe, OutDType out_dtype);

}  // namespace k3::tool
