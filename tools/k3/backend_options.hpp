// The options the `k3` tool passes to every backend (k3/backend.hpp). The tool, not the
// library, reads the environment: K3_ISA (already checked by main()) and the thread count
// (K3_NUM_THREADS, else OpenMP's setting). The library's own defaults are hardware facts (all
// logical CPUs, the best SIMD level), so every place the tool builds options goes through here.
#pragma once

#include <omp.h>

#include <cstdlib>
#include <string>

#include "k3/backend.hpp"
#include "k3/status.hpp"
#include "k3/system.hpp"

namespace k3::tool {

// K3_NUM_THREADS when set (default_thread_count(): K3_NUM_THREADS, else OMP_NUM_THREADS, else all
// CPUs); otherwise OpenMP's current setting, so that omp_set_num_threads (the determinism suites'
// 1 / 2 / 3 threads) reaches the backends.
inline int env_thread_count() {
  const char* k3_threads = std::getenv("K3_NUM_THREADS");
  return (k3_threads != nullptr && *k3_threads != '\0') ? default_thread_count() : omp_get_max_threads();
}

// The SIMD level K3_ISA asks for (main() has already refused a bad one), else the best one.
inline IsaLevel env_isa_level() {
  const auto isa = active_isa_level();
  return isa.is_ok() ? isa.value() : best_isa_level();
}

inline BackendOptions backend_options() {
  BackendOptions o;
  o.threads = env_thread_count();
  o.isa = env_isa_level();
  return o;
}

// A backend refused `threads`: when that count came from the environment, the message names the
// variable ("threads = 1000 (from K3_NUM_THREADS=1000) must be in [0, 256] ..."), since the user
// never typed the number.
inline Status with_thread_source(Status st, int threads) {
  if (st.is_ok() || threads != default_thread_count()) return st;
  const std::string source = default_thread_count_source();
  if (source.find("_NUM_THREADS=") == std::string::npos) return st;  // "N logical CPUs": not the environment
  const std::string needle = "threads = " + std::to_string(threads);
  std::string msg = st.message();
  const auto pos = msg.find(needle);
  if (pos == std::string::npos) return st;
  msg.insert(pos + needle.size(), " (from " + source + ")");
  return Status(st.code(), msg);
}

}  // namespace k3::tool
