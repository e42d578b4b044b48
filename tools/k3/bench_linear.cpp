// `k3 bench linear`: the dense MXFP8 linear layer at the seed's and Kimi-Linear's shapes, for an
// M sweep. Small M is reported against the read bandwidth (the weights stream once per call:
// N K (1 + 1/32) bytes), large M against the level's dot / FMA peak, both measured in the same
// run. Weights are rotated over several prepacked copies (at least --pool-mib) so that decode
// reads them from memory, not from the last-level cache. Rounds interleave the cases so that
// drift spreads over all of them. torch's F.linear side by side: python/benchmarks/linear_vs_torch.py.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench.hpp"
#include "k3/atomic_file.hpp"
#include "k3/cpu_linear.hpp"
#include "k3/formats.hpp"
#include "k3/system.hpp"

namespace k3::tool {
namespace {

struct Args {
  int threads = 0;
  std::string isa;
  std::vector<std::string> shapes = {"1536x7168", "7168x3584", "3584x7168", "2304x4096", "4096x2304"};
  std::vector<std::string> recipes = {"w8a16", "w8a8"};
  std::vector<int64_t> m = {1, 2, 4, 8, 32, 256, 1024};
  int iters = 10;
  int rounds = 3;
  int64_t pool_mib = 256;
  int64_t bw_mib = 512;
  std::string output;
};

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

Result<std::pair<int64_t, int64_t>> parse_shape(const std::string& s) {
  const auto x = s.find('x');
  try {
    if (x == std::string::npos) throw std::invalid_argument(s);
    size_t used = 0;
    const int64_t k = std::stoll(s.substr(0, x), &used);
    if (used != x) throw std::invalid_argument(s);
    const int64_t n = std::stoll(s.substr(x + 1), &used);
    if (used != s.size() - x - 1) throw std::invalid_argument(s);
    return std::make_pair(k, n);
  } catch (const std::exception&) {
    return invalid_argument("--shapes: '" + s + "' is not KxN (for example 1536x7168)");
  }
}

// Bytes of one layer's weights: 8 bits + one scale per 32 (MXFP8), or 16 bits (BF16).
int64_t weight_bytes(const LinearProblem& p) {
  return p.recipe == LinearRecipe::kW16A16 ? p.n * p.k * 2 : p.n * p.k * 33 / 32;
}

struct Layer {
  LinearProblem p;
  cpu::LinearPlan plan;
  std::vector<cpu::PackedLinear> copies;
  std::vector<uint8_t> ws;
};

Status run(const Args& a) {
  if (!a.output.empty()) K3_RETURN_IF_ERROR(check_output_path("--output", a.output));
  const int threads = a.threads > 0 ? a.threads : default_thread_count();
  auto isa = a.isa.empty() ? active_isa_level() : parse_isa_level(a.isa);
  if (!isa.is_ok()) return Status(isa.status().code(), (a.isa.empty() ? "" : "--isa: ") + isa.status().message());
  const int64_t max_m = *std::max_element(a.m.begin(), a.m.end());

  // Layers: one per (shape, recipe), each with enough copies to exceed the pool.
  std::vector<Layer> layers;
  std::mt19937 rng(7);
  for (const auto& s : a.shapes) {
    K3_ASSIGN_OR_RETURN(auto kn, parse_shape(s));
    for (const auto& r : a.recipes) {
      Layer l;
      l.p.k = kn.first;
      l.p.n = kn.second;
      auto rec = parse_linear_recipe(r);
      if (!rec.is_ok()) return invalid_argument("--recipes: " + rec.status().message());
      l.p.recipe = rec.value();
      l.p.out_dtype = OutDType::kBF16;
      K3_RETURN_IF_ERROR(validate_linear_problem(l.p));
      cpu::LinearOptions o;
      o.threads = threads;
      o.isa = isa.value();
      o.max_tokens = max_m;
      K3_ASSIGN_OR_RETURN(l.plan, cpu::plan(l.p, o));
      const bool b16 = l.p.recipe == LinearRecipe::kW16A16;
      std::vector<uint8_t> codes, scales;
      std::vector<uint16_t> wb;
      if (b16) {
        wb.resize(static_cast<size_t>(l.p.n * l.p.k));
        std::normal_distribution<float> wd(0.0f, 0.05f);
        for (auto& v : wb) v = bf16_from_f32(wd(rng));
      } else {
        codes.resize(static_cast<size_t>(l.p.n * l.p.k));
        scales.resize(static_cast<size_t>(l.p.n * l.p.k / 32));
        for (auto& c : codes) {
          do c = static_cast<uint8_t>(rng() & 0xFF);
          while ((c & 0x7F) == 0x7F);
        }
        for (auto& sc : scales) sc = static_cast<uint8_t>(118 + rng() % 12);
      }
      const LinearWeightsView w{codes, scales, {}, wb};
      const int64_t bytes = weight_bytes(l.p);
      const int64_t copies = std::max<int64_t>(1, (a.pool_mib << 20) / bytes + 1);
      for (int64_t c = 0; c < copies; ++c) {
        K3_ASSIGN_OR_RETURN(auto packed, cpu::prepack(l.plan, w));
        l.copies.push_back(std::move(packed));
      }
      l.ws.resize(static_cast<size_t>(l.plan.workspace_bytes));
      layers.push_back(std::move(l));
    }
  }

  const auto bw = measure_read_bandwidth(threads, a.bw_mib << 20);
  const auto peak = measure_dot_peak(threads, isa.value());
  std::printf("machine: %s, %d thread(s), isa %s\n", cpu_info().model.c_str(), threads, isa_level_name(isa.value()));
  std::printf("limits (same run): %s %.2f GB/s [%.2f, %.2f]; %s %.1f GFLOP/s [%.1f, %.1f]\n", bw.what.c_str(),
              bw.value / 1e9, bw.min / 1e9, bw.max / 1e9, peak.what.c_str(), peak.value / 1e9, peak.min / 1e9,
              peak.max / 1e9);
  print_probe_note(peak);
  // W16A16 runs FP32 FMAs on every level: on avx512bf16 its limit is the AVX-512 FP32 FMA peak.
  const bool fp32_peak_needed =
      isa.value() == IsaLevel::kAvx512Bf16 &&
      std::any_of(layers.begin(), layers.end(), [](const Layer& l) { return l.p.recipe == LinearRecipe::kW16A16; });
  const auto peak_fp32 = fp32_peak_needed ? measure_dot_peak(threads, IsaLevel::kAvx512) : peak;
  if (fp32_peak_needed) {
    std::printf("limit of w16a16 (FP32 FMA kernels): %s %.1f GFLOP/s [%.1f, %.1f]\n", peak_fp32.what.c_str(),
                peak_fp32.value / 1e9, peak_fp32.min / 1e9, peak_fp32.max / 1e9);
    print_probe_note(peak_fp32);
  }
  std::printf("%s\n\n", layers.front().plan.describe().c_str());

  // x for the largest M, shared (BF16 values of magnitude ~1).
  int64_t max_k = 0, max_n = 0;
  for (const auto& l : layers) max_k = std::max(max_k, l.p.k), max_n = std::max(max_n, l.p.n);
  std::vector<uint16_t> x(static_cast<size_t>(max_m * max_k));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& v : x) v = bf16_from_f32(nd(rng));
  std::vector<uint8_t> out(static_cast<size_t>(max_m * max_n * 2));

