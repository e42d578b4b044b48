// Software prefetch policy of the streaming (decode) kernels that read one weight stream per
// thread: the MoE avx512bf16 direct path and the linear stream kernels at M <= 2.
//
// Measured both ways (2 threads, 2-vCPU guests): on Intel Xeon (Emerald Rapids) prefetching a
// few blocks ahead made the avx512bf16 MoE decode 1.3x faster; on AMD Zen 4 the hardware
// prefetcher alone streamed faster (docs/cpu_moe.md, docs/linear.md). So: Intel on, others off.
// With it on, the linear VDPBF16PS stream kernel also keeps two tiles in flight at M = 1 and 2.
#pragma once

#include <cstdint>

#include "k3/system.hpp"

namespace k3::cpu::detail {

// One software prefetch (PREFETCHT0) of the line holding p, and of every line of [p, p + bytes).
// Inline assembly on x86: GCC 12 treats __builtin_prefetch / _mm_prefetch as free of side
// effects, so a small helper holding only prefetches can be judged "const" and its calls deleted
// as dead code. It silently dropped every prefetch of the KDA kernels and of the MoE avx512bf16
// block loops (objdump showed no prefetch instruction). p need not point into an object: a
// prefetch never faults.
inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__ volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) prefetch_line(c + o);
}

inline bool prefetch_single_streams() {
  static const bool intel = cpu_info().vendor == "GenuineIntel";
  return intel;
}

}  // namespace k3::cpu::detail
