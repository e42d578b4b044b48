// `k3 bench <target>` and the `limits` target (the machine limits every benchmark reports against).
#include <omp.h>

#include <iostream>
#include <memory>

#include "bench.hpp"
#include "command.hpp"
#include "k3/harness/atomic_file.hpp"
#include "k3/build_info.hpp"
#include "k3/system.hpp"

namespace k3::tool {

std::vector<BenchEntry>& bench_registry() {
  static std::vector<BenchEntry> registry;
  return registry;
}

nlohmann::json machine_json(int threads) {
  const auto isa = active_isa_level();
  return {{"cpu", cpu_info().model},
          {"logical_cpus", cpu_info().logical_cpus},
          {"threads", threads},
          {"isa", isa.is_ok() ? isa_level_name(isa.value()) : isa.status().message()},
          {"k3_version", build::kVersion},
          {"build_type", build::kBuildType}};
}

namespace {

struct LimitsArgs {
  int threads = 0;
  int64_t mib = 1024;
  std::string output;
};

Status run_limits(const LimitsArgs& a) {
  if (!a.output.empty()) {
    K3_RETURN_IF_ERROR(check_output_path("--output", a.output));
  }
  const int threads = a.threads > 0 ? a.threads : default_thread_count();
  const auto bw = measure_read_bandwidth(threads, a.mib << 20);
  const auto dot = measure_dot_peak(threads);
  const auto fma = measure_fp32_fma_peak(threads);
  std::printf("%-68s %12s %12s %12s\n", "limit", "best", "median", "min");
  std::printf("%-68s %9.2f GB/s %9.2f    %9.2f\n", bw.what.c_str(), bw.value / 1e9, bw.median / 1e9, bw.min / 1e9);
  std::printf("%-68s %6.1f GFLOP/s %9.1f    %9.1f\n", dot.what.c_str(), dot.value / 1e9, dot.median / 1e9, dot.min / 1e9);
  print_probe_note(dot);
  std::printf("%-68s %6.1f GFLOP/s %9.1f    %9.1f\n", fma.what.c_str(), fma.value / 1e9, fma.median / 1e9, fma.min / 1e9);
  if (fma.arithmetic > 0) std::printf("  clock x width (2 FMA pipes): %.1f GFLOP/s\n", fma.arithmetic / 1e9);
  print_probe_note(fma);
  if (!a.output.empty()) {
    nlohmann::json j = {{"machine", machine_json(threads)},
                        {"read_bandwidth_Bps", to_json(bw)},
                        {"dot_peak_flops", to_json(dot)},
                        {"fp32_fma_peak_flops", to_json(fma)}};
    K3_RETURN_IF_ERROR(write_file_atomic(a.output, j.dump(2) + "\n", "--output"));
  }
  return Status::ok();
}

const BenchRegistration kLimits("limits", [](CLI::App& bench) -> CommandRun {
  auto* cmd = bench.add_subcommand("limits", "Measure read bandwidth and the dot-product / FMA peaks");
  auto a = std::make_shared<LimitsArgs>();
  cmd->add_option("--threads", a->threads, "Threads (default: K3_NUM_THREADS or all CPUs)");
  cmd->add_option("--buffer-mib", a->mib, "Bandwidth buffer size in MiB")->check(CLI::Range(64, 65536))->capture_default_str();
  cmd->add_option("--output", a->output, "Write JSON to this file");
  return [a]() { return run_limits(*a); };
});

const CommandRegistration kRegistration("bench", 20, [](CLI::App& app) -> CommandRun {
  auto* cmd = app.add_subcommand("bench", "Benchmarks, reported as fractions of measured machine limits");
  cmd->require_subcommand(1);
  auto runners = std::make_shared<std::vector<std::pair<CLI::App*, CommandRun>>>();
  for (auto& entry : bench_registry()) {
    auto run = entry.setup(*cmd);
    runners->emplace_back(cmd->get_subcommands({}).back(), std::move(run));
  }
  return [runners]() { return run_parsed(*runners); };
});

}  // namespace
}  // namespace k3::tool