  // samples[layer][m] over all rounds
  std::vector<std::vector<std::vector<double>>> samples(layers.size(), std::vector<std::vector<double>>(a.m.size()));
  const int total = a.rounds * static_cast<int>(layers.size() * a.m.size());
  int done = 0;
  for (int round = 0; round < a.rounds; ++round) {
    for (size_t li = 0; li < layers.size(); ++li) {
      Layer& l = layers[li];
      for (size_t mi = 0; mi < a.m.size(); ++mi) {
        const int64_t m = a.m[mi];
        const auto xs = std::span<const uint16_t>(x).first(static_cast<size_t>(m * l.p.k));
        const auto os = std::span<uint8_t>(out).first(static_cast<size_t>(m * l.p.n * 2));
        const double work = 2.0 * static_cast<double>(m * l.p.n * l.p.k);
        const int iters = std::max(1, std::min(a.iters, static_cast<int>(2e10 / std::max(work, 1.0))));
        size_t c = round % l.copies.size();
        K3_RETURN_IF_ERROR(cpu::run(l.plan, l.copies[c], m, xs, l.ws, os));  // warm-up
        for (int i = 0; i < iters; ++i) {
          c = (c + 1) % l.copies.size();
          const double t0 = now_s();
          K3_RETURN_IF_ERROR(cpu::run(l.plan, l.copies[c], m, xs, l.ws, os));
          samples[li][mi].push_back(now_s() - t0);
        }
        progress(++done, total,
                 "linear " + std::to_string(l.p.k) + "x" + std::to_string(l.p.n) + " " +
                     linear_recipe_name(l.p.recipe) + " M=" + std::to_string(m));
      }
    }
  }

