// Machine-limit probes: streaming read bandwidth and instruction peaks. Each probe repeats a
// fixed amount of work several times and reports the median. Compiled with per-function target
// attributes so one binary runs on any x86-64 and uses the best instructions present.
#include "k3/harness/limits.hpp"

#include "k3/memory.hpp"

// GCC 12 reports its own _mm512_undefined_* helpers (used by _mm512_reduce_add_ps) as
// "used uninitialized": a false positive inside avx512fintrin.h.
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

namespace k3 {
namespace {

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

MeasuredRate summarize(std::vector<double> rates, std::string what) {
  std::sort(rates.begin(), rates.end());
  MeasuredRate r;
  r.value = rates.back();  // the best trial: a limit is an upper bound
  r.median = rates[rates.size() / 2];
  r.min = rates.front();
  r.max = rates.back();
  r.what = std::move(what) + " (best of " + std::to_string(rates.size()) + ")";
  return r;
}

// FMA peak against clock x width (2 FMA pipes of `lanes` FP32 lanes).
MeasuredRate check_arithmetic(MeasuredRate r, int threads, int lanes) {
  const double ghz = cpu_max_ghz();
  if (ghz <= 0) return r;
  r.arithmetic = ghz * 1e9 * lanes * 2.0 * 2.0 * threads;
  char buf[200];
  if (r.value > 1.05 * r.arithmetic) {
    std::snprintf(buf, sizeof buf, "probe %.0f GFLOP/s is above clock x width %.0f GFLOP/s: the reported frequency "
                  "(%.2f GHz) is below the real one", r.value / 1e9, r.arithmetic / 1e9, ghz);
    r.note = buf;
  } else if (r.value < 0.6 * r.arithmetic) {
    std::snprintf(buf, sizeof buf, "probe %.0f GFLOP/s is below 60%% of clock x width %.0f GFLOP/s (%.2f GHz, 2 FMA "
                  "pipes): a busy machine, or half-width FMA units (Zen 1)", r.value / 1e9, r.arithmetic / 1e9, ghz);
    r.note = buf;
  }
  return r;
}

__attribute__((target("avx512f"))) double sum_avx512(const float* p, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

__attribute__((target("avx2"))) double sum_avx2(const float* p, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}

double sum_scalar(const float* p, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += p[i];
  return s;
}

constexpr int64_t kPeakIters = 20'000'000;

// 12 independent accumulator chains hide the instruction latency (latency x throughput <= 12).
// The chains must stay in registers: a compiler barrier with a "memory" clobber inside the loop
// made GCC keep them on the stack, and the loop then measured store throughput (half the
// VDPBF16PS peak on Zen 4). The final reduction keeps the loop alive.
__attribute__((target("avx512f,avx512bf16"))) double dot_bf16_loop(int64_t iters) {
  __m512 acc[12];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3F80);  // 1.0
  const __m512bh y = (__m512bh)_mm512_set1_epi16(0x3400);  // tiny: accumulators stay finite
  for (int64_t i = 0; i < iters; ++i) {
    for (auto& a : acc) a = _mm512_dpbf16_ps(a, x, y);
  }
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx512f"))) double fma512_loop(int64_t iters) {
  __m512 acc[12];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512 x = _mm512_set1_ps(1.0f), y = _mm512_set1_ps(1e-9f);
  for (int64_t i = 0; i < iters; ++i) {
    for (auto& a : acc) a = _mm512_fmadd_ps(x, y, a);
  }
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx2,fma"))) double fma256_loop(int64_t iters) {
  __m256 acc[12];
  for (auto& a : acc) a = _mm256_setzero_ps();
  const __m256 x = _mm256_set1_ps(1.0f), y = _mm256_set1_ps(1e-9f);
  for (int64_t i = 0; i < iters; ++i) {
    for (auto& a : acc) a = _mm256_fmadd_ps(x, y, a);
  }
  __m256 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
  alignas(32) float t[8];
  _mm256_store_ps(t, s);
  return t[0];
}

// The scalar level's limit: 12 independent FP32 multiply + add chains in scalar (SSE) registers,
// not vectorized (the scalar kernels are not), 2 FLOP per chain and iteration.
#if defined(__clang__)
#define K3_NO_VECTORIZE
#else
#define K3_NO_VECTORIZE __attribute__((optimize("no-tree-vectorize")))
#endif
K3_NO_VECTORIZE double scalar_muladd_loop(int64_t iters) {
  float a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0, a8 = 0, a9 = 0, a10 = 0, a11 = 0;
  const float x = 0.999f, y = 1e-9f;
  for (int64_t i = 0; i < iters; ++i) {
    a0 = a0 * x + y, a1 = a1 * x + y, a2 = a2 * x + y, a3 = a3 * x + y, a4 = a4 * x + y, a5 = a5 * x + y;
    a6 = a6 * x + y, a7 = a7 * x + y, a8 = a8 * x + y, a9 = a9 * x + y, a10 = a10 * x + y, a11 = a11 * x + y;
    __asm__("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7), "+x"(a8), "+x"(a9),
            "+x"(a10), "+x"(a11));
  }
  return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
}

// Runs `loop(iters)` on every thread, returns FLOP/s for flop_per_iter per thread-iteration.
template <typename Loop>
MeasuredRate peak(int threads, Loop loop, double flop_per_iter, std::string what) {
  std::vector<double> rates;
  volatile double sink = 0;
  loop(kPeakIters / 20);  // warm-up (frequency ramp)
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = seconds_now();
    double acc = 0;
#pragma omp parallel num_threads(threads) reduction(+ : acc)
    acc += loop(kPeakIters / 4);
    const double dt = seconds_now() - t0;
    sink = sink + acc;
    rates.push_back(flop_per_iter * static_cast<double>(kPeakIters / 4) * threads / dt);
  }
  return summarize(rates, std::move(what) + ", " + std::to_string(threads) + " thread(s)");
}

}  // namespace

