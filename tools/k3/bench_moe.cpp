// `k3 bench moe`: the CPU fused-MoE backend over an M sweep, as fractions of the machine's
// limits measured in the same run (docs/moe.md, benchmark protocol):
//   decode  (M <= 64):  MXFP4 weight bytes streamed per second / read bandwidth
//   prefill (M >= 128): FLOP/s / peak of the dot-product instruction the kernel uses
// Both fractions are printed for every M; the "bound" column names the one that applies.

#include <algorithm>
#include <cstdio>
#include <random>
#include <sstream>

#include "backend_options.hpp"
#include "bench.hpp"
#include "bench_moe_cuda.hpp"
#include "k3/harness/atomic_file.hpp"
#include "k3/backend.hpp"
#include "k3/expert_map.hpp"
#include "k3/formats.hpp"
#include "k3/harness/moe_workload.hpp"
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

using Sweep = MoeBenchSweep;

// Output paths are checked before the (long) run; a replay file is never overwritten.
Status check_output_flags(const MoeBenchArgs& a) {
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
  return Status::ok();
}

Result<Sweep> resolve_sweep(const MoeBenchArgs& a) {
  Sweep s;
  s.ms.assign(std::begin(kDefaultM), std::end(kDefaultM));
  if (a.full) s.ms.push_back(8192);
  if (!a.m_list.empty()) {
    K3_ASSIGN_OR_RETURN(s.ms, parse_m_list(a.m_list));
  }
  if (a.recipe == "both") {
    s.recipes = {Recipe::kW4A8, Recipe::kW4A16};
  } else {
    K3_ASSIGN_OR_RETURN(const Recipe r, parse_recipe(a.recipe));
    s.recipes = {r};
  }
  K3_ASSIGN_OR_RETURN(s.activation, parse_activation(a.activation));
  auto routing = parse_bench_routing(a.routing);
  if (!routing.is_ok()) return Status(routing.status().code(), "--" + routing.status().message());
  s.routing = routing.value();
  s.shape = MoeShape{a.k, a.n, a.experts, a.top_k, a.ep_size, a.ep_rank};
  K3_RETURN_IF_ERROR(validate_moe_shape(s.shape));
  return s;
}

// One input set: x and its routing. Several per M so that consecutive calls touch different experts.
struct InputSet {
  std::vector<uint16_t> x;  // [M, K]
  RoutedTokens routing;     // ids / weights [M, top_k]
};

Result<std::vector<InputSet>> make_input_sets(const MoeBenchArgs& a, const Sweep& s, int64_t m) {
  std::vector<InputSet> sets(static_cast<size_t>(std::max(1, a.input_sets)));
  std::mt19937_64 rng(a.seed + static_cast<uint64_t>(m));
  std::normal_distribution<float> nd(0.f, 1.f);
  for (size_t i = 0; i < sets.size(); ++i) {
    sets[i].x.resize(static_cast<size_t>(m * a.k));
    for (auto& v : sets[i].x) v = bf16_from_f32(nd(rng));
    const uint64_t seed = a.seed + 1000003ull * static_cast<uint64_t>(i + 1) + static_cast<uint64_t>(m);
    K3_ASSIGN_OR_RETURN(sets[i].routing, make_bench_routing(s.routing, s.shape, m, seed));
  }
  return sets;
}

// What a call over one input set does, averaged over the sets: weight bytes streamed, FLOPs,
// rows, the rows-per-expert histogram and the padding a block-8 grouped GEMM would add.
struct SetStats {
  double bytes = 0, flops = 0, rows = 0, padding = 0;
  ExpertLoad load;
};

Result<SetStats> set_stats(const Sweep& s, const std::vector<InputSet>& sets, int64_t m, int64_t chunk_tokens) {
  SetStats st;
  std::vector<int64_t> all_rows;
  const double n = static_cast<double>(sets.size());
  for (const auto& c : sets) {
    K3_ASSIGN_OR_RETURN(const MoeCallTraffic t, moe_call_traffic(s.shape, m, c.routing.ids, chunk_tokens));
    K3_ASSIGN_OR_RETURN(const EpMapping map, map_expert_parallel(s.shape, m, c.routing.ids));
    st.bytes += t.weight_bytes / n;
    st.flops += t.flops / n;
    st.rows += static_cast<double>(t.local_slots) / n;
    all_rows.insert(all_rows.end(), map.rows_per_expert.begin(), map.rows_per_expert.end());
    if (auto pad = pad_to_block(map, 8); pad.is_ok()) st.padding += pad->padding_fraction / n;
  }
  st.load = expert_load(all_rows);
  return st;
}

struct Limits {
  MeasuredRate bw, peak;
  int threads = 1;
  IsaLevel isa = IsaLevel::kScalar;
};

