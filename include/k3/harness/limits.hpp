// k3/harness/limits.hpp — the machine's measured limits, taken in the same run as a benchmark so that
// results can be reported as fractions of them (docs/moe.md, benchmark protocol).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "k3/system.hpp"

namespace k3 {

struct MeasuredRate {
  double value = 0;      // bytes/s or FLOP/s: the best trial (a limit is an upper bound; a busy
                         // machine only ever makes a trial slower)
  double min = 0, max = 0;
  double median = 0;     // of the trials
  std::string what;      // e.g. "read bandwidth, 1 GiB buffer, 2 threads"
  // FMA peaks: clock x width arithmetic where the CPU reports its frequency (GHz x lanes x 2 FLOP
  // x 2 FMA pipes x threads; 0 when unknown), and a note when the probe disagrees with it
  // ("" when it agrees): above it the frequency reading is wrong; below 60 % of it the machine
  // was busy, or the CPU has half-width FMA units (Zen 1) or one FMA pipe.
  double arithmetic = 0;
  std::string note;
};

// The highest frequency this CPU reports (cpufreq's cpuinfo_max_freq, else /proc/cpuinfo's
// "cpu MHz"), in GHz; 0 when neither is readable.
double cpu_max_ghz();

// Streaming read bandwidth over a buffer far larger than the last-level cache (default 1 GiB),
// with `threads` threads (AVX-512 / AVX2 loads where available).
MeasuredRate measure_read_bandwidth(int threads, int64_t bytes = int64_t{1} << 30);

// The same probe kept allocated, for a limit measured right next to a timing: on a shared host
// the read bandwidth moves by a factor of two within one run (the 2-vCPU Zen 4 guest: 29 to 60
// GB/s), so a fraction against a probe taken minutes earlier says more about the neighbours than
// about the kernel. The buffer (huge-page advised, first touched by the reading threads) is made
// once; each measure() is the best of `passes` passes over it, in bytes per second.
class ReadBandwidthProbe {
 public:
  ReadBandwidthProbe(int threads, int64_t bytes);
  ~ReadBandwidthProbe();
  ReadBandwidthProbe(const ReadBandwidthProbe&) = delete;
  ReadBandwidthProbe& operator=(const ReadBandwidthProbe&) = delete;
  // passes >= 1; the first pass over a cold buffer is not special-cased (the constructor touched it).
  double measure(int passes) const;
  std::vector<double> trials(int passes) const;  // each pass's rate, in order
  int64_t bytes() const { return bytes_; }
  int threads() const { return threads_; }

 private:
  int threads_;
  int64_t bytes_;
  float* buf_;
};

// Peak rate of the BF16 dot-product instruction the CPU kernels use (AVX512-BF16 VDPBF16PS:
// 2 FLOP per BF16 pair), on `threads` threads with independent accumulator chains.
// Falls back to FP32 FMA (AVX-512 or AVX2) when the CPU has no AVX512-BF16; `what` says which.
MeasuredRate measure_dot_peak(int threads);
// The same for the kernels of one ISA level (k3 bench --isa): VDPBF16PS on avx512bf16, else the
// FP32 FMA peak of the level (AVX-512 on avx512, AVX2 on avx2, scalar on scalar).
MeasuredRate measure_dot_peak(int threads, IsaLevel level);

// Peak FP32 FMA rate (2 FLOP per lane per FMA) with the widest FMA available.
MeasuredRate measure_fp32_fma_peak(int threads);
// FP32 FMA peak with the widest FMA the level allows (scalar: a scalar multiply-add loop).
MeasuredRate measure_fp32_fma_peak(int threads, IsaLevel level);

}  // namespace k3
