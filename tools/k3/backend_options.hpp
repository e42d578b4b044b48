// The options the `k3` tool passes to every backend (k3/backend.hpp). The tool, not the
// library, reads the environment: K3_ISA (already checked by main()) and the thread count.
#pragma once

#include <omp.h>

#include <cstdlib>

#include "k3/backend.hpp"
#include "k3/system.hpp"

namespace k3::tool {

inline BackendOptions backend_options() {
  BackendOptions o;
  // K3_NUM_THREADS wins (threads = 0: default_thread_count()); otherwise OpenMP's current
  // setting, so that omp_set_num_threads (the determinism suites' 1 / 2 / 3 threads) reaches it.
  const char* k3_threads = std::getenv("K3_NUM_THREADS");
  o.threads = (k3_threads != nullptr && *k3_threads != '\0') ? 0 : omp_get_max_threads();
  if (auto isa = active_isa_level(); isa.is_ok()) o.isa = isa.value();
  return o;
}

}  // namespace k3::tool
