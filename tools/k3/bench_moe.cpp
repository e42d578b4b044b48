// `k3 bench moe`: parses the flags, runs the harness's fused-MoE benchmark
// (k3/harness/bench.hpp: input sets, iteration policy, traffic model, timer, JSON) and prints
// its records as a table:
//   decode  (M <= 64):  MXFP4 weight bytes streamed per second / read bandwidth
//   prefill (M >= 128): FLOP/s / peak of the dot-product instruction the kernel uses
// Both fractions are printed for every M; the "bound" column names the one that applies.
// --backend cuda: against the device copy bandwidth and a cuBLAS BF16 baseline.

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "backend_options.hpp"
#include "bench.hpp"
#include "k3/expert_map.hpp"
#include "k3/harness/atomic_file.hpp"
#include "k3/harness/bench.hpp"
#include "k3/system.hpp"

namespace k3::tool {
namespace {

using nlohmann::json;

struct MoeBenchArgs {
  harness::MoeBenchConfig c;
  std::string m_list;
  std::string isa;  // empty: K3_ISA or the CPU's best level
  std::string output;
};

Result<std::vector<int64_t>> parse_m_list(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 1 || v > (1 << 20)) {
      return invalid_argument("--m " + s + ": '" + item + "' is not a token count in [1, 1048576]");
    }
    out.push_back(v);
  }
  if (out.empty()) return invalid_argument("--m is empty");
  return out;
}

// Output paths are checked before the (long) run; a replay file is never overwritten.
Status check_output_flags(const MoeBenchArgs& a) {
  const std::string& routing = a.c.routing;
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--output", a.output},
                                   std::pair<const char*, const std::string&>{"--save-routing", a.c.save_routing}}) {
    if (path.empty()) continue;
    K3_RETURN_IF_ERROR(check_output_path(flag, path));
    if (routing.rfind("replay:", 0) == 0) {
      K3_RETURN_IF_ERROR(check_output_not_input(flag, path, "--routing replay:", routing.substr(7)));
    }
  }
  if (!a.output.empty() && !a.c.save_routing.empty()) {
    K3_RETURN_IF_ERROR(check_output_not_input("--save-routing", a.c.save_routing, "--output", a.output));
    if (a.output == a.c.save_routing) return invalid_argument("--output and --save-routing are both " + a.output);
  }
  return Status::ok();
}

ExpertLoad load_of(const json& h) {
  ExpertLoad l;
  l.mean = h["mean"].get<double>();
  l.p50 = h["p50"].get<int64_t>();
  l.p90 = h["p90"].get<int64_t>();
  l.max = h["max"].get<int64_t>();
  l.empty = h["empty_experts"].get<int>();
  return l;
}

void print_cpu_header(const json& doc) {
  const auto& m = doc["machine"];
  std::printf("cpu moe bench: %s, isa %s, %d thread(s), OMP_WAIT_POLICY %s; limits: read %.2f GB/s, %s %.1f GFLOP/s\n",
              m["cpu"].get<std::string>().c_str(), m["isa"].get<std::string>().c_str(), m["threads"].get<int>(),
              m.value("omp_wait_policy", std::string("?")).c_str(),
              doc["read_bandwidth_Bps"]["value"].get<double>() / 1e9,
              doc["dot_peak_flops"]["what"].get<std::string>().c_str(), doc["dot_peak_flops"]["value"].get<double>() / 1e9);
  if (doc["dot_peak_flops"].contains("note")) {
    std::printf("  note: %s\n", doc["dot_peak_flops"]["note"].get<std::string>().c_str());
  }
  std::printf("%-6s %6s %-10s %7s %9s %9s %9s %9s %7s %7s %9s %7s %-8s %s\n", "recipe", "M", "routing", "rows",
              "median_ms", "min_ms", "max_ms", "wGB/s", "%bw", "%bwadj", "GFLOP/s", "%peak", "bound", "rows/expert");
  std::printf("  (%%bw: of the read bandwidth probed at the start; %%bwadj, decode M: of the read bandwidth probed "
              "right before and after that M's calls)\n");
}

