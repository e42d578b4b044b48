// k3/system.hpp — facts about the machine k3 runs on, detected at run time.
#pragma once

#include <cstdint>
#include <string>

#include "k3/status.hpp"

namespace k3 {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;  // VCVTPH2PS (every AVX2 CPU has it; the AVX2 level requires it)
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512_bf16 = false;
  bool avx512_vnni = false;
  bool avx_vnni = false;     // VEX VPDPWSSD on YMM (Alder Lake, Sierra Forest, Zen 5): the AVX2 level's int16 dots
  bool avx512_vbmi = false;  // VPERMT2B (the linear layer's E4M3 -> BF16 lookup on the avx512bf16 level)
  bool gfni = false;         // VGF2P8AFFINEQB (the linear layer's E4M3 -> BF16 bit moves on that level)
};

struct CpuInfo {
  std::string model;     // brand string, e.g. "AMD EPYC 9654 96-Core Processor"
  std::string vendor;    // CPUID vendor, e.g. "GenuineIntel", "AuthenticAMD" ("unknown" elsewhere)
  CpuFeatures features;  // usable features: CPUID bits and OS support (XGETBV) together
  int logical_cpus = 0;  // std::thread::hardware_concurrency()
};

// Detected once; cheap to call again.
const CpuInfo& cpu_info();

// All logical CPUs of this machine (cpu_info().logical_cpus, at least 1): what the library's CPU
// kernels use when a caller passes threads = 0. A hardware fact; no environment variable is read.
int hardware_thread_count();

// The largest thread count any k3 entry point accepts (threads = 0 means all logical CPUs, at
// most this many). Every op, the tool's --threads / K3_NUM_THREADS and the Python bindings check
// against it with check_thread_count.
inline constexpr int kMaxThreadCount = 256;

// OK when 0 <= threads <= kMaxThreadCount; else an invalid-argument error naming `what`
// ("threads", "--threads", "K3_NUM_THREADS"), the value and the range.
Status check_thread_count(int64_t threads, const std::string& what = "threads");

// K3_NUM_THREADS, when set and not empty, must be a decimal integer >= 1 (no sign, exponent,
// fraction or trailing text; not past int): the error names the variable and the text. A count
// above kMaxThreadCount passes here and is refused, with its range, by what it reaches.
// (OMP_NUM_THREADS is OpenMP's and keeps its syntax.)
Status check_thread_env();

// For tools, not read by the library: K3_NUM_THREADS if set to a positive count, else
// OMP_NUM_THREADS, else hardware_thread_count(). The `k3` tool passes the result explicitly.
int default_thread_count();
// Where default_thread_count() came from, for messages: "K3_NUM_THREADS=1000",
// "OMP_NUM_THREADS=8" or "2 logical CPUs".
std::string default_thread_count_source();

}  // namespace k3

namespace k3 {

// SIMD level of the CPU kernels, chosen once at run time (Highway-style dispatch at op entry).
enum class IsaLevel : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

const char* isa_level_name(IsaLevel level);  // "scalar", "avx2", "avx512", "avx512bf16"
// The best level this CPU supports (AVX2 needs FMA and F16C; AVX-512 needs F+BW+VL; BF16 adds AVX512-BF16).
// What the library's CPU kernels use when a caller leaves the level unset.
IsaLevel best_isa_level();
// For tools, not read by the library: K3_ISA=scalar|avx2|avx512|avx512bf16 if set (for tests and
// benchmarks), else best_isa_level(); an unknown name or a level above best_isa_level() is an
// error naming both. The `k3` tool passes the result explicitly.
Result<IsaLevel> active_isa_level();
Result<IsaLevel> parse_isa_level(const std::string& name);

}  // namespace k3
