// k3/system.hpp — facts about the machine k3 runs on, detected at run time.
#pragma once

#include <string>

#include "k3/status.hpp"

namespace k3 {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512_bf16 = false;
  bool avx512_vnni = false;
};

struct CpuInfo {
  std::string model;     // brand string, e.g. "AMD EPYC 9654 96-Core Processor"
  CpuFeatures features;  // usable features: CPUID bits and OS support (XGETBV) together
  int logical_cpus = 0;  // std::thread::hardware_concurrency()
};

// Detected once; cheap to call again.
const CpuInfo& cpu_info();

// Threads k3's CPU kernels use: K3_NUM_THREADS if set, else OMP_NUM_THREADS, else all CPUs.
int default_thread_count();
// Where default_thread_count() came from, for messages: "K3_NUM_THREADS=1000",
// "OMP_NUM_THREADS=8" or "2 logical CPUs".
std::string default_thread_count_source();

}  // namespace k3

namespace k3 {

// SIMD level of the CPU kernels, chosen once at run time (Highway-style dispatch at op entry).
enum class IsaLevel : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

const char* isa_level_name(IsaLevel level);  // "scalar", "avx2", "avx512", "avx512bf16"
// The best level this CPU supports (AVX2 needs FMA; AVX-512 needs F+BW+VL; BF16 adds AVX512-BF16).
IsaLevel best_isa_level();
// The level the CPU kernels use: K3_ISA=scalar|avx2|avx512|avx512bf16 forces one (for tests and
// benchmarks); an unknown name or a level above best_isa_level() is an error naming both.
Result<IsaLevel> active_isa_level();
Result<IsaLevel> parse_isa_level(const std::string& name);

}  // namespace k3
