// The fused-MoE backends the CLI can run (`k3 validate --op moe`, `k3 moe run`, benchmarks).
// Each backend registers a MoeBackendAdapter from its own tools/k3/moe_backend_<name>.cpp with a
// static MoeBackendRegistration; the reference path (FP64 contract oracle + one rounding) is
// "reference", priority 0.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "k3/moe.hpp"
#include "k3/status.hpp"

namespace k3::tool {

struct MoeBackendAdapter {
  std::string name;                   // "reference", "cpu", "cuda"
  int priority;                       // default backend = highest priority whose available() is ok
  std::function<Status()> available;  // ok when usable here; else the reason
  // Computes the layer: out = M*K elements of the problem's out_dtype (little-endian bytes).
  std::function<Status(const MoeProblem&, const MoeWeightsView&, const MoeInputsView&, std::span<uint8_t> out)> run;
  // Optional: ok when the backend can run this problem (recipe, activation, shape); else the
  // reason. Empty = everything the contract defines. Used for `k3 validate --require`.
  std::function<Status(const MoeProblem&)> supports = {};
};

std::vector<MoeBackendAdapter>& moe_backend_registry();
struct MoeBackendRegistration {
  explicit MoeBackendRegistration(MoeBackendAdapter a);
};

// The registered backend called `name`; the error lists the known names.
Result<const MoeBackendAdapter*> find_moe_backend(const std::string& name);
// The usable backend of highest priority (the reference path is always usable).
const MoeBackendAdapter& default_moe_backend();
// Runs `b` after checking the buffers (validate_moe_buffers) and out's size (M*K*dtype size).
Status run_moe_backend(const MoeBackendAdapter& b, const MoeProblem& p, const MoeWeightsView& w,
                       const MoeInputsView& in, std::span<uint8_t> out);

}  // namespace k3::tool
