// `k3 bench linear`: parses the flags, runs the harness's dense-linear benchmark
// (k3/harness/bench.hpp: seed's and Kimi-Linear's shapes over an M sweep, weights rotated past the
// cache, interleaved rounds, torch's BF16 F.linear beside it when a Python with torch is found)
// and prints its records as a table.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.hpp"
#include "k3/harness/atomic_file.hpp"
#include "k3/harness/bench.hpp"
#include "k3/system.hpp"

namespace k3::tool {
namespace {

using nlohmann::json;

struct Args {
  harness::LinearBenchConfig c;
  std::string isa;  // empty: K3_ISA or the CPU's best level
  std::string output;
};

void print_rate(const char* label, const json& r) {
  std::printf("%s%s %.1f GFLOP/s [%.1f, %.1f]\n", label, r["what"].get<std::string>().c_str(), r["value"].get<double>() / 1e9,
              r["min"].get<double>() / 1e9, r["max"].get<double>() / 1e9);
  if (r.contains("note")) std::printf("  note: %s\n", r["note"].get<std::string>().c_str());
}

void print(const json& doc) {
  const auto& m = doc["machine"];
  const auto& bw = doc["read_bandwidth_Bps"];
  const auto& pk = doc["peak_flops"];
  std::printf("machine: %s, %d thread(s), isa %s, OMP_WAIT_POLICY %s\n", m["cpu"].get<std::string>().c_str(),
              m["threads"].get<int>(), doc["isa"].get<std::string>().c_str(),
              m.value("omp_wait_policy", std::string("?")).c_str());
  std::printf("limits (same run): %s %.2f GB/s [%.2f, %.2f]; ", bw["what"].get<std::string>().c_str(),
              bw["value"].get<double>() / 1e9, bw["min"].get<double>() / 1e9, bw["max"].get<double>() / 1e9);
  print_rate("", pk);
  const bool w16 = std::any_of(doc["records"].begin(), doc["records"].end(),
                               [](const json& r) { return r["recipe"] == "w16a16"; });
  if (w16 && doc["peak_flops_w16a16"] != pk) print_rate("limit of w16a16 (FP32 FMA kernels): ", doc["peak_flops_w16a16"]);
  std::printf("%s\n\n", doc["plan"].get<std::string>().c_str());
  const bool torch_on = doc["torch"].contains("version");
  if (torch_on) {
    std::printf("torch baseline: BF16 F.linear, torch %s, %d thread(s), the same shapes, M and weight rotation "
                "(one process per round, after k3's)\n",
                doc["torch"]["version"].get<std::string>().c_str(), m["threads"].get<int>());
  } else {
    std::printf("torch baseline: not run (%s)\n", doc["torch"]["not_run"].get<std::string>().c_str());
  }
  std::printf("(of bw: of the read bandwidth probed at the start; of bwadj, M <= 8: median over the rounds of the "
              "fraction of the bandwidth probed right before and after that round's calls)\n");
  std::printf("%-11s %-6s %5s | %28s | %9s %7s %7s | %9s %7s%s\n", "K x N", "recipe", "M", "ms median [min, max]",
              "GB/s", "of bw", "of bwadj", "GFLOP/s", "of peak", torch_on ? " | torch ms   k3 speed-up" : "");
  bool over = false;
  for (const auto& r : doc["records"]) {
    const auto& t = r["time"];
    const double med = t["median_s"].get<double>();
    const double fbw = r["fraction_of_read_bandwidth"].get<double>(), fpk = r["fraction_of_peak"].get<double>();
    const double fadj = r.contains("fraction_of_adjacent_read_bandwidth")
                            ? r["fraction_of_adjacent_read_bandwidth"].get<double>() : 0;
    char adj[16] = "       -";
    if (fadj > 0) std::snprintf(adj, sizeof adj, "%7.1f%%", 100 * fadj);
    over = over || fbw > 1.0 || fpk > 1.0 || fadj > 1.0;
    char torch_col[64] = "";
    if (!r["torch_bf16"].is_null()) {
      std::snprintf(torch_col, sizeof torch_col, " | %8.3f %8.2fx", r["torch_bf16"]["time"]["median_s"].get<double>() * 1e3,
                    r["torch_bf16"]["k3_speedup"].get<double>());
    }
    std::printf("%5lldx%-5lld %-6s %5lld | %9.3f [%7.3f, %7.3f] | %9.2f %6.1f%% %s | %9.1f %6.1f%%%s%s\n",
                static_cast<long long>(r["k"].get<int64_t>()), static_cast<long long>(r["n"].get<int64_t>()),
                r["recipe"].get<std::string>().c_str(), static_cast<long long>(r["m"].get<int64_t>()), med * 1e3,
                t["min_s"].get<double>() * 1e3, t["max_s"].get<double>() * 1e3, r["bytes"].get<double>() / med / 1e9,
                100 * fbw, adj, r["flop"].get<double>() / med / 1e9, 100 * fpk, torch_col,
                over_limit_flag(std::max({fbw, fpk, fadj})));
  }
  if (over) std::printf("\nA fraction above 100%% means a limit probe read low (a busy machine); rerun on a quiet one.\n");
}

Status run(Args& a) {
  if (!a.output.empty()) K3_RETURN_IF_ERROR(check_output_path("--output", a.output));
  // The environment becomes options here: K3_NUM_THREADS, K3_ISA.
  if (a.c.threads <= 0) a.c.threads = default_thread_count();
  auto isa = a.isa.empty() ? active_isa_level() : parse_isa_level(a.isa);
  if (!isa.is_ok()) return Status(isa.status().code(), (a.isa.empty() ? "" : "--isa: ") + isa.status().message());
  a.c.isa = isa.value();
  harness::BenchHooks hooks;
  hooks.progress = progress;
  const harness::BenchResult r = harness::bench_linear(a.c, hooks);
  K3_RETURN_IF_ERROR(r.status);
  print(json::parse(r.json));
  if (!a.output.empty()) K3_RETURN_IF_ERROR(write_file_atomic(a.output, r.json, "--output"));
  return Status::ok();
}

const BenchRegistration kRegistration("linear", [](CLI::App& bench) -> CommandRun {
  auto* cmd = bench.add_subcommand("linear", "Dense linear layer (MXFP8 or BF16 weights): M sweep at the seed's and Kimi-Linear's shapes");
  auto a = std::make_shared<Args>();
  harness::LinearBenchConfig& c = a->c;
  cmd->add_option("--threads", c.threads, "Threads (default: K3_NUM_THREADS or all CPUs)")
      ->check(CLI::Range(0, k3::kMaxThreadCount));
  cmd->add_option("--isa", a->isa,
                  "CPU kernel level: scalar | avx2 | avx512 | avx512bf16 (default: K3_ISA or the CPU's best); the "
                  "peak is measured for the same level");
  cmd->add_option("--shapes", c.shapes, "KxN shapes (comma- or space-separated)")->delimiter(',')->capture_default_str();
  cmd->add_option("--recipes", c.recipes, "w8a16, w8a8 and / or w16a16 (BF16 weights)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--m", c.m, "Rows M (1 to 65536; comma- or space-separated)")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
  cmd->add_option("--iters", c.iters, "Timed calls per case and round (fewer for big cases)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--rounds", c.rounds, "Interleaved rounds over all cases")->capture_default_str()->check(CLI::Range(1, 100));
  cmd->add_option("--pool-mib", c.pool_mib, "Weights MiB rotated over per layer (defeats the cache)")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  cmd->add_option("--bw-mib", c.bw_mib, "Buffer of the read-bandwidth probe in MiB")
      ->capture_default_str()
      ->check(CLI::Range(16, 65536));
  cmd->add_option("--output", a->output, "Write JSON records to this file");
  cmd->add_option("--torch-python", c.torch_python,
                  "Python that runs torch's BF16 F.linear side by side, when it can import torch ('off': none)")
      ->capture_default_str();
  return [a]() { return run(*a); };
});

}  // namespace
}  // namespace k3::tool
