#include "k3/harness/bench.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "bench_json.hpp"
#include "k3/build_info.hpp"

namespace k3::harness {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

Timing summarize(std::vector<double> t) {
  if (t.empty()) return {};
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front(), t.back(), static_cast<int>(t.size())};
}

Timing time_runs(const std::function<void()>& fn, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> t;
  t.reserve(static_cast<size_t>(std::max(iters, 0)));
  for (int i = 0; i < iters; ++i) {
    const double t0 = now_s();
    fn();
    t.push_back(now_s() - t0);
  }
  return summarize(std::move(t));
}

namespace {
std::string omp_wait_policy() {
  const char* v = std::getenv("OMP_WAIT_POLICY");
  return v != nullptr && *v != '\0' ? v : "unset";
}
}  // namespace

std::string machine_json(int threads, IsaLevel isa) {
  // The OpenMP wait policy changes short calls: with OMP_WAIT_POLICY=passive every call wakes
  // sleeping threads (about 50 us per call on the 2-vCPU KVM guests), unset they spin a while.
  const nlohmann::json j = {{"cpu", cpu_info().model},
                            {"logical_cpus", cpu_info().logical_cpus},
                            {"threads", threads},
                            {"omp_wait_policy", omp_wait_policy()},
                            {"isa", isa_level_name(isa)},
                            {"k3_version", build::kVersion},
                            {"build_type", build::kBuildType}};
  return j.dump();
}

BenchResult bench_limits(int threads, int64_t buffer_mib) {
  if (Status st = check_thread_count(threads, "--threads"); !st.is_ok()) return {"", st};
  if (buffer_mib < 64 || buffer_mib > 65536) {
    return {"", invalid_argument("--buffer-mib " + std::to_string(buffer_mib) + " must be in [64, 65536]")};
  }
  if (threads == 0) threads = hardware_thread_count();
  const IsaLevel isa = best_isa_level();
  const MeasuredRate bw = measure_read_bandwidth(threads, buffer_mib << 20);
  const MeasuredRate dot = measure_dot_peak(threads);
  const MeasuredRate fma = measure_fp32_fma_peak(threads);
  const nlohmann::json j = {{"machine", machine(threads, isa)},
                            {"read_bandwidth_Bps", to_json(bw)},
                            {"dot_peak_flops", to_json(dot)},
                            {"fp32_fma_peak_flops", to_json(fma)}};
  return {j.dump(2) + "\n", Status::ok()};
}

std::string comm_bench_json(const std::vector<comm::EpBenchRecord>& ep,
                            const std::vector<comm::AllreduceBenchRecord>& allreduce, int world,
                            const std::string& transport, IsaLevel isa) {
  nlohmann::json j;
  for (const auto& r : ep) {
    j["ep"].push_back({{"m_per_rank", r.m},
                       {"mxfp8_wire", r.mxfp8_wire},
                       {"dispatch_bytes_per_rank", r.dispatch_bytes},
                       {"combine_bytes_per_rank", r.combine_bytes},
                       {"k3_dispatch_us", r.dispatch_us},
                       {"k3_combine_us", r.combine_us},
                       {"native_alltoallv_dispatch_us", r.native_dispatch_us},
                       {"native_alltoallv_combine_us", r.native_combine_us}});
  }
  for (const auto& r : allreduce) {
    j["allreduce"].push_back({{"bytes", r.bytes},
                              {"rows", r.rows},
                              {"cols", r.cols},
                              {"k3_us", r.k3_us},
                              {"k3_rmsnorm_us", r.k3_rmsnorm_us},
                              {"native_allreduce_f32_us", r.native_us},
                              {"k3_busbw_gbs", r.k3_busbw_gbs},
                              {"native_busbw_gbs", r.native_busbw_gbs}});
  }
  j["machine"] = machine(1, isa);
  j["world_size"] = world;
  j["transport"] = transport;
  return j.dump(2) + "\n";
}

}  // namespace k3::harness
