// The options the `k3` tool passes to every backend (k3/backend.hpp). The tool, not the
// library, reads the environment: K3_ISA (already checked by main()), the thread count
// (K3_NUM_THREADS, else OpenMP's setting) and, for the cuda backend, K3_CUDA_MOE_PATH. The library's own defaults are hardware facts (all
// logical CPUs, the best SIMD level), so every place the tool builds options goes through here.
#pragma once

#include <omp.h>

#include <cstdlib>
#include <string>
#include <string_view>

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

// K3_CUDA_MOE_PATH: a CUDA MoE kernel path name ("" when unset).
inline std::string env_cuda_moe_path() {
  const char* v = std::getenv("K3_CUDA_MOE_PATH");
  return v != nullptr ? v : "";
}

// The options for `backend`: the cuda one also gets K3_CUDA_MOE_PATH as its kernel path (the
// other backends have none, and the variable is not theirs).
inline BackendOptions backend_options(std::string_view backend = {}) {
  BackendOptions o;
  o.threads = env_thread_count();
  o.isa = env_isa_level();
  if (backend == "cuda") o.path = env_cuda_moe_path();
  return o;
}

// A refused kernel path that came from K3_CUDA_MOE_PATH: the message names the variable.
inline Status with_path_source(Status st) {
  if (st.is_ok() || st.message().rfind("path: ", 0) != 0 || env_cuda_moe_path().empty()) return st;
  return Status(st.code(), "K3_CUDA_MOE_PATH=" + env_cuda_moe_path() + ": " + st.message());
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
