// See fp_contract_probe.hpp. Compiled with k3_core's flags.
#include "core/sys/fp_contract_probe.hpp"

namespace k3::detail {

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("fma")))
#endif
float fp_contract_probe_core(float a, float b, float c) {
  return a * b + c;
}

bool fp_contract_probe_runnable() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("fma");
#else
  return true;
#endif
}

}  // namespace k3::detail
