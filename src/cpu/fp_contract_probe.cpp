// See src/core/sys/fp_contract_probe.hpp. Compiled with k3_cpu's flags (the library whose SIMD
// kernels enable FMA per function with target attributes).
#include "core/sys/fp_contract_probe.hpp"

namespace k3::detail {

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2,fma")))
#endif
float fp_contract_probe_cpu(float a, float b, float c) {
  return a * b + c;
}

}  // namespace k3::detail
