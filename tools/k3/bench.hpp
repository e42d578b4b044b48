// `k3 bench <target>`: benchmarks report medians with spread and fractions of the machine's
// limits measured in the same run (docs/moe.md). Each target (limits, moe, kda, ...)
// registers itself from its own tools/k3/bench_*.cpp.
#pragma once

#include <CLI/CLI.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "command.hpp"
#include "k3/harness/limits.hpp"

namespace k3::tool {

// Adds the target as a sub-command of `bench` and returns the callback that runs it.
using BenchSetup = std::function<CommandRun(CLI::App& bench)>;

struct BenchEntry {
  std::string name;
  BenchSetup setup;
};
std::vector<BenchEntry>& bench_registry();

struct BenchRegistration {
  BenchRegistration(std::string name, BenchSetup setup) { bench_registry().push_back({std::move(name), std::move(setup)}); }
};

// Timing statistics over repeated runs, in seconds.
struct Timing {
  double median = 0, min = 0, max = 0;
  int iterations = 0;
};

// Runs fn() `warmup` times untimed, then `iters` times timed individually.
inline Timing time_runs(const std::function<void()>& fn, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> t;
  t.reserve(iters);
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front(), t.back(), iters};
}

inline nlohmann::json to_json(const Timing& t) {
  return {{"median_s", t.median}, {"min_s", t.min}, {"max_s", t.max}, {"iterations", t.iterations}};
}
inline nlohmann::json to_json(const MeasuredRate& r) {
  nlohmann::json j = {{"value", r.value}, {"median", r.median}, {"min", r.min}, {"max", r.max}, {"what", r.what}};
  if (r.arithmetic > 0) j["clock_x_width"] = r.arithmetic;
  if (!r.note.empty()) j["note"] = r.note;
  return j;
}

// A probe's disagreement with clock x width, printed under the limits line ("" prints nothing).
inline void print_probe_note(const MeasuredRate& r) {
  if (!r.note.empty()) std::printf("  note: %s\n", r.note.c_str());
}

// The flag printed after a fraction above 100 % of a measured limit.
inline const char* over_limit_flag(double fraction) {
  return fraction > 1.0 ? "  <- above a measured limit: the probe read low (busy machine)" : "";
}

// Machine description for JSON records (CPU, SIMD level, threads, build).
nlohmann::json machine_json(int threads);

// Progress indicator on stderr ("[3/22] moe w4a8 M=16"): rewritten in place on a terminal, one
// line per step when stderr is a file or pipe (so logs stay readable next to the stdout table).
inline void progress(int done, int total, const std::string& what) {
  std::fflush(stdout);
  if (isatty(fileno(stderr))) {
    std::fprintf(stderr, "\r[%d/%d] %-60s", done, total, what.c_str());
    if (done == total) std::fprintf(stderr, "\n");
  } else {
    std::fprintf(stderr, "[%d/%d] %s\n", done, total, what.c_str());
  }
  std::fflush(stderr);
}

}  // namespace k3::tool
