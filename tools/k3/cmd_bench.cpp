// `k3 bench <target>` and the `limits` target (the machine limits every benchmark reports against).
#include <cstdio>
#include <iostream>
#include <memory>

#include "bench.hpp"
#include "command.hpp"
#include "k3/harness/atomic_file.hpp"
#include "k3/harness/bench.hpp"
#include <nlohmann/json.hpp>
#include "k3/system.hpp"

namespace k3::tool {

std::vector<BenchEntry>& bench_registry() {
  static std::vector<BenchEntry> registry;
  return registry;
}

namespace {

struct LimitsArgs {
  int threads = 0;
  int64_t mib = 1024;
  std::string output;
};

Status run_limits(LimitsArgs& a) {
  if (!a.output.empty()) {
    K3_RETURN_IF_ERROR(check_output_path("--output", a.output));
  }
  const harness::BenchResult r = harness::bench_limits(a.threads > 0 ? a.threads : default_thread_count(), a.mib);
  K3_RETURN_IF_ERROR(r.status);
  const auto doc = nlohmann::json::parse(r.json);
  auto row = [](const nlohmann::json& x, double unit, const char* fmt) {
    std::printf(fmt, x["what"].get<std::string>().c_str(), x["value"].get<double>() / unit, x["median"].get<double>() / unit,
                x["min"].get<double>() / unit);
  };
  std::printf("%-68s %12s %12s %12s\n", "limit", "best", "median", "min");
  row(doc["read_bandwidth_Bps"], 1e9, "%-68s %9.2f GB/s %9.2f    %9.2f\n");
  for (const char* key : {"dot_peak_flops", "fp32_fma_peak_flops"}) {
    const auto& x = doc[key];
    row(x, 1e9, "%-68s %6.1f GFLOP/s %9.1f    %9.1f\n");
    if (std::string(key) == "fp32_fma_peak_flops" && x.contains("clock_x_width")) {
      std::printf("  clock x width (2 FMA pipes): %.1f GFLOP/s\n", x["clock_x_width"].get<double>() / 1e9);
    }
    if (x.contains("note")) std::printf("  note: %s\n", x["note"].get<std::string>().c_str());
  }
  if (!a.output.empty()) K3_RETURN_IF_ERROR(write_file_atomic(a.output, r.json, "--output"));
  return Status::ok();
}

const BenchRegistration kLimits("limits", [](CLI::App& bench) -> CommandRun {
  auto* cmd = bench.add_subcommand("limits", "Measure read bandwidth and the dot-product / FMA peaks");
  auto a = std::make_shared<LimitsArgs>();
  cmd->add_option("--threads", a->threads, "Threads (default: K3_NUM_THREADS or all CPUs)")
      ->check(CLI::Range(0, k3::kMaxThreadCount));
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