// Fraction of the read bandwidth probed next to a decode M's calls; 0 when the record has none.
double adjacent_fraction(const json& r) {
  return r.contains("fraction_of_adjacent_read_bandwidth") ? r["fraction_of_adjacent_read_bandwidth"].get<double>() : 0;
}

void print_cpu_row(const json& r) {
  const auto& t = r["timing"];
  const double frac_bw = r["fraction_of_read_bandwidth"].get<double>(), frac_peak = r["fraction_of_dot_peak"].get<double>();
  const double frac_adj = adjacent_fraction(r);
  char adj[16] = "      -";
  if (frac_adj > 0) std::snprintf(adj, sizeof adj, "%6.1f%%", 100 * frac_adj);
  std::printf("%-6s %6lld %-10s %7.0f %9.3f %9.3f %9.3f %9.2f %6.1f%% %s %9.1f %6.1f%% %-8s %s%s\n",
              r["recipe"].get<std::string>().c_str(), static_cast<long long>(r["m"].get<int64_t>()),
              r["routing"].get<std::string>().c_str(), r["histogram"]["rows_per_call"].get<double>(),
              t["median_s"].get<double>() * 1e3, t["min_s"].get<double>() * 1e3, t["max_s"].get<double>() * 1e3,
              r["weight_GBps"].get<double>(), 100 * frac_bw, adj, r["GFLOPs"].get<double>(), 100 * frac_peak,
              r["bound"].get<std::string>().c_str(), load_of(r["histogram"]).to_string().c_str(),
              over_limit_flag(std::max({frac_bw, frac_peak, frac_adj})));
  std::fflush(stdout);
}

void print_cuda_row(const json& r) {
  const std::string recipe = r["recipe"].get<std::string>();
  const auto m = static_cast<long long>(r["m"].get<int64_t>());
  if (r.contains("error")) {
    std::printf("%-6s %6lld k3 FAILED: %s\n", recipe.c_str(), m, r["error"].get<std::string>().c_str());
    std::fflush(stdout);
    return;
  }
  const auto& t = r["timing"];
  const double med = t["median_s"].get<double>(), bytes = r["weight_bytes_per_call"].get<double>();
  char cublas[64] = "       n/a      n/a";
  if (!r["cublas_bf16_median_s"].is_null()) {
    const double b = r["cublas_bf16_median_s"].get<double>();
    std::snprintf(cublas, sizeof cublas, "%10.3f %7.2fx", b * 1e3, b / med);
  }
  std::printf("%-6s %6lld %-14s %-10s %9.3f %9.3f %9.3f %8.3f %6.1f%% %s\n", recipe.c_str(), m,
              r["path"].get<std::string>().c_str(), r["routing"].get<std::string>().c_str(), med * 1e3,
              t["min_s"].get<double>() * 1e3, t["max_s"].get<double>() * 1e3, bytes / med / 1e12,
              100.0 * r["fraction_of_copy_bandwidth"].get<double>(), cublas);
  if (r.contains("cublas_unavailable")) {
    std::printf("       (cuBLAS baseline unavailable: %s)\n", r["cublas_unavailable"].get<std::string>().c_str());
  }
  std::fflush(stdout);
}