  nlohmann::json records = nlohmann::json::array();
  std::printf("%-11s %-6s %5s | %28s | %9s %7s | %9s %7s\n", "K x N", "recipe", "M", "ms median [min, max]", "GB/s",
              "of bw", "GFLOP/s", "of peak");
  bool over = false;
  for (size_t li = 0; li < layers.size(); ++li) {
    const Layer& l = layers[li];
    for (size_t mi = 0; mi < a.m.size(); ++mi) {
      auto t = samples[li][mi];
      std::sort(t.begin(), t.end());
      const Timing tm{t[t.size() / 2], t.front(), t.back(), static_cast<int>(t.size())};
      const int64_t m = a.m[mi];
      const double bytes = static_cast<double>(weight_bytes(l.p)) + static_cast<double>(m * (l.p.k + l.p.n) * 2);
      const double gbs = bytes / tm.median, flops = 2.0 * static_cast<double>(m * l.p.n * l.p.k) / tm.median;
      const double fbw = gbs / bw.value;
      const double fpk = flops / (l.p.recipe == LinearRecipe::kW16A16 ? peak_fp32.value : peak.value);
      over = over || fbw > 1.0 || fpk > 1.0;
      std::printf("%5lldx%-5lld %-6s %5lld | %9.3f [%7.3f, %7.3f] | %9.2f %6.1f%% | %9.1f %6.1f%%%s\n",
                  static_cast<long long>(l.p.k), static_cast<long long>(l.p.n), linear_recipe_name(l.p.recipe),
                  static_cast<long long>(m), tm.median * 1e3, tm.min * 1e3, tm.max * 1e3, gbs / 1e9, 100 * fbw,
                  flops / 1e9, 100 * fpk, over_limit_flag(std::max(fbw, fpk)));
      records.push_back({{"k", l.p.k},
                         {"n", l.p.n},
                         {"recipe", linear_recipe_name(l.p.recipe)},
                         {"m", m},
                         {"time", to_json(tm)},
                         {"bytes", bytes},
                         {"flop", 2.0 * static_cast<double>(m * l.p.n * l.p.k)},
                         {"fraction_of_read_bandwidth", fbw},
                         {"fraction_of_peak", fpk}});
    }
  }
  if (over)
    std::printf("\nA fraction above 100%% means a limit probe read low (a busy machine); rerun on a quiet one.\n");
  if (!a.output.empty()) {
    nlohmann::json j = {{"machine", machine_json(threads)},
                        {"isa", isa_level_name(isa.value())},
                        {"plan", layers.front().plan.describe()},
                        {"read_bandwidth_Bps", to_json(bw)},
                        {"peak_flops", to_json(peak)},
                        {"peak_flops_w16a16", to_json(peak_fp32)},
                        {"rounds", a.rounds},
                        {"pool_mib", a.pool_mib},
                        {"records", records}};
    K3_RETURN_IF_ERROR(write_file_atomic(a.output, j.dump(2) + "\n", "--output"));
  }
  return Status::ok();
}

const BenchRegistration kRegistration("linear", [](CLI::App& bench) -> CommandRun {
  auto* cmd = bench.add_subcommand("linear", "Dense linear layer (MXFP8 or BF16 weights): M sweep at the seed's and Kimi-Linear's shapes");
  auto a = std::make_shared<Args>();
  cmd->add_option("--threads", a->threads, "Threads (default: K3_NUM_THREADS or all CPUs)");
  cmd->add_option("--isa", a->isa,
                  "CPU kernel level: scalar | avx2 | avx512 | avx512bf16 (default: K3_ISA or the CPU's best); the "
                  "peak is measured for the same level");
  cmd->add_option("--shapes", a->shapes, "KxN shapes (comma- or space-separated)")->delimiter(',')->capture_default_str();
  cmd->add_option("--recipes", a->recipes, "w8a16, w8a8 and / or w16a16 (BF16 weights)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--m", a->m, "Rows M (1 to 65536; comma- or space-separated)")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
  cmd->add_option("--iters", a->iters, "Timed calls per case and round (fewer for big cases)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--rounds", a->rounds, "Interleaved rounds over all cases")->capture_default_str()->check(CLI::Range(1, 100));
  cmd->add_option("--pool-mib", a->pool_mib, "Weights MiB rotated over per layer (defeats the cache)")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  cmd->add_option("--bw-mib", a->bw_mib, "Buffer of the read-bandwidth probe in MiB")
      ->capture_default_str()
      ->check(CLI::Range(16, 65536));
  cmd->add_option("--output", a->output, "Write JSON records to this file");
  return [a]() { return run(*a); };
});

}  // namespace
}  // namespace k3::tool
