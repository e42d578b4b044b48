// `k3 bench moe`: the CPU fused-MoE backend over an M sweep, as fractions of the machine's
// limits measured in the same run (docs/moe.md, benchmark protocol):
//   decode  (M <= 64):  MXFP4 weight bytes streamed per second / read bandwidth
//   prefill (M >= 128): FLOP/s / peak of the dot-product instruction the kernel uses
// Both fractions are printed for every M; the "bound" column names the one that applies.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <cstdio>
#include <memory>
#include <random>
#include <sstream>

#include "backend_options.hpp"
#include "bench.hpp"
#include "bench_moe_cuda.hpp"
#include "bench_moe_routing.hpp"
#include "k3/atomic_file.hpp"
#include "k3/cpu_moe.hpp"
#include "k3/expert_map.hpp"
#include "k3/formats.hpp"
#include "k3/system.hpp"

namespace k3::tool {
namespace {

struct MoeBenchArgs {
  std::string m_list;
  std::string recipe = "w4a8";
  std::string routing = "ep_mixed";
  std::string activation = "situ";
  std::string output, save_routing;
  std::string backend = "cpu";
  std::string isa;  // empty: K3_ISA or the CPU's best level
  int threads = 0;
  int64_t k = 3584, n = 3072;
  int experts = 896, ep_size = 32, ep_rank = 7, top_k = 16;
  int iters = 0, warmup = 1, input_sets = 4;
  int64_t bandwidth_mib = 1024;
  bool full = false;
  uint64_t seed = 20261129;
};

constexpr int64_t kDefaultM[] = {1, 2, 4, 8, 16, 32, 64, 128, 512, 2048};

// Timed iterations per M: a default sweep stays within a few minutes on 2 cores.
int default_iters(int64_t m) {
  if (m <= 16) return 15;
  if (m <= 128) return 7;
  if (m <= 512) return 3;
  return 1;
}

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

// Random MXFP4 weights: codes uniform, scales 2^-8 .. 2^-6 (unit-scale GEMM outputs at Kimi
// fan-ins); only the bytes streamed matter to the timing, the values to nothing but finiteness.
void random_weights(const MoeShape& sh, uint64_t seed, std::vector<uint8_t>& f1q, std::vector<uint8_t>& f1s,
                    std::vector<uint8_t>& f2q, std::vector<uint8_t>& f2s) {
  const int64_t el = sh.local_experts(), k = sh.hidden, n = sh.intermediate;
  f1q.resize(static_cast<size_t>(el * 2 * n * k / 2));
  f1s.resize(static_cast<size_t>(el * 2 * n * k / 32));
  f2q.resize(static_cast<size_t>(el * k * n / 2));
  f2s.resize(static_cast<size_t>(el * k * n / 32));
  // splitmix64 of the byte offset: fast, seeded, and independent of the thread count.
  auto fill = [seed](std::vector<uint8_t>& v) {
    const int64_t words = static_cast<int64_t>(v.size() / 8);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < words; ++i) {
      uint64_t z = seed + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      std::memcpy(v.data() + i * 8, &z, 8);
    }
  };
  fill(f1q);
  fill(f2q);
  std::mt19937_64 rng(seed);
  for (auto& s : f1s) s = static_cast<uint8_t>(119 + rng() % 3);
  for (auto& s : f2s) s = static_cast<uint8_t>(119 + rng() % 3);
}

struct Case {
  std::vector<uint16_t> x;        // [M, K]
  Routing routing;                // ids / weights [M, top_k]
};

Status run_moe_bench(const MoeBenchArgs& a) {
  // Output paths are checked before the (long) run; a replay file is never overwritten.
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--output", a.output},
                                   std::pair<const char*, const std::string&>{"--save-routing", a.save_routing}}) {
    if (path.empty()) continue;
    K3_RETURN_IF_ERROR(check_output_path(flag, path));
    if (a.routing.rfind("replay:", 0) == 0) {
      K3_RETURN_IF_ERROR(check_output_not_input(flag, path, "--routing replay:", a.routing.substr(7)));
    }
  }
  if (!a.output.empty() && !a.save_routing.empty()) {
    K3_RETURN_IF_ERROR(check_output_not_input("--save-routing", a.save_routing, "--output", a.output));
    if (a.output == a.save_routing) return invalid_argument("--output and --save-routing are both " + a.output);
  }
  std::vector<int64_t> ms(std::begin(kDefaultM), std::end(kDefaultM));
  if (a.full) ms.push_back(8192);
  if (!a.m_list.empty()) {
    auto r = parse_m_list(a.m_list);
    if (!r.is_ok()) return r.status();
    ms = r.value();
  }
  std::vector<Recipe> recipes;
  if (a.recipe == "both") {
    recipes = {Recipe::kW4A8, Recipe::kW4A16};
  } else {
    auto r = parse_recipe(a.recipe);
    if (!r.is_ok()) return r.status();
    recipes = {r.value()};
  }
  auto act = parse_activation(a.activation);
  if (!act.is_ok()) return act.status();
  auto spec = parse_routing(a.routing);
  if (!spec.is_ok()) return spec.status();
  const MoeShape shape{a.k, a.n, a.experts, a.top_k, a.ep_size, a.ep_rank};
  K3_RETURN_IF_ERROR(validate_moe_shape(shape));
  if (a.backend == "cuda") {
    CudaMoeBenchParams cp;
    cp.ms = ms;
    cp.recipes = recipes;
    cp.activation = act.value();
    cp.routing = spec.value();
    cp.shape = shape;
    cp.iters = a.iters;
    cp.seed = a.seed;
    cp.output = a.output;
    const Status st = run_moe_bench_cuda(cp);
    return st.is_ok() ? st : Status(st.code(), "--backend cuda: " + st.message());
  }
  if (a.backend != "cpu") return invalid_argument("--backend " + a.backend + " is not known (cpu or cuda)");
  const int threads = a.threads > 0 ? a.threads : default_thread_count();
  const int64_t max_m = *std::max_element(ms.begin(), ms.end());
  auto isa = a.isa.empty() ? active_isa_level() : parse_isa_level(a.isa);
  if (!isa.is_ok()) return Status(isa.status().code(), (a.isa.empty() ? "" : "--isa: ") + isa.status().message());

  if (auto probe = make_routing(spec.value(), shape, 1, a.seed); !probe.is_ok()) return probe.status();
  if (!a.save_routing.empty()) {
    auto r = make_routing(spec.value(), shape, max_m, a.seed);
    if (!r.is_ok()) return r.status();
    K3_RETURN_IF_ERROR(save_routing(a.save_routing, max_m, a.top_k, r->ids));
    std::fprintf(stderr, "saved %lld x %d ids to %s\n", static_cast<long long>(max_m), a.top_k, a.save_routing.c_str());
  }

  std::fprintf(stderr, "measuring machine limits (%d thread(s), isa %s) ...\n", threads, isa_level_name(isa.value()));
  const MeasuredRate bw = measure_read_bandwidth(threads, a.bandwidth_mib << 20);
  const MeasuredRate peak = measure_dot_peak(threads, isa.value());  // the instruction the level's kernel uses

  std::fprintf(stderr, "preparing weights: E_local %d, K %lld, N %lld ...\n", shape.local_experts(),
               static_cast<long long>(a.k), static_cast<long long>(a.n));
  std::vector<uint8_t> f1q, f1s, f2q, f2s;
  random_weights(shape, a.seed, f1q, f1s, f2q, f2s);
  const MoeWeightsView wv{f1q, f1s, f2q, f2s, {}, {}};

  nlohmann::json records = nlohmann::json::array();
  std::printf("cpu moe bench: %s, isa %s, %d thread(s); limits: read %.2f GB/s, %s %.1f GFLOP/s\n",
              cpu_info().model.c_str(), isa_level_name(isa.value()), threads, bw.value / 1e9, peak.what.c_str(),
              peak.value / 1e9);
  std::printf("%-6s %6s %-10s %7s %9s %9s %9s %9s %7s %9s %7s %-8s %s\n", "recipe", "M", "routing", "rows", "median_ms",
              "min_ms", "max_ms", "wGB/s", "%bw", "GFLOP/s", "%peak", "bound", "rows/expert");
  const int total = static_cast<int>(ms.size() * recipes.size());
  int done = 0;
  for (Recipe recipe : recipes) {
    MoeProblem prob;
    prob.shape = shape;
    prob.recipe = recipe;
    prob.activation.kind = act.value();
    prob.out_dtype = OutDType::kBF16;
    cpu::MoeOptions opt;
    opt.threads = threads;
    opt.max_tokens = max_m;
    opt.isa = isa.value();
    auto plan = cpu::plan(prob, opt);
    if (!plan.is_ok()) return a.threads > 0 ? plan.status() : with_thread_source(plan.status(), threads);
    auto packed = cpu::prepack(plan.value(), wv);
    if (!packed.is_ok()) return packed.status();
    std::vector<uint8_t> ws(static_cast<size_t>(plan->workspace_bytes));
    std::fprintf(stderr, "%s\n", plan->describe().c_str());
    for (int64_t m : ms) {
      progress(done, total, std::string("moe ") + recipe_name(recipe) + " M=" + std::to_string(m));
      // Several input sets (x and routing) so that consecutive calls touch different experts.
      const int sets = std::max(1, a.input_sets);
      std::vector<Case> cases(static_cast<size_t>(sets));
      std::mt19937_64 rng(a.seed + static_cast<uint64_t>(m));
      std::normal_distribution<float> nd(0.f, 1.f);
      for (int s = 0; s < sets; ++s) {
        auto& c = cases[static_cast<size_t>(s)];
        c.x.resize(static_cast<size_t>(m * a.k));
        for (auto& v : c.x) v = bf16_from_f32(nd(rng));
        auto r = make_routing(spec.value(), shape, m, a.seed + 1000003ull * static_cast<uint64_t>(s + 1) + static_cast<uint64_t>(m));
        if (!r.is_ok()) return r.status();
        c.routing = std::move(r.value());
      }
      std::vector<uint8_t> out(static_cast<size_t>(m * a.k * 2));
      // Bytes streamed and FLOPs of each set: every local expert with rows reads FC1 + FC2 once
      // per chunk of tokens it has rows in.
      double bytes = 0, flops = 0;
      int64_t rows = 0;
      ExpertLoad load;
      double padding = 0;
      std::vector<int64_t> all_rows;
      for (const auto& c : cases) {
        auto map = map_expert_parallel(shape, m, c.routing.ids);
        if (!map.is_ok()) return map.status();
        for (int64_t t0 = 0; t0 < m; t0 += plan->chunk_tokens) {
          const int64_t t1 = std::min(m, t0 + plan->chunk_tokens);
          std::vector<char> used(static_cast<size_t>(shape.local_experts()), 0);
          for (int64_t i = t0 * a.top_k; i < t1 * a.top_k; ++i) {
            const int32_t l = map->local_ids[static_cast<size_t>(i)];
            if (l >= 0) used[static_cast<size_t>(l)] = 1;
          }
          for (char u : used) bytes += u ? static_cast<double>(packed->fc1_expert_bytes() + packed->fc2_expert_bytes()) : 0.0;
        }
        rows += map->local_slots;
        flops += 2.0 * static_cast<double>(map->local_slots) * 3.0 * static_cast<double>(a.k * a.n);
        all_rows.insert(all_rows.end(), map->rows_per_expert.begin(), map->rows_per_expert.end());
        auto pad = pad_to_block(map.value(), 8);
        if (pad.is_ok()) padding += pad->padding_fraction / sets;
      }
      load = expert_load(all_rows);
      bytes /= sets;
      flops /= sets;
      const double rows_per_call = static_cast<double>(rows) / sets;
      int next = 0;
      Status run_status;
      auto call = [&]() {
        const Case& c = cases[static_cast<size_t>(next)];
        next = (next + 1) % sets;
        const MoeInputsView in{m, c.x, c.routing.ids, c.routing.weights};
        Status s = cpu::run(plan.value(), packed.value(), in, ws, out);
        if (!s.is_ok()) run_status = s;
      };
      const int iters = a.iters > 0 ? a.iters : default_iters(m);
      const Timing t = time_runs(call, a.warmup, iters);
      if (!run_status.is_ok()) return run_status;
      const double gbps = bytes / t.median / 1e9, gflops = flops / t.median / 1e9;
      const double frac_bw = bytes / t.median / bw.value, frac_peak = flops / t.median / peak.value;
      const bool decode = m <= 64;
      std::printf("%-6s %6lld %-10s %7.0f %9.3f %9.3f %9.3f %9.2f %6.1f%% %9.1f %6.1f%% %-8s %s\n",
                  recipe_name(recipe), static_cast<long long>(m), spec->name().c_str(), rows_per_call,
                  t.median * 1e3, t.min * 1e3, t.max * 1e3, gbps, 100 * frac_bw, gflops, 100 * frac_peak,
                  decode ? "memory" : "compute", load.to_string().c_str());
      std::fflush(stdout);
      records.push_back({{"op", "moe"},
                         {"backend", "cpu"},
                         {"isa", isa_level_name(isa.value())},
                         {"kernel", plan->blocking.kernel},
                         {"recipe", recipe_name(recipe)},
                         {"activation", a.activation},
                         {"m", m},
                         {"shape", {{"K", a.k}, {"N", a.n}, {"E", a.experts}, {"E_local", shape.local_experts()},
                                    {"top_k", a.top_k}, {"ep_size", a.ep_size}, {"ep_rank", a.ep_rank}}},
                         {"routing", spec->name()},
                         {"input_sets", sets},
                         {"histogram", {{"rows_per_call", rows_per_call}, {"mean", load.mean}, {"p50", load.p50},
                                        {"p90", load.p90}, {"max", load.max}, {"empty_experts", load.empty},
                                        {"padding_fraction_block8", padding}}},
                         {"plan", plan->describe()},
                         {"timing", to_json(t)},
                         {"weight_bytes_per_call", bytes},
                         {"flop_per_call", flops},
                         {"weight_GBps", gbps},
                         {"GFLOPs", gflops},
                         {"fraction_of_read_bandwidth", frac_bw},
                         {"fraction_of_dot_peak", frac_peak},
                         {"bound", decode ? "memory" : "compute"}});
      ++done;
    }
  }
  progress(total, total, "done");
  // One line for the machine: per recipe, the smallest decode M (fraction of the read bandwidth)
  // and the largest prefill M (fraction of the level's peak).
  std::string verdict;
  for (Recipe recipe : recipes) {
    const nlohmann::json* dec = nullptr;
    const nlohmann::json* pre = nullptr;
    for (const auto& r : records) {
      if (r["recipe"] != recipe_name(recipe)) continue;
      const int64_t m = r["m"].get<int64_t>();
      if (m <= 64 && (dec == nullptr || m < (*dec)["m"].get<int64_t>())) dec = &r;
      if (m >= 128 && (pre == nullptr || m > (*pre)["m"].get<int64_t>())) pre = &r;
    }
    char buf[160];
    if (dec != nullptr) {
      std::snprintf(buf, sizeof buf, "; %s M=%lld %.0f%% of read bandwidth", recipe_name(recipe),
                    static_cast<long long>((*dec)["m"].get<int64_t>()),
                    100 * (*dec)["fraction_of_read_bandwidth"].get<double>());
      verdict += buf;
    }
    if (pre != nullptr) {
      const std::string lead = dec != nullptr ? "," : std::string("; ") + recipe_name(recipe);
      std::snprintf(buf, sizeof buf, "%s M=%lld %.0f%% of peak", lead.c_str(),
                    static_cast<long long>((*pre)["m"].get<int64_t>()),
                    100 * (*pre)["fraction_of_dot_peak"].get<double>());
      verdict += buf;
    }
  }
  std::printf("verdict: %s, isa %s (kernel %s), %d thread(s)%s\n", cpu_info().model.c_str(), isa_level_name(isa.value()),
              records.empty() ? "-" : records[0]["kernel"].get<std::string>().c_str(), threads, verdict.c_str());
  std::printf("limits: %s %.2f GB/s (min %.2f, max %.2f); %s %.1f GFLOP/s (min %.1f, max %.1f)\n", bw.what.c_str(),
              bw.value / 1e9, bw.min / 1e9, bw.max / 1e9, peak.what.c_str(), peak.value / 1e9, peak.min / 1e9,
              peak.max / 1e9);
  if (!a.output.empty()) {
    nlohmann::json machine = machine_json(threads);
    machine["isa"] = isa_level_name(isa.value());
    nlohmann::json j = {{"machine", machine},
                        {"read_bandwidth_Bps", to_json(bw)},
                        {"dot_peak_flops", to_json(peak)},
                        {"records", records}};
    K3_RETURN_IF_ERROR(write_file_atomic(a.output, j.dump(2) + "\n", "--output"));
  }
  return Status::ok();
}