// Times one M of one recipe, prints its row and returns its JSON record.
Result<nlohmann::json> measure_m(const MoeBenchArgs& a, const Sweep& s, const Limits& lim, const PreparedMoe& layer,
                                 std::vector<uint8_t>& ws, int64_t m) {
  K3_ASSIGN_OR_RETURN(const std::vector<InputSet> sets, make_input_sets(a, s, m));
  K3_ASSIGN_OR_RETURN(const SetStats st, set_stats(s, sets, m, layer.tokens_per_pass()));
  std::vector<uint8_t> out(static_cast<size_t>(m * a.k * 2));
  size_t next = 0;
  Status run_status;
  auto call = [&]() {
    const InputSet& c = sets[next];
    next = (next + 1) % sets.size();
    const MoeInputsView in{m, c.x, c.routing.ids, c.routing.weights};
    Status r = layer.run(in, ws, out);
    if (!r.is_ok()) run_status = r;
  };
  const Timing t = time_runs(call, a.warmup, a.iters > 0 ? a.iters : default_iters(m));
  K3_RETURN_IF_ERROR(run_status);
  const double gbps = st.bytes / t.median / 1e9, gflops = st.flops / t.median / 1e9;
  const double frac_bw = st.bytes / t.median / lim.bw.value, frac_peak = st.flops / t.median / lim.peak.value;
  const bool decode = m <= 64;
  const Recipe recipe = layer.problem().recipe;
  std::printf("%-6s %6lld %-10s %7.0f %9.3f %9.3f %9.3f %9.2f %6.1f%% %9.1f %6.1f%% %-8s %s%s\n", recipe_name(recipe),
              static_cast<long long>(m), s.routing.name().c_str(), st.rows, t.median * 1e3, t.min * 1e3, t.max * 1e3,
              gbps, 100 * frac_bw, gflops, 100 * frac_peak, decode ? "memory" : "compute", st.load.to_string().c_str(),
              over_limit_flag(std::max(frac_bw, frac_peak)));
  std::fflush(stdout);
  const auto& sh = s.shape;
  return nlohmann::json{
      {"op", "moe"},
      {"backend", layer.backend()},
      {"isa", isa_level_name(lim.isa)},
      {"kernel", layer.kernel()},
      {"recipe", recipe_name(recipe)},
      {"activation", a.activation},
      {"m", m},
      {"shape", {{"K", sh.hidden}, {"N", sh.intermediate}, {"E", sh.num_experts}, {"E_local", sh.local_experts()},
                 {"top_k", sh.top_k}, {"ep_size", sh.ep_size}, {"ep_rank", sh.ep_rank}}},
      {"routing", s.routing.name()},
      {"input_sets", sets.size()},
      {"histogram", {{"rows_per_call", st.rows}, {"mean", st.load.mean}, {"p50", st.load.p50}, {"p90", st.load.p90},
                     {"max", st.load.max}, {"empty_experts", st.load.empty}, {"padding_fraction_block8", st.padding}}},
      {"plan", layer.describe()},
      {"timing", to_json(t)},
      {"weight_bytes_per_call", st.bytes},
      {"flop_per_call", st.flops},
      {"weight_GBps", gbps},
      {"GFLOPs", gflops},
      {"fraction_of_read_bandwidth", frac_bw},
      {"fraction_of_dot_peak", frac_peak},
      {"bound", decode ? "memory" : "compute"}};
}

// Per recipe, the smallest decode M (fraction of the read bandwidth) and the largest prefill M
// (fraction of the level's peak): "; w4a8 M=1 41% of read bandwidth, M=2048 63% of peak".
std::string verdict(const std::vector<Recipe>& recipes, const nlohmann::json& records) {
  std::string v;
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
      v += buf;
    }
    if (pre != nullptr) {
      const std::string lead = dec != nullptr ? "," : std::string("; ") + recipe_name(recipe);
      std::snprintf(buf, sizeof buf, "%s M=%lld %.0f%% of peak", lead.c_str(),
                    static_cast<long long>((*pre)["m"].get<int64_t>()),
                    100 * (*pre)["fraction_of_dot_peak"].get<double>());
      v += buf;
    }
  }
  return v;
}

