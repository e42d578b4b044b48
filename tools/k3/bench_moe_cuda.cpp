// `k3 bench moe --backend cuda` (tools/k3/bench_moe_cuda.hpp). Ran on an H200 (2026-12-04).
#include "bench_moe_cuda.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include "backend_options.hpp"
#include "bench.hpp"
#include "k3/harness/atomic_file.hpp"
#include "k3/cuda.hpp"
#include "k3/harness/cuda_bench.hpp"
#include "k3/expert_map.hpp"
#include "k3/formats.hpp"
#include "k3/harness/moe_workload.hpp"

namespace k3::tool {

Status run_moe_bench_cuda(const CudaMoeBenchParams& p) {
  auto devs = cuda::devices();
  if (!devs.is_ok()) return devs.status();
  const auto& sh = p.sweep.shape;
  const int64_t k = sh.hidden;
  std::fprintf(stderr, "measuring the device copy bandwidth ...\n");
  auto copy = cuda::time_device_copy(int64_t{2} << 30, 3, 10);
  if (!copy.is_ok()) return copy.status();
  const double copy_bw = 2.0 * static_cast<double>(int64_t{2} << 30) / copy->median_s;  // read + write
  const SyntheticMoeWeights w = synthetic_moe_weights(sh, p.seed);
  const MoeWeightsView wv = w.view();
  std::printf("%-6s %6s %-14s %-10s %9s %9s %9s %8s %7s %10s %8s\n", "recipe", "M", "path", "routing", "median_ms", "min_ms",
              "max_ms", "wTB/s", "%copy", "cublas_ms", "speedup");
  nlohmann::json records = nlohmann::json::array();
  // The JSON is rewritten after every M, so that a run stopped half way (a time limit) keeps
  // what it measured. A failed M is a record with its error; the sweep goes on.
  Status first_error = Status::ok();
  auto save = [&]() -> Status {
    if (p.output.empty()) return Status::ok();
    const std::string text = nlohmann::json{{"copy_bandwidth_Bps", copy_bw}, {"records", records}}.dump(2) + "\n";
    return write_file_atomic(p.output, text, "--output");
  };
  K3_RETURN_IF_ERROR(save());
  for (Recipe recipe : p.sweep.recipes) {
    for (int64_t m : p.sweep.ms) {
      MoeProblem prob;
      prob.shape = sh;
      prob.recipe = recipe;
      prob.activation.kind = p.sweep.activation;
      K3_ASSIGN_OR_RETURN(const RoutedTokens routing, make_bench_routing(p.sweep.routing, sh, m, p.seed + static_cast<uint64_t>(m)));
      std::vector<uint16_t> x(static_cast<size_t>(m * k));
      std::mt19937 rng(static_cast<uint32_t>(p.seed + m));
      std::normal_distribution<float> nd;
      for (auto& v : x) v = bf16_from_f32(nd(rng));
      const MoeInputsView in{m, x, routing.ids, routing.weights};
      // The whole call is one pass over the tokens: each active expert streams its weights once.
      K3_ASSIGN_OR_RETURN(const MoeCallTraffic traffic, moe_call_traffic(sh, m, routing.ids, std::max<int64_t>(m, 1)));
      K3_ASSIGN_OR_RETURN(const EpMapping map, map_expert_parallel(sh, m, routing.ids));
      const int iters = p.iters > 0 ? p.iters : 20;
      // Decode-sized calls rotate 4 weight copies so that no call finds its weights in L2.
      nlohmann::json rec = {{"op", "moe"},
                            {"backend", "cuda"},
                            {"device", devs.value()[0].name},
                            {"recipe", recipe_name(recipe)},
                            {"m", m},
                            {"routing", p.sweep.routing.name()}};
      // Progress on stderr with the seconds of each phase: a run stopped by a time limit shows
      // which M it was in and where the time went (host preparation or the device).
      std::fprintf(stderr, "k3 bench moe: %s M = %lld: prepack + k3 timing ...\n", recipe_name(recipe),
                   static_cast<long long>(m));
      const auto t_k3 = std::chrono::steady_clock::now();
      auto t = cuda::time_moe(prob, wv, in, p.warmup, iters, m <= 64 ? 4 : 1, env_cuda_moe_path());
      const double k3_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_k3).count();
      if (!t.is_ok()) t = with_path_source(t.status());
      if (!t.is_ok()) {  // k3's own failure: recorded, the sweep goes on, the command fails at the end
        std::printf("%-6s %6lld k3 FAILED: %s\n", recipe_name(recipe), static_cast<long long>(m), t.status().to_string().c_str());
        std::fflush(stdout);
        rec["error"] = t.status().to_string();
        records.push_back(rec);
        if (first_error.is_ok()) first_error = t.status();
        K3_RETURN_IF_ERROR(save());
        continue;
      }
      // The baseline is optional: without cuBLAS (or when it fails) k3's timing stays, with the reason.
      std::fprintf(stderr, "k3 bench moe: %s M = %lld: k3 done in %.1f s; cuBLAS baseline ...\n", recipe_name(recipe),
                   static_cast<long long>(m), k3_s);
      const auto t_base = std::chrono::steady_clock::now();
      auto base = cuda::time_cublas_baseline(prob, map.rows_per_expert, p.warmup, iters);
      std::fprintf(stderr, "k3 bench moe: %s M = %lld: baseline done in %.1f s\n", recipe_name(recipe),
                   static_cast<long long>(m),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t_base).count());
      const int64_t active = traffic.active_experts;
      const double bytes = traffic.weight_bytes;
      const double tbps = bytes / t->median_s / 1e12;
      char cublas[64] = "       n/a      n/a";
      if (base.is_ok()) std::snprintf(cublas, sizeof cublas, "%10.3f %7.2fx", base->median_s * 1e3, base->median_s / t->median_s);
      std::printf("%-6s %6lld %-14s %-10s %9.3f %9.3f %9.3f %8.3f %6.1f%% %s\n", recipe_name(recipe),
                  static_cast<long long>(m), t->path.c_str(), p.sweep.routing.name().c_str(), t->median_s * 1e3, t->min_s * 1e3,
                  t->max_s * 1e3, tbps, 100.0 * bytes / t->median_s / copy_bw, cublas);
      if (!base.is_ok()) std::printf("       (cuBLAS baseline unavailable: %s)\n", base.status().message().c_str());
      std::fflush(stdout);
      rec["path"] = t->path;
      rec["active_experts"] = active;
      rec["timing"] = {{"median_s", t->median_s}, {"min_s", t->min_s}, {"max_s", t->max_s}};
      if (base.is_ok()) {
        rec["cublas_bf16_median_s"] = base->median_s;
      } else {
        rec["cublas_bf16_median_s"] = nullptr;
        rec["cublas_unavailable"] = base.status().message();
      }
      rec["weight_bytes_per_call"] = bytes;
      rec["flop_per_call"] = traffic.flops;
      rec["fraction_of_copy_bandwidth"] = bytes / t->median_s / copy_bw;
      records.push_back(rec);
      K3_RETURN_IF_ERROR(save());
    }
  }
  std::printf("limits: device copy %.2f TB/s (read + write, 2 GiB, median of 10)\n", copy_bw / 1e12);
  return first_error;
}

}  // namespace k3::tool