const BenchRegistration kMoe("moe", [](CLI::App& bench) -> CommandRun {
  auto* cmd = bench.add_subcommand("moe", "CPU fused MoE: M sweep, limit fractions (decode: bandwidth, prefill: dot peak)");
  auto a = std::make_shared<MoeBenchArgs>();
  cmd->add_option("--m", a->m_list, "Comma-separated token counts (default 1,2,4,...,2048; 8192 with --full)");
  cmd->add_flag("--full", a->full, "Add M = 8192 to the default sweep (about 10 minutes more on 2 cores)");
  cmd->add_option("--recipe", a->recipe, "w4a8 | w4a16 | both")->capture_default_str();
  cmd->add_option("--backend", a->backend, "cpu | cuda (cuda: vs device copy bandwidth and cuBLAS BF16)")
      ->capture_default_str();
  cmd->add_option("--routing", a->routing, "uniform | zipf:S | ep_mixed | replay:FILE")->capture_default_str();
  cmd->add_option("--activation", a->activation, "situ | swiglu | silu")->capture_default_str();
  cmd->add_option("--threads", a->threads, "Threads (default: K3_NUM_THREADS or all CPUs)");
  cmd->add_option("--isa", a->isa,
                  "CPU kernel level: scalar | avx2 | avx512 | avx512bf16 (default: K3_ISA or the CPU's best); the "
                  "peak is measured for the same level");
  cmd->add_option("--hidden", a->k, "K")->capture_default_str();
  cmd->add_option("--intermediate", a->n, "N")->capture_default_str();
  cmd->add_option("--experts", a->experts, "E (global)")->capture_default_str();
  cmd->add_option("--ep-size", a->ep_size, "Expert-parallel ranks")->capture_default_str();
  cmd->add_option("--ep-rank", a->ep_rank, "This rank")->capture_default_str();
  cmd->add_option("--top-k", a->top_k, "Slots per token")->capture_default_str();
  cmd->add_option("--iters", a->iters, "Timed iterations per M (default: 15 for M <= 16 down to 1 for M >= 2048)");
  cmd->add_option("--warmup", a->warmup, "Untimed iterations per M")->capture_default_str();
  cmd->add_option("--input-sets", a->input_sets, "Input / routing sets rotated across iterations")->capture_default_str();
  cmd->add_option("--bandwidth-mib", a->bandwidth_mib, "Buffer of the read-bandwidth probe (far above the LLC)")
      ->check(CLI::Range(64, 65536))
      ->capture_default_str();
  cmd->add_option("--seed", a->seed, "Seed of weights, inputs and routing")->capture_default_str();
  cmd->add_option("--save-routing", a->save_routing, "Write the routing ids of the largest M to FILE (replay format)");
  cmd->add_option("--output", a->output, "Write JSON records to this file");
  return [a]() { return run_moe_bench(*a); };
});

}  // namespace
}  // namespace k3::tool