Status run_moe_bench_cpu(const MoeBenchArgs& a, const Sweep& s) {
  K3_ASSIGN_OR_RETURN(const MoeBackend* backend, find_moe_backend("cpu"));
  Limits lim;
  lim.threads = a.threads > 0 ? a.threads : default_thread_count();
  const int64_t max_m = *std::max_element(s.ms.begin(), s.ms.end());
  auto isa = a.isa.empty() ? active_isa_level() : parse_isa_level(a.isa);
  if (!isa.is_ok()) return Status(isa.status().code(), (a.isa.empty() ? "" : "--isa: ") + isa.status().message());
  lim.isa = isa.value();

  K3_RETURN_IF_ERROR(make_bench_routing(s.routing, s.shape, 1, a.seed).status());  // a bad replay fails now
  if (!a.save_routing.empty()) {
    K3_ASSIGN_OR_RETURN(const RoutedTokens r, make_bench_routing(s.routing, s.shape, max_m, a.seed));
    K3_RETURN_IF_ERROR(save_routing_replay(a.save_routing, max_m, a.top_k, r.ids, "--save-routing"));
    std::fprintf(stderr, "saved %lld x %d ids to %s\n", static_cast<long long>(max_m), a.top_k, a.save_routing.c_str());
  }

  std::fprintf(stderr, "measuring machine limits (%d thread(s), isa %s) ...\n", lim.threads, isa_level_name(lim.isa));
  lim.bw = measure_read_bandwidth(lim.threads, a.bandwidth_mib << 20);
  lim.peak = measure_dot_peak(lim.threads, lim.isa);  // the instruction the level's kernel uses
  print_probe_note(lim.peak);

  std::fprintf(stderr, "preparing weights: E_local %d, K %lld, N %lld ...\n", s.shape.local_experts(),
               static_cast<long long>(a.k), static_cast<long long>(a.n));
  const SyntheticMoeWeights weights = synthetic_moe_weights(s.shape, a.seed);

  nlohmann::json records = nlohmann::json::array();
  std::printf("cpu moe bench: %s, isa %s, %d thread(s); limits: read %.2f GB/s, %s %.1f GFLOP/s\n",
              cpu_info().model.c_str(), isa_level_name(lim.isa), lim.threads, lim.bw.value / 1e9,
              lim.peak.what.c_str(), lim.peak.value / 1e9);
  std::printf("%-6s %6s %-10s %7s %9s %9s %9s %9s %7s %9s %7s %-8s %s\n", "recipe", "M", "routing", "rows", "median_ms",
              "min_ms", "max_ms", "wGB/s", "%bw", "GFLOP/s", "%peak", "bound", "rows/expert");
  const int total = static_cast<int>(s.ms.size() * s.recipes.size());
  int done = 0;
  for (Recipe recipe : s.recipes) {
    MoeProblem prob;
    prob.shape = s.shape;
    prob.recipe = recipe;
    prob.activation.kind = s.activation;
    prob.out_dtype = OutDType::kBF16;
    BackendOptions opt;
    opt.threads = lim.threads;
    opt.max_tokens = max_m;
    opt.isa = lim.isa;
    auto layer = prepare_moe(*backend, prob, weights.view(), opt);
    if (!layer.is_ok()) return a.threads > 0 ? layer.status() : with_thread_source(layer.status(), lim.threads);
    std::vector<uint8_t> ws(static_cast<size_t>((*layer)->workspace_bytes()));
    std::fprintf(stderr, "%s\n", (*layer)->describe().c_str());
    for (int64_t m : s.ms) {
      progress(done++, total, std::string("moe ") + recipe_name(recipe) + " M=" + std::to_string(m));
      K3_ASSIGN_OR_RETURN(nlohmann::json record, measure_m(a, s, lim, **layer, ws, m));
      records.push_back(std::move(record));
    }
  }
  progress(total, total, "done");
  std::printf("verdict: %s, isa %s (kernel %s), %d thread(s)%s\n", cpu_info().model.c_str(), isa_level_name(lim.isa),
              records.empty() ? "-" : records[0]["kernel"].get<std::string>().c_str(), lim.threads,
              verdict(s.recipes, records).c_str());
  std::printf("limits: %s %.2f GB/s (min %.2f, max %.2f); %s %.1f GFLOP/s (min %.1f, max %.1f)\n",
              lim.bw.what.c_str(), lim.bw.value / 1e9, lim.bw.min / 1e9, lim.bw.max / 1e9, lim.peak.what.c_str(),
              lim.peak.value / 1e9, lim.peak.min / 1e9, lim.peak.max / 1e9);
  if (a.output.empty()) return Status::ok();
  nlohmann::json machine = machine_json(lim.threads);
  machine["isa"] = isa_level_name(lim.isa);
  const nlohmann::json j = {{"machine", machine},
                            {"read_bandwidth_Bps", to_json(lim.bw)},
                            {"dot_peak_flops", to_json(lim.peak)},
                            {"records", records}};
  return write_file_atomic(a.output, j.dump(2) + "\n", "--output");
}

Status run_moe_bench(const MoeBenchArgs& a) {
  K3_RETURN_IF_ERROR(check_output_flags(a));
  K3_ASSIGN_OR_RETURN(const Sweep s, resolve_sweep(a));
  if (a.backend == "cpu") return run_moe_bench_cpu(a, s);
  if (a.backend != "cuda") return invalid_argument("--backend " + a.backend + " is not known (cpu or cuda)");
  CudaMoeBenchParams cp;
  cp.sweep = s;
  cp.iters = a.iters;
  cp.seed = a.seed;
  cp.output = a.output;
  const Status st = run_moe_bench_cuda(cp);
  return st.is_ok() ? st : Status(st.code(), "--backend cuda: " + st.message());
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
