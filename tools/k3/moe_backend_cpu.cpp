// Registers the CPU fused-MoE backend ("cpu", priority 10) with the CLI's backend registry, so
// `k3 validate --op moe --backend cpu` and `k3 moe run --backend cpu` use it, and it is the
// default whenever no higher-priority (GPU) backend is usable.
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "k3/cpu_moe.hpp"
#include "k3/system.hpp"
#include "moe_backends.hpp"

namespace k3::tool {
namespace {

// One call: plan for exactly this M, prepack, run. (A serving loop keeps the plan, the packed
// weights and the workspace across calls; the adapter's signature has no state to keep them in.)
Status run_cpu_moe(const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in, std::span<uint8_t> out) {
  cpu::MoeOptions o;
  o.max_tokens = std::max<int64_t>(1, in.m);
  // K3_NUM_THREADS wins (default_thread_count()); otherwise follow OpenMP's current setting, so
  // that omp_set_num_threads (the determinism suite's 1 / 2 / 3 threads) reaches the backend.
  const char* k3_threads = std::getenv("K3_NUM_THREADS");
  o.threads = (k3_threads != nullptr && *k3_threads != '\0') ? 0 : omp_get_max_threads();
  auto plan = cpu::plan(p, o);
  if (!plan.is_ok()) return plan.status();
  auto packed = cpu::prepack(plan.value(), w);
  if (!packed.is_ok()) return packed.status();
  std::vector<uint8_t> ws(static_cast<size_t>(plan->workspace_bytes));
  return cpu::run(plan.value(), packed.value(), in, ws, out);
}

Status cpu_available() {
  // A bad K3_ISA never gets here from the k3 tool: main() refuses it before any command runs.
  auto isa = active_isa_level();
  return isa.is_ok() ? Status::ok() : isa.status();
}

const MoeBackendRegistration kCpuBackend(MoeBackendAdapter{"cpu", 10, cpu_available, run_cpu_moe});

}  // namespace
}  // namespace k3::tool
