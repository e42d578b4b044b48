#include "k3/harness/ep_flags.hpp"

#include <string>

#include "k3/checkpoint.hpp"

namespace k3 {

namespace {

std::string flags_of(int ep_size, int ep_rank) {
  return "--ep-size " + std::to_string(ep_size) + " --ep-rank " + std::to_string(ep_rank);
}

}  // namespace

Status check_ep_ranges(int ep_size, int ep_rank) {
  const std::string flags = flags_of(ep_size, ep_rank);
  if (ep_size < 1) return invalid_argument(flags + ": --ep-size must be >= 1, got " + std::to_string(ep_size));
  if (ep_rank < 0 || ep_rank >= ep_size) {
    return invalid_argument(flags + ": --ep-rank must be in [0, " + std::to_string(ep_size) + ") (below --ep-size), got " +
                            std::to_string(ep_rank));
  }
  return Status::ok();
}

Status check_ep_flags(int ep_size, int ep_rank, const MoeModelConfig& cfg) {
  K3_RETURN_IF_ERROR(check_ep_ranges(ep_size, ep_rank));
  if (ep_size > cfg.num_experts) {
    return invalid_argument(flags_of(ep_size, ep_rank) + ": --ep-size must be at most the checkpoint's " +
                            std::to_string(cfg.num_experts) + " experts (num_experts in " + cfg.source +
                            "; every rank holds at least one), got " + std::to_string(ep_size));
  }
  return Status::ok();
}

Status check_ep_flags(int ep_size, int ep_rank, const std::string& checkpoint) {
  K3_RETURN_IF_ERROR(check_ep_ranges(ep_size, ep_rank));
  auto cfg = load_model_config(checkpoint);
  if (!cfg.is_ok()) return Status::ok();  // the loader reports the config itself
  return check_ep_flags(ep_size, ep_rank, cfg.value());
}

}  // namespace k3