// Per recipe, the smallest decode M (fraction of the read bandwidth) and the largest prefill M
// (fraction of the level's peak): "; w4a8 M=1 41% of read bandwidth, M=2048 63% of peak".
std::string verdict(const json& records) {
  std::vector<std::string> recipes;
  for (const auto& r : records) {
    const auto name = r["recipe"].get<std::string>();
    if (std::find(recipes.begin(), recipes.end(), name) == recipes.end()) recipes.push_back(name);
  }
  std::string v;
  for (const std::string& recipe : recipes) {
    const json* dec = nullptr;
    const json* pre = nullptr;
    for (const auto& r : records) {
      if (r["recipe"] != recipe) continue;
      const int64_t m = r["m"].get<int64_t>();
      if (m <= 64 && (dec == nullptr || m < (*dec)["m"].get<int64_t>())) dec = &r;
      if (m >= 128 && (pre == nullptr || m > (*pre)["m"].get<int64_t>())) pre = &r;
    }
    char buf[160];
    if (dec != nullptr) {
      std::snprintf(buf, sizeof buf, "; %s M=%lld %.0f%% of read bandwidth", recipe.c_str(),
                    static_cast<long long>((*dec)["m"].get<int64_t>()),
                    100 * (*dec)["fraction_of_read_bandwidth"].get<double>());
      v += buf;
      if (const double adj = adjacent_fraction(*dec); adj > 0) {
        std::snprintf(buf, sizeof buf, " (%.0f%% of the bandwidth probed beside it)", 100 * adj);
        v += buf;
      }
    }
    if (pre != nullptr) {
      const std::string lead = dec != nullptr ? "," : "; " + recipe;
      std::snprintf(buf, sizeof buf, "%s M=%lld %.0f%% of peak", lead.c_str(),
                    static_cast<long long>((*pre)["m"].get<int64_t>()),
                    100 * (*pre)["fraction_of_dot_peak"].get<double>());
      v += buf;
    }
  }
  return v;
}

Status run_moe_bench(MoeBenchArgs& a) {
  K3_RETURN_IF_ERROR(check_output_flags(a));
  if (!a.m_list.empty()) {
    K3_ASSIGN_OR_RETURN(a.c.ms, parse_m_list(a.m_list));
  }
  const bool cuda = a.c.backend == "cuda";
  // The environment becomes options here: K3_NUM_THREADS, K3_ISA, K3_CUDA_MOE_PATH.
  const bool threads_from_env = a.c.threads <= 0;
  if (threads_from_env) a.c.threads = default_thread_count();
  auto isa = a.isa.empty() ? active_isa_level() : parse_isa_level(a.isa);
  if (!isa.is_ok()) return Status(isa.status().code(), (a.isa.empty() ? "" : "--isa: ") + isa.status().message());
  a.c.isa = isa.value();
  if (cuda) a.c.path = env_cuda_moe_path();
  K3_RETURN_IF_ERROR(harness::check_moe_bench(a.c));

  bool header = false;
  Status save_status;
  harness::BenchHooks hooks;
  hooks.progress = progress;
  hooks.log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  hooks.record = [&](const std::string& text) {
    const json r = json::parse(text);
    cuda ? print_cuda_row(r) : print_cpu_row(r);
  };
  hooks.partial = [&](const std::string& doc) {
    if (!header) {
      header = true;
      if (cuda) {
        std::printf("%-6s %6s %-14s %-10s %9s %9s %9s %8s %7s %10s %8s\n", "recipe", "M", "path", "routing", "median_ms",
                    "min_ms", "max_ms", "wTB/s", "%copy", "cublas_ms", "speedup");
      } else {
        print_cpu_header(json::parse(doc));
      }
    }
    // A device sweep stopped half way keeps what it measured.
    if (cuda && !a.output.empty() && save_status.is_ok()) save_status = write_file_atomic(a.output, doc, "--output");
  };
  const harness::BenchResult r = harness::bench_moe(a.c, hooks);
  K3_RETURN_IF_ERROR(save_status);
  Status st = r.status;
  if (!st.is_ok() && threads_from_env) st = with_thread_source(st, a.c.threads);
  st = with_path_source(st);
  if (r.json.empty()) return st;
  const json doc = json::parse(r.json);
  if (cuda) {
    std::printf("limits: device copy %.2f TB/s (read + write, 2 GiB, median of 10)\n",
                doc["copy_bandwidth_Bps"].get<double>() / 1e12);
  } else {
    const auto& m = doc["machine"];
    const auto& rec = doc["records"];
    std::printf("verdict: %s, isa %s (kernel %s), %d thread(s)%s\n", m["cpu"].get<std::string>().c_str(),
                m["isa"].get<std::string>().c_str(), rec.empty() ? "-" : rec[0]["kernel"].get<std::string>().c_str(),
                m["threads"].get<int>(), verdict(rec).c_str());
    const auto& bw = doc["read_bandwidth_Bps"];
    const auto& pk = doc["dot_peak_flops"];
    std::printf("limits: %s %.2f GB/s (min %.2f, max %.2f); %s %.1f GFLOP/s (min %.1f, max %.1f)\n",
                bw["what"].get<std::string>().c_str(), bw["value"].get<double>() / 1e9, bw["min"].get<double>() / 1e9,
                bw["max"].get<double>() / 1e9, pk["what"].get<std::string>().c_str(), pk["value"].get<double>() / 1e9,
                pk["min"].get<double>() / 1e9, pk["max"].get<double>() / 1e9);
  }
  if (!a.output.empty()) K3_RETURN_IF_ERROR(write_file_atomic(a.output, r.json, "--output"));
  return st;
}

