// CPU model and SIMD features via CPUID (x86-64). A feature counts as present only when the OS
// saves the matching register state (XGETBV), so a hypervisor that hides AVX-512 state is honoured.
// default_thread_count() reads K3_NUM_THREADS / OMP_NUM_THREADS: a helper for tools, never called
// by the library's kernels (they default to hardware_thread_count()).
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <limits>
#include <cstring>
#include <string>
#include <thread>

#include "k3/system.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define K3_X86 1
#endif

namespace k3 {
namespace {

#ifdef K3_X86
uint64_t xgetbv0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}
#endif

CpuInfo detect() {
  CpuInfo info;
  info.logical_cpus = static_cast<int>(std::thread::hardware_concurrency());
#ifdef K3_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  char vendor[13] = {};
  __get_cpuid(0, &a, &b, &c, &d);
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  info.vendor = vendor;
  char brand[49] = {};
  if (static_cast<unsigned>(__get_cpuid_max(0x80000000u, nullptr)) >= 0x80000004u) {
    for (unsigned i = 0; i < 3; ++i) {
      __get_cpuid(0x80000002u + i, &a, &b, &c, &d);
      std::memcpy(brand + 16 * i, &a, 4);
      std::memcpy(brand + 16 * i + 4, &b, 4);
      std::memcpy(brand + 16 * i + 8, &c, 4);
      std::memcpy(brand + 16 * i + 12, &d, 4);
    }
  }
  info.model = brand;
  while (!info.model.empty() && info.model.back() == ' ') info.model.pop_back();
  while (!info.model.empty() && info.model.front() == ' ') info.model.erase(info.model.begin());

  __get_cpuid(1, &a, &b, &c, &d);
  const bool osxsave = (c >> 27) & 1u;
  const bool fma = (c >> 12) & 1u;
  const bool f16c = (c >> 29) & 1u;
  const uint64_t xcr0 = osxsave ? xgetbv0() : 0;
  const bool os_avx = (xcr0 & 0x6u) == 0x6u;     // XMM + YMM state
  const bool os_avx512 = (xcr0 & 0xE6u) == 0xE6u;  // + opmask, ZMM_Hi256, Hi16_ZMM
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = (b >> 5) & 1u;
  const bool avx512f = (b >> 16) & 1u, avx512bw = (b >> 30) & 1u, avx512vl = (b >> 31) & 1u;
  const bool avx512_vnni = (c >> 11) & 1u;
  const bool avx512_vbmi = (c >> 1) & 1u;
  const bool gfni = (c >> 8) & 1u;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  __cpuid_count(7, 1, a1, b1, c1, d1);
  const bool avx512_bf16 = (a1 >> 5) & 1u;
  const bool avx_vnni = (a1 >> 4) & 1u;
  info.features.avx2 = os_avx && avx2;
  info.features.fma = os_avx && fma;
  info.features.f16c = os_avx && f16c;
  info.features.avx512f = os_avx512 && avx512f;
  info.features.avx512bw = os_avx512 && avx512bw;
  info.features.avx512vl = os_avx512 && avx512vl;
  info.features.avx512_bf16 = os_avx512 && avx512_bf16;
  info.features.avx512_vnni = os_avx512 && avx512_vnni;
  info.features.avx_vnni = os_avx && avx_vnni;
  info.features.avx512_vbmi = os_avx512 && avx512_vbmi;
  info.features.gfni = os_avx && gfni;  // the instruction's VEX / EVEX forms need the OS's vector state
#else
  info.model = "unknown (non-x86 CPU)";
#endif
  if (info.model.empty()) info.model = "unknown";
  if (info.vendor.empty()) info.vendor = "unknown";
  return info;
}

}  // namespace

const CpuInfo& cpu_info() {
  static const CpuInfo info = detect();
  return info;
}

namespace {

// The first of K3_NUM_THREADS, OMP_NUM_THREADS that holds a positive count (its name, value and
// count), else none.
struct ThreadEnv {
  const char* var = nullptr;
  const char* text = nullptr;
  int n = 0;
};

// A decimal count: digits only (an optional leading '+'), in [1, INT_MAX] (a count above
// kMaxThreadCount is kept, so that the op that gets it names it with its range); with `list`,
// OpenMP's form "N[,M...]" whose first entry counts. 0 when the text is anything else.
int parse_count(const char* v, bool list) {
  char* end = nullptr;
  errno = 0;
  if (*v == '-' || std::isspace(static_cast<unsigned char>(*v))) return 0;
  const long long n = std::strtoll(v, &end, 10);
  if (errno != 0 || end == v || (*end != '\0' && !(list && *end == ','))) return 0;
  return n >= 1 && n <= std::numeric_limits<int>::max() ? static_cast<int>(n) : 0;
}

ThreadEnv thread_env() {
  for (const char* var : {"K3_NUM_THREADS", "OMP_NUM_THREADS"}) {
    if (const char* v = std::getenv(var)) {
      const int n = parse_count(v, std::strcmp(var, "OMP_NUM_THREADS") == 0);
      if (n > 0) return {var, v, n};
    }
  }
  return {};
}

}  // namespace

Status check_thread_count(int64_t threads, const std::string& what) {
  if (threads < 0 || threads > kMaxThreadCount) {
    return invalid_argument(what + " = " + std::to_string(threads) + " must be in [0, " +
                            std::to_string(kMaxThreadCount) + "] (0: all logical CPUs)");
  }
  return Status::ok();
}

Status check_thread_env() {
  const char* v = std::getenv("K3_NUM_THREADS");
  if (v == nullptr || *v == '\0' || parse_count(v, false) > 0) return Status::ok();
  return invalid_argument("K3_NUM_THREADS = '" + std::string(v) + "' is not a thread count: a decimal integer in [1, " +
                          std::to_string(kMaxThreadCount) + "] (unset it for all logical CPUs)");
}

int hardware_thread_count() {
  const int n = cpu_info().logical_cpus;
  return n > 0 ? n : 1;
}

int default_thread_count() {
  if (const ThreadEnv e = thread_env(); e.var != nullptr) return e.n;
  return hardware_thread_count();
}

std::string default_thread_count_source() {
  if (const ThreadEnv e = thread_env(); e.var != nullptr) return std::string(e.var) + "=" + e.text;
  return std::to_string(default_thread_count()) + " logical CPUs";
}

}  // namespace k3
