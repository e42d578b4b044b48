// Software prefetch policy of the streaming (decode) kernels that read one weight stream per
// thread: the MoE avx512bf16 direct path and the linear stream kernels at M <= 2.
//
// Measured both ways (2 threads, 2-vCPU guests): on Intel Xeon (Emerald Rapids) prefetching a
// few blocks ahead made the avx512bf16 MoE decode 1.3x faster; on AMD Zen 4 the hardware
// prefetcher alone streamed faster (docs/cpu_moe.md, docs/linear.md). So: Intel on, others off.
// With it on, the linear VDPBF16PS stream kernel also keeps two tiles in flight at M = 1 and 2.
#pragma once

#include "k3/system.hpp"

namespace k3::cpu::detail {

inline bool prefetch_single_streams() {
  static const bool intel = cpu_info().vendor == "GenuineIntel";
  return intel;
}

}  // namespace k3::cpu::detail
