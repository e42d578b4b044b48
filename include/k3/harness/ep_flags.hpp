// The --ep-size / --ep-rank flags of the commands that load a checkpoint layer. (The layer's
// problem and routing come from the library: k3::moe_problem_from_layer, k3::routing_from_config.)
#pragma once

#include <string>

#include "k3/checkpoint.hpp"
#include "k3/status.hpp"

namespace k3 {

// The --ep-size / --ep-rank flags of a command that loads `checkpoint`: ep_size >= 1, ep_rank in
// [0, ep_size), and ep_size divides the checkpoint's num_experts (read from its config.json; if
// that cannot be read the loader reports it). Errors name the flags and their values, not the
// config file, which is not what is wrong.
Status check_ep_flags(int ep_size, int ep_rank, const std::string& checkpoint);
// The same against a config already read (`k3 moe run` reads config.json once).
Status check_ep_flags(int ep_size, int ep_rank, const MoeModelConfig& config);
// The part that needs no config: ep_size >= 1 and ep_rank in [0, ep_size).
Status check_ep_ranges(int ep_size, int ep_rank);

}  // namespace k3
