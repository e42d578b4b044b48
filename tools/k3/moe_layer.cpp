#include "moe_layer.hpp"

#include <string>

#include "k3/checkpoint.hpp"

namespace k3::tool {

Status check_ep_flags(int ep_size, int ep_rank, const std::string& checkpoint) {
  const std::string flags = "--ep-size " + std::to_string(ep_size) + " --ep-rank " + std::to_string(ep_rank);
  if (ep_size < 1) return invalid_argument(flags + ": --ep-size must be >= 1, got " + std::to_string(ep_size));
  if (ep_rank < 0 || ep_rank >= ep_size) {
    return invalid_argument(flags + ": --ep-rank must be in [0, " + std::to_string(ep_size) + ") (below --ep-size), got " +
                            std::to_string(ep_rank));
  }
  auto cfg = load_model_config(checkpoint);
  if (!cfg.is_ok()) return Status::ok();  // the loader reports the config itself
  if (ep_size > cfg->num_experts) {
    return invalid_argument(flags + ": --ep-size must be at most the checkpoint's " + std::to_string(cfg->num_experts) +
                            " experts (num_experts in " + cfg->source + "; every rank holds at least one), got " +
                            std::to_string(ep_size));
  }
  return Status::ok();
}

}  // namespace k3::tool
