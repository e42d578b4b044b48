// The decode schedule of the streaming kernels: contiguous ranges of tasks of near-equal cost,
// one per thread, and the ends of the other ranges taken by threads that finish early.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace k3::cpu::detail {

inline constexpr int kMaxRangeThreads = 256;  // the most threads run_ranges splits over

// A range of tasks [front, back) that its owner takes from the front and other threads, once
// their own range is done, from the back: both ends in one 64-bit word, so that each task is
// claimed exactly once.
struct alignas(64) TaskRange {
  std::atomic<uint64_t> ends{0};  // front << 32 | back

  void set(int64_t front, int64_t back) {
    ends.store(static_cast<uint64_t>(front) << 32 | static_cast<uint64_t>(back), std::memory_order_relaxed);
  }
  int64_t left() const {
    const uint64_t v = ends.load(std::memory_order_relaxed);
    return static_cast<int64_t>(v & 0xFFFFFFFFu) - static_cast<int64_t>(v >> 32);
  }
  // Claims the front task (from_back false) or the back one; false when none is left. Relaxed:
  // a claim hands over no data (the tasks' inputs are written before the parallel region and
  // their outputs read after it).
  bool claim(bool from_back, int64_t& task) {
    uint64_t v = ends.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = v >> 32, back = v & 0xFFFFFFFFu;
      if (front >= back) return false;
      const uint64_t next = from_back ? (front << 32 | (back - 1)) : ((front + 1) << 32 | back);
      if (ends.compare_exchange_weak(v, next, std::memory_order_relaxed)) {
        task = static_cast<int64_t>(from_back ? back - 1 : front);
        return true;
      }
    }
  }
};

// Runs task(0 .. n-1), each exactly once, on a team of min(threads, n, kMaxRangeThreads)
// threads. Thread i starts on one contiguous range of tasks, the ranges of near-equal total cost
// (cost(j) >= 1; thread i starts at the first task whose cost prefix reaches total * i / team), and
// runs it from the front: one run of weights streamed per thread, which the hardware prefetchers
// follow far better than many interleaved ones. The cost is an estimate, and a shared host gives
// its vCPUs unequal time, so a thread that finishes its range then takes the last task of the
// range with the most tasks left, one at a time, until none is left. task(j) gets the thread's
// number (omp_get_thread_num()) from OpenMP; which thread runs a task must not change its result.
// The starting range [first, last) of thread i of t over tasks 0 .. n-1 of total cost `total`:
// the tasks whose cost prefix lies in [total * i / t, total * (i + 1) / t).
template <typename Cost>
void starting_range(int i, int t, int64_t n, int64_t total, const Cost& cost, int64_t& first, int64_t& last) {
  const int64_t lo = total * i / t, hi = total * (i + 1) / t;
  int64_t prefix = 0;
  first = n;
  last = n;
  for (int64_t j = 0; j < n; ++j) {
    if (prefix >= lo && first == n) first = j;
    if (prefix >= hi) {
      last = j;
      break;
    }
    prefix += cost(j);
  }
  last = std::max(first, last);
}

template <typename Cost, typename F>
void run_ranges(int threads, int64_t n, const Cost& cost, const F& task) {
  const int team = static_cast<int>(std::min<int64_t>({threads, std::max<int64_t>(n, 1), kMaxRangeThreads}));
  if (n >= (int64_t{1} << 32)) {  // beyond TaskRange's 32-bit ends (no model shape comes near)
#pragma omp parallel for num_threads(team) schedule(static)
    for (int64_t j = 0; j < n; ++j) task(j);
    return;
  }
  int64_t total = 0;
  for (int64_t j = 0; j < n; ++j) total += cost(j);
  TaskRange ranges[kMaxRangeThreads];
#pragma omp parallel num_threads(team)
  {
    const int i = omp_get_thread_num(), t = omp_get_num_threads();
    int64_t first = 0, last = 0;
    starting_range(i, t, n, total, cost, first, last);
    ranges[i].set(first, last);
#pragma omp barrier
    int64_t j = 0;
    while (ranges[i].claim(false, j)) task(j);
    for (;;) {  // then the back of the range with the most left
      int victim = -1;
      int64_t most = 0;
      for (int v = 0; v < t; ++v) {
        const int64_t left = v == i ? 0 : ranges[v].left();
        if (left > most) {
          most = left;
          victim = v;
        }
      }
      if (victim < 0) break;
      if (ranges[victim].claim(true, j)) task(j);
    }
  }
}

}  // namespace k3::cpu::detail