const BenchRegistration kMoe("moe", [](CLI::App& bench) -> CommandRun {
  auto* cmd = bench.add_subcommand("moe", "CPU fused MoE: M sweep, limit fractions (decode: bandwidth, prefill: dot peak)");
  auto a = std::make_shared<MoeBenchArgs>();
  harness::MoeBenchConfig& c = a->c;
  cmd->add_option("--m", a->m_list, "Comma-separated token counts (default 1,2,4,...,2048; 8192 with --full)");
  cmd->add_flag("--full", c.full, "Add M = 8192 to the default sweep (about 10 minutes more on 2 cores)");
  cmd->add_option("--recipe", c.recipe, "w4a8 | w4a16 | both")->capture_default_str();
  cmd->add_option("--backend", c.backend,
                  "A fused-MoE backend: cpu or reference (host: vs read bandwidth and dot peak), cuda (vs device copy "
                  "bandwidth and cuBLAS BF16)")
      ->capture_default_str();
  cmd->add_option("--routing", c.routing, "uniform | zipf:S | ep_mixed | replay:FILE")->capture_default_str();
  cmd->add_option("--activation", c.activation, "situ | swiglu | silu")->capture_default_str();
  cmd->add_option("--threads", c.threads, "Threads (default: K3_NUM_THREADS or all CPUs)")
      ->check(CLI::Range(0, k3::kMaxThreadCount));
  cmd->add_option("--isa", a->isa,
                  "CPU kernel level: scalar | avx2 | avx512 | avx512bf16 (default: K3_ISA or the CPU's best); the "
                  "peak is measured for the same level");
  cmd->add_option("--avx-vnni", c.avx_vnni,
                  "FP32 levels on a CPU with AVX-VNNI: its VPDPWSSD for the exact int16 block dots; false runs "
                  "VPMADDWD + VPADDD, as a CPU without it (same bits)")
      ->capture_default_str();
  cmd->add_option("--hidden", c.hidden, "K")->capture_default_str();
  cmd->add_option("--intermediate", c.intermediate, "N")->capture_default_str();
  cmd->add_option("--experts", c.experts, "E (global)")->capture_default_str();
  cmd->add_option("--ep-size", c.ep_size, "Expert-parallel ranks")->capture_default_str();
  cmd->add_option("--ep-rank", c.ep_rank, "This rank")->capture_default_str();
  cmd->add_option("--top-k", c.top_k, "Slots per token")->capture_default_str();
  cmd->add_option("--iters", c.iters, "Timed iterations per M (default: 15 for M <= 16 down to 1 for M >= 2048)");
  cmd->add_option("--warmup", c.warmup, "Untimed iterations per M")->capture_default_str();
  cmd->add_option("--input-sets", c.input_sets, "Input / routing sets rotated across iterations")->capture_default_str();
  cmd->add_option("--bandwidth-mib", c.bandwidth_mib, "Buffer of the read-bandwidth probe (far above the LLC)")
      ->check(CLI::Range(64, 65536))
      ->capture_default_str();
  cmd->add_option("--seed", c.seed, "Seed of weights, inputs and routing")->capture_default_str();
  cmd->add_option("--save-routing", c.save_routing, "Write the routing ids of the largest M to FILE (replay format)");
  cmd->add_option("--output", a->output, "Write JSON records to this file");
  return [a]() { return run_moe_bench(*a); };
});

}  // namespace
}  // namespace k3::tool
