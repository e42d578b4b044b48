// `k3 bench <target>`: each target (limits, moe, kda, linear, comm) registers its flags from its
// own tools/k3/bench_*.cpp, runs the harness's benchmark (k3/harness/bench.hpp: the timer, the
// limits, the JSON document) and prints the records.
#pragma once

#include <CLI/CLI.hpp>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "command.hpp"

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

// The flag printed after a fraction above 100 % of a measured limit.
inline const char* over_limit_flag(double fraction) {
  return fraction > 1.0 ? "  <- above a measured limit: the probe read low (busy machine)" : "";
}

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
