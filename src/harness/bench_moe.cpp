// The fused-MoE benchmark (k3/harness/bench.hpp): decode M against the read bandwidth (MXFP4
// weight bytes streamed per second), prefill M against the dot peak of the level's instruction;
// on cuda against the device copy bandwidth and a cuBLAS BF16 baseline.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>

#include "bench_json.hpp"
#include "k3/backend.hpp"
#include "k3/cuda.hpp"
#include "k3/expert_map.hpp"
#include "k3/formats.hpp"
#include "k3/harness/bench.hpp"
#include "k3/harness/cuda_bench.hpp"
#include "k3/harness/moe_workload.hpp"

namespace k3::harness {
namespace {

constexpr int64_t kDefaultM[] = {1, 2, 4, 8, 16, 32, 64, 128, 512, 2048};

// Timed iterations per M on the cpu: a default sweep stays within a few minutes on 2 cores.
int default_iters(int64_t m) {
  if (m <= 16) return 15;
  if (m <= 128) return 7;
  if (m <= 512) return 3;
  return 1;
}

// The sweep, checked before anything is measured.
struct Sweep {
  std::vector<int64_t> ms;
  std::vector<Recipe> recipes;
  ActivationKind activation = ActivationKind::kSiTU;
  BenchRouting routing;
  MoeShape shape;
};

Result<Sweep> resolve(const MoeBenchConfig& c) {
  Sweep s;
  s.ms.assign(std::begin(kDefaultM), std::end(kDefaultM));
  if (c.full) s.ms.push_back(8192);
  if (!c.ms.empty()) {
    for (const int64_t m : c.ms) {
      if (m < 1 || m > (1 << 20)) return invalid_argument("--m: " + std::to_string(m) + " is not a token count in [1, 1048576]");
    }
    s.ms = c.ms;
  }
  if (c.recipe == "both") {
    s.recipes = {Recipe::kW4A8, Recipe::kW4A16};
  } else {
    auto r = parse_recipe(c.recipe);
    if (!r.is_ok()) return Status(r.status().code(), "--recipe: " + r.status().message());
    s.recipes = {r.value()};
  }
  auto act = parse_activation(c.activation);
  if (!act.is_ok()) return Status(act.status().code(), "--activation: " + act.status().message());
  s.activation = act.value();
  auto routing = parse_bench_routing(c.routing);
  if (!routing.is_ok()) return Status(routing.status().code(), "--" + routing.status().message());
  s.routing = routing.value();
  s.shape = MoeShape{c.hidden, c.intermediate, c.experts, c.top_k, c.ep_size, c.ep_rank};
  K3_RETURN_IF_ERROR(validate_moe_shape(s.shape));
  if (c.iters < 0) return invalid_argument("--iters " + std::to_string(c.iters) + " must be >= 0 (0: by M)");
  if (c.warmup < 0) return invalid_argument("--warmup " + std::to_string(c.warmup) + " must be >= 0");
  if (c.input_sets < 1 || c.input_sets > 64) {
    return invalid_argument("--input-sets " + std::to_string(c.input_sets) + " must be in [1, 64]");
  }
  if (c.bandwidth_mib < 16 || c.bandwidth_mib > 65536) {
    return invalid_argument("--bandwidth-mib " + std::to_string(c.bandwidth_mib) + " must be in [16, 65536]");
  }
  // Any backend of the registry: cuda is timed on the device with CUDA events, the others on the
  // host through their prepared layer (PreparedMoe::run).
  if (!find_moe_backend(c.backend).is_ok()) {
    std::string known;
    for (const auto& b : moe_backends()) known += (known.empty() ? "" : ", ") + b.name;
    return invalid_argument("--backend " + c.backend + " is not known (known: " + known + ")");
  }
  K3_RETURN_IF_ERROR(make_bench_routing(s.routing, s.shape, 1, c.seed).status());  // a bad replay fails now
  return s;
}

// One input set: x and its routing. Several per M so that consecutive calls touch different experts.
struct InputSet {
  std::vector<uint16_t> x;  // [M, K]
  RoutedTokens routing;     // ids / weights [M, top_k]
};

Result<std::vector<InputSet>> make_input_sets(const MoeBenchConfig& c, const Sweep& s, int64_t m) {
  std::vector<InputSet> sets(static_cast<size_t>(std::max(1, c.input_sets)));
  std::mt19937_64 rng(c.seed + static_cast<uint64_t>(m));
  std::normal_distribution<float> nd(0.f, 1.f);
  for (size_t i = 0; i < sets.size(); ++i) {
    sets[i].x.resize(static_cast<size_t>(m * c.hidden));
    for (auto& v : sets[i].x) v = bf16_from_f32(nd(rng));
    const uint64_t seed = c.seed + 1000003ull * static_cast<uint64_t>(i + 1) + static_cast<uint64_t>(m);
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
  const ReadBandwidthProbe* adjacent = nullptr;  // the read bandwidth next to each decode M
};

// Decode M (bound by the weight stream): also measured against the read bandwidth probed right
// before and right after its timed calls (best of kAdjacentPasses passes each; the larger of the two).
constexpr int64_t kDecodeMaxM = 64;
constexpr int kAdjacentPasses = 3;
constexpr int64_t kAdjacentMaxMib = 256;

// Times one M of one recipe: its JSON record.
Result<nlohmann::json> measure_m(const MoeBenchConfig& c, const Sweep& s, const Limits& lim, const PreparedMoe& layer,
                                 std::vector<uint8_t>& ws, int64_t m) {
  K3_ASSIGN_OR_RETURN(const std::vector<InputSet> sets, make_input_sets(c, s, m));
  K3_ASSIGN_OR_RETURN(const SetStats st, set_stats(s, sets, m, layer.tokens_per_pass()));
  std::vector<uint8_t> out(static_cast<size_t>(m * c.hidden * 2));
  size_t next = 0;
  Status run_status;
  auto call = [&]() {
    const InputSet& in_set = sets[next];
    next = (next + 1) % sets.size();
    const MoeInputsView in{m, in_set.x, in_set.routing.ids, in_set.routing.weights};
    Status r = layer.run(in, ws, out);
    if (!r.is_ok()) run_status = r;
  };
  const bool decode = m <= kDecodeMaxM;
  const bool adjacent = decode && lim.adjacent != nullptr;
  const double bw_before = adjacent ? lim.adjacent->measure(kAdjacentPasses) : 0;
  const Timing t = time_runs(call, c.warmup, c.iters > 0 ? c.iters : default_iters(m));
  const double bw_after = adjacent ? lim.adjacent->measure(kAdjacentPasses) : 0;
  K3_RETURN_IF_ERROR(run_status);
  const double gbps = st.bytes / t.median / 1e9, gflops = st.flops / t.median / 1e9;
  const double frac_bw = st.bytes / t.median / lim.bw.value, frac_peak = st.flops / t.median / lim.peak.value;
  const auto& sh = s.shape;
  nlohmann::json rec{
      {"op", "moe"},
      {"backend", layer.backend()},
      {"isa", isa_level_name(lim.isa)},
      {"kernel", layer.kernel()},
      {"recipe", recipe_name(layer.problem().recipe)},
      {"activation", c.activation},
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
  if (adjacent) {
    const double bw = std::max(bw_before, bw_after);
    rec["adjacent_read_bandwidth_Bps"] = {
        {"before", bw_before}, {"after", bw_after}, {"value", bw},
        {"what", "read bandwidth, best of " + std::to_string(kAdjacentPasses) + " passes over " +
                     std::to_string(lim.adjacent->bytes() >> 20) + " MiB right before and right after the timed "
                     "calls, the larger"}};
    rec["fraction_of_adjacent_read_bandwidth"] = st.bytes / t.median / bw;
  }
  return rec;
}

BenchResult bench_host(const MoeBenchConfig& c, const Sweep& s, const BenchHooks& hooks) {
  auto backend = find_moe_backend(c.backend);
  if (!backend.is_ok()) return {"", backend.status()};
  if (Status av = backend.value()->available(); !av.is_ok()) return {"", av};
  Limits lim;
  lim.threads = c.threads > 0 ? c.threads : hardware_thread_count();
  lim.isa = c.isa;
  const int64_t max_m = *std::max_element(s.ms.begin(), s.ms.end());
  if (!c.save_routing.empty()) {
    auto r = make_bench_routing(s.routing, s.shape, max_m, c.seed);
    if (!r.is_ok()) return {"", r.status()};
    if (Status st = save_routing_replay(c.save_routing, max_m, c.top_k, r->ids, "--save-routing"); !st.is_ok()) {
      return {"", st};
    }
    hooks.say("saved " + std::to_string(max_m) + " x " + std::to_string(c.top_k) + " ids to " + c.save_routing);
  }
  hooks.say("measuring machine limits (" + std::to_string(lim.threads) + " thread(s), isa " + isa_level_name(lim.isa) +
            ") ...");
  lim.bw = measure_read_bandwidth(lim.threads, c.bandwidth_mib << 20);
  lim.peak = measure_dot_peak(lim.threads, lim.isa);  // the instruction the level's kernel uses
  std::unique_ptr<ReadBandwidthProbe> adjacent;
  if (std::any_of(s.ms.begin(), s.ms.end(), [](int64_t m) { return m <= kDecodeMaxM; })) {
    adjacent = std::make_unique<ReadBandwidthProbe>(lim.threads, std::min<int64_t>(c.bandwidth_mib, kAdjacentMaxMib) << 20);
    lim.adjacent = adjacent.get();
  }
  hooks.say("preparing weights: E_local " + std::to_string(s.shape.local_experts()) + ", K " +
            std::to_string(c.hidden) + ", N " + std::to_string(c.intermediate) + " ...");
  const SyntheticMoeWeights weights = synthetic_moe_weights(s.shape, c.seed);

  Document doc({{"machine", machine(lim.threads, lim.isa)},
                {"read_bandwidth_Bps", to_json(lim.bw)},
                {"dot_peak_flops", to_json(lim.peak)}},
               hooks);  // published with the limits, before any record
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
    opt.avx_vnni = c.avx_vnni;
    auto layer = prepare_moe(*backend.value(), prob, weights.view(), opt);
    if (!layer.is_ok()) return {"", layer.status()};
    std::vector<uint8_t> ws(static_cast<size_t>((*layer)->workspace_bytes()));
    hooks.say((*layer)->describe());
    for (int64_t m : s.ms) {
      hooks.step(done++, total, std::string("moe ") + recipe_name(recipe) + " M=" + std::to_string(m));
      auto rec = measure_m(c, s, lim, **layer, ws, m);
      if (!rec.is_ok()) return {"", rec.status()};
      doc.add(std::move(rec.value()));
    }
  }
  hooks.step(total, total, "done");
  return {doc.text(), Status::ok()};
}

BenchResult bench_cuda(const MoeBenchConfig& c, const Sweep& s, const BenchHooks& hooks) {
  auto devs = cuda::devices();
  if (!devs.is_ok()) return {"", devs.status()};
  const auto& sh = s.shape;
  hooks.say("measuring the device copy bandwidth ...");
  auto copy = cuda::time_device_copy(int64_t{2} << 30, 3, 10);
  if (!copy.is_ok()) return {"", copy.status()};
  const double copy_bw = 2.0 * static_cast<double>(int64_t{2} << 30) / copy->median_s;  // read + write
  const SyntheticMoeWeights w = synthetic_moe_weights(sh, c.seed);
  const MoeWeightsView wv = w.view();
  Document doc({{"device", devs.value()[0].name},
                {"copy_bandwidth_Bps", copy_bw},
                {"note", "CUDA fused-MoE backend; see docs/cuda_moe.md"}},
               hooks);
  // A failed M is a record with its error; the sweep goes on and the first error is returned.
  Status first_error = Status::ok();
  const int warmup = 3;
  for (Recipe recipe : s.recipes) {
    for (int64_t m : s.ms) {
      MoeProblem prob;
      prob.shape = sh;
      prob.recipe = recipe;
      prob.activation.kind = s.activation;
      auto routing = make_bench_routing(s.routing, sh, m, c.seed + static_cast<uint64_t>(m));
      if (!routing.is_ok()) return {doc.text(), routing.status()};
      std::vector<uint16_t> x(static_cast<size_t>(m * c.hidden));
      std::mt19937 rng(static_cast<uint32_t>(c.seed + static_cast<uint64_t>(m)));
      std::normal_distribution<float> nd;
      for (auto& v : x) v = bf16_from_f32(nd(rng));
      const MoeInputsView in{m, x, routing->ids, routing->weights};
      // The whole call is one pass over the tokens: each active expert streams its weights once.
      auto traffic = moe_call_traffic(sh, m, routing->ids, std::max<int64_t>(m, 1));
      auto map = map_expert_parallel(sh, m, routing->ids);
      if (!traffic.is_ok()) return {doc.text(), traffic.status()};
      if (!map.is_ok()) return {doc.text(), map.status()};
      const int iters = c.iters > 0 ? c.iters : 20;
      nlohmann::json rec = {{"op", "moe"},           {"backend", "cuda"}, {"device", devs.value()[0].name},
                            {"recipe", recipe_name(recipe)}, {"m", m}, {"routing", s.routing.name()}};
      // The seconds of each phase: a run stopped by a time limit shows where the time went.
      const std::string tag = std::string(recipe_name(recipe)) + " M = " + std::to_string(m);
      hooks.say("k3 bench moe: " + tag + ": prepack + k3 timing ...");
      const double t_k3 = now_s();
      // Decode-sized calls rotate 4 weight copies so that no call finds its weights in L2.
      auto t = cuda::time_moe(prob, wv, in, warmup, iters, m <= 64 ? 4 : 1, c.path);
      if (!t.is_ok()) {  // k3's own failure: recorded, the sweep goes on, the run fails at the end
        rec["error"] = t.status().to_string();
        if (first_error.is_ok()) first_error = t.status();
        doc.add(std::move(rec));
        continue;
      }
      char secs[32];
      std::snprintf(secs, sizeof secs, "%.1f", now_s() - t_k3);
      hooks.say("k3 bench moe: " + tag + ": k3 done in " + secs + " s; cuBLAS baseline ...");
      const double t_base = now_s();
      // The baseline is optional: without cuBLAS (or when it fails) k3's timing stays, with the reason.
      auto base = cuda::time_cublas_baseline(prob, map->rows_per_expert, warmup, iters);
      std::snprintf(secs, sizeof secs, "%.1f", now_s() - t_base);
      hooks.say("k3 bench moe: " + tag + ": baseline done in " + secs + " s");
      const double bytes = traffic->weight_bytes;
      rec["path"] = t->path;
      rec["active_experts"] = traffic->active_experts;
      rec["timing"] = {{"median_s", t->median_s}, {"min_s", t->min_s}, {"max_s", t->max_s}, {"iterations", t->iterations}};
      if (base.is_ok()) {
        rec["cublas_bf16_median_s"] = base->median_s;
      } else {
        rec["cublas_bf16_median_s"] = nullptr;
        rec["cublas_unavailable"] = base.status().message();
      }
      rec["weight_bytes_per_call"] = bytes;
      rec["flop_per_call"] = traffic->flops;
      rec["fraction_of_copy_bandwidth"] = bytes / t->median_s / copy_bw;
      doc.add(std::move(rec));
    }
  }
  return {doc.text(), first_error};
}

}  // namespace

Status check_moe_bench(const MoeBenchConfig& c) { return resolve(c).status(); }

BenchResult bench_moe(const MoeBenchConfig& c, const BenchHooks& hooks) {
  auto s = resolve(c);
  if (!s.is_ok()) return {"", s.status()};
  if (c.backend != "cuda") return bench_host(c, s.value(), hooks);
  BenchResult r = bench_cuda(c, s.value(), hooks);
  if (!r.status.is_ok()) r.status = Status(r.status.code(), "--backend cuda: " + r.status.message());
  return r;
}

}  // namespace k3::harness