ReadBandwidthProbe::ReadBandwidthProbe(int threads, int64_t bytes)
    : threads_(threads < 1 ? 1 : threads), bytes_((bytes / 256) * 256) {
  const int64_t n = bytes_ / static_cast<int64_t>(sizeof(float));
  // Allocated as the packed weights are (k3/memory.hpp: advised for huge pages), so that the probe
  // streams under the same page size as the kernels it is the limit of.
  buf_ = static_cast<float*>(detail::huge_page_allocate(static_cast<size_t>(bytes_)));
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (int64_t i = 0; i < n; ++i) buf_[i] = static_cast<float>(i & 7);  // first touch by the reader
}

ReadBandwidthProbe::~ReadBandwidthProbe() { detail::huge_page_deallocate(buf_, static_cast<size_t>(bytes_)); }

std::vector<double> ReadBandwidthProbe::trials(int passes) const {
  const int64_t n = bytes_ / static_cast<int64_t>(sizeof(float));
  const auto& f = cpu_info().features;
  auto sum = f.avx512f ? sum_avx512 : (f.avx2 ? sum_avx2 : sum_scalar);
  std::vector<double> rates;
  volatile double sink = 0;
  for (int rep = 0; rep < passes; ++rep) {
    const double t0 = seconds_now();
    double acc = 0;
    int64_t read = 0;
#pragma omp parallel num_threads(threads_) reduction(+ : acc, read)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t chunk = (n / nt) & ~int64_t{63};
      acc += sum(buf_ + t * chunk, chunk);
      read += chunk * static_cast<int64_t>(sizeof(float));
    }
    const double dt = seconds_now() - t0;
    sink = sink + acc;
    rates.push_back(static_cast<double>(read) / dt);
  }
  return rates;
}

double ReadBandwidthProbe::measure(int passes) const {
  const auto r = trials(passes < 1 ? 1 : passes);
  return *std::max_element(r.begin(), r.end());
}

MeasuredRate measure_read_bandwidth(int threads, int64_t bytes) {
  const ReadBandwidthProbe probe(threads, bytes);
  auto rates = probe.trials(6);
  rates.erase(rates.begin());  // the first pass warms up
  return summarize(rates, "read bandwidth, " + std::to_string(bytes >> 20) + " MiB buffer, " +
                              std::to_string(threads) + " thread(s)");
}

double cpu_max_ghz() {
  if (FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq", "r")) {
    long khz = 0;
    const int got = std::fscanf(f, "%ld", &khz);
    std::fclose(f);
    if (got == 1 && khz > 0) return static_cast<double>(khz) / 1e6;
  }
  if (FILE* f = std::fopen("/proc/cpuinfo", "r")) {
    char line[512];
    double best = 0;
    while (std::fgets(line, sizeof line, f) != nullptr) {
      double mhz = 0;
      if (std::strncmp(line, "cpu MHz", 7) == 0 && std::sscanf(std::strchr(line, ':') + 1, "%lf", &mhz) == 1)
        best = std::max(best, mhz);
    }
    std::fclose(f);
    return best / 1e3;
  }
  return 0;
}

MeasuredRate measure_dot_peak(int threads) { return measure_dot_peak(threads, best_isa_level()); }

MeasuredRate measure_dot_peak(int threads, IsaLevel level) {
  if (level == IsaLevel::kAvx512Bf16 && cpu_info().features.avx512_bf16) {
    return peak(threads, dot_bf16_loop, 12.0 * 64, "AVX512-BF16 vdpbf16ps peak");
  }
  return measure_fp32_fma_peak(threads, level);
}

MeasuredRate measure_fp32_fma_peak(int threads) { return measure_fp32_fma_peak(threads, best_isa_level()); }

MeasuredRate measure_fp32_fma_peak(int threads, IsaLevel level) {
  const auto& f = cpu_info().features;
  const bool avx512 = level == IsaLevel::kAvx512 || level == IsaLevel::kAvx512Bf16;
  if (avx512 && f.avx512f) return check_arithmetic(peak(threads, fma512_loop, 12.0 * 32, "AVX-512 FP32 FMA peak"), threads, 16);
  if (level != IsaLevel::kScalar && f.avx2 && f.fma)
    return check_arithmetic(peak(threads, fma256_loop, 12.0 * 16, "AVX2 FP32 FMA peak"), threads, 8);
  return peak(threads, scalar_muladd_loop, 12.0 * 2, "scalar FP32 multiply + add (no SIMD)");
}

}  // namespace k3
