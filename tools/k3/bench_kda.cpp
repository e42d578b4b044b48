// `k3 bench kda`: parses the flags, runs the harness's KDA benchmark (k3/harness/bench.hpp:
// prefill T sweep, chunked vs recurrent, FLOP/s against the measured FP32 FMA peak; decode batch
// sweep, state bytes read + written per second against the measured read bandwidth; speculative
// verify) and prints its records as tables. --backend cuda: CUDA events, against the device copy
// bandwidth.
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.hpp"
#include "k3/harness/atomic_file.hpp"
#include "k3/harness/bench.hpp"
#include "k3/kda.hpp"
#include "k3/system.hpp"

namespace k3::tool {
namespace {

using nlohmann::json;

struct Args {
  harness::KdaBenchConfig c;
  std::string isa;  // empty: K3_ISA or the CPU's best level
  std::string output;
};

std::string ms3(const json& t) {  // "median [min, max]" in ms
  char buf[64];
  std::snprintf(buf, sizeof buf, "%9.3f [%7.3f, %7.3f]", t["median_s"].get<double>() * 1e3,
                t["min_s"].get<double>() * 1e3, t["max_s"].get<double>() * 1e3);
  return buf;
}

// --backend cuda: one row per record as it is measured.
void print_cuda_row(const json& r) {
  if (r["kind"] == "prefill") {
    std::string cols[2];
    int i = 0;
    for (const char* algo : {"recurrent", "chunked"}) {
      const json& t = r[algo];
      char buf[64];
      if (!t.contains("error")) {
        cols[i++] = ms3(t);
        continue;
      }
      std::snprintf(buf, sizeof buf, "%28s", t.contains("unsupported") ? "not built" : "FAILED");
      cols[i++] = buf;
    }
    std::printf("%7lld | %s | %s\n", static_cast<long long>(r["T"].get<int64_t>()), cols[0].c_str(), cols[1].c_str());
  } else {
    const auto N = static_cast<long long>(r["N"].get<int64_t>());
    const std::string dtype = r["state_dtype"].get<std::string>();
    if (r.contains("error")) {
      std::printf("%5lld %6s | FAILED: %s\n", N, dtype.c_str(), r["error"].get<std::string>().c_str());
    } else {
      const double bytes = r["state_bytes_read_written"].get<double>();
      std::printf("%5lld %6s | %s %12.1f %9.1f %11.1f%%\n", N, dtype.c_str(), ms3(r["timing"]).c_str(), bytes / 1e6,
                  bytes / r["timing"]["median_s"].get<double>() / 1e9, 100 * r["fraction_of_copy_bw"].get<double>());
    }
  }
  std::fflush(stdout);
}

void print_cuda_header(const json& doc, const harness::KdaBenchConfig& c) {
  std::printf("device: %s; device-to-device copy %.1f GB/s (read + written, 1 GiB)\n\n",
              doc["device"].get<std::string>().c_str(), doc["device_copy_Bps"].get<double>() / 1e9);
  std::printf("prefill H=%lld K=V=%lld, one sequence, BF16 q/k/v, safe gate (median [min, max] ms)\n",
              static_cast<long long>(c.heads), static_cast<long long>(c.head_dim));
  std::printf("%7s | %28s | %28s\n", "T", "recurrent ms", "chunked ms");
}

// --backend cpu: the three tables, from the document.
void print_cpu_tables(const json& doc, const harness::KdaBenchConfig& c) {
  const auto& m = doc["machine"];
  const auto& peak = doc["fp32_fma_peak_flops"];
  const auto& bw = doc["read_bandwidth_Bps"];
  const double peak_v = peak["value"].get<double>(), bw_v = bw["value"].get<double>();
  std::printf("machine: %s, %d thread(s), isa %s, OMP_WAIT_POLICY %s\n", m["cpu"].get<std::string>().c_str(),
              m["threads"].get<int>(), m["isa"].get<std::string>().c_str(),
              m.value("omp_wait_policy", std::string("?")).c_str());
  std::printf("limits:  %s %.1f GFLOP/s; %s %.2f GB/s\n\n", peak["what"].get<std::string>().c_str(), peak_v / 1e9,
              bw["what"].get<std::string>().c_str(), bw_v / 1e9);
  std::printf("prefill H=%lld K=V=%lld, one sequence (median [min, max] ms; GFLOP/s and %% of FMA peak)\n",
              static_cast<long long>(c.heads), static_cast<long long>(c.head_dim));
  std::printf("%7s | %28s %9s %6s | %28s %9s %6s | %9s\n", "T", "recurrent ms", "GFLOP/s", "peak", "chunked ms",
              "GFLOP/s", "peak", "rec/chk");
  bool above_peak = false;
  for (const auto& r : doc["records"]) {
    if (r["kind"] != "prefill") continue;
    const double fr = r["recurrent_flop"].get<double>() / r["recurrent"]["median_s"].get<double>();
    const double fc = r["chunked_flop"].get<double>() / r["chunked"]["median_s"].get<double>();
    above_peak |= fr > peak_v;
    std::printf("%7lld | %s %9.1f %5.1f%% | %s %9.1f %5.1f%% | %9.2f\n", static_cast<long long>(r["T"].get<int64_t>()),
                ms3(r["recurrent"]).c_str(), fr / 1e9, 100 * fr / peak_v, ms3(r["chunked"]).c_str(), fc / 1e9,
                100 * fc / peak_v, r["recurrent_over_chunked_median_ratio"].get<double>());
  }
  if (above_peak) {
    std::printf("note: a rate above 100%% means the FMA-peak probe under-measured the peak on this machine "
                "(shared or throttled cores, or a probe limited by its own loop); compare paths by rec/chk\n");
  }
  std::printf("\ndecode H=%lld K=V=%lld, one token per sequence (state read + written once per step)\n",
              static_cast<long long>(c.heads), static_cast<long long>(c.head_dim));
  std::printf("%5s | %28s %12s %9s %10s\n", "N", "step ms", "state MB", "GB/s", "of read bw");
  for (const auto& r : doc["records"]) {
    if (r["kind"] != "decode") continue;
    const double bytes = r["state_bytes_read_written"].get<double>();
    const double rate = bytes / r["timing"]["median_s"].get<double>();
    std::printf("%5lld | %s %12.1f %9.2f %9.1f%%\n", static_cast<long long>(r["N"].get<int64_t>()),
                ms3(r["timing"]).c_str(), bytes / 1e6, rate / 1e9, 100 * rate / bw_v);
  }
  bool header = false;
  for (const auto& r : doc["records"]) {
    if (r["kind"] != "verify") continue;
    if (!header) {
      header = true;
      std::printf("\nspeculative verify H=%lld K=V=%lld, T=%lld draft tokens per request, all accepted (median ms)\n",
                  static_cast<long long>(c.heads), static_cast<long long>(c.head_dim),
                  static_cast<long long>(c.draft_tokens));
      std::printf("%5s | %13s %10s | %13s %10s %10s %10s | %9s\n", "N", "snapshot MB/r", "verify ms", "replay MB/r",
                  "verify ms", "commit ms", "total ms", "total/snap");
    }
    const double snap = r["snapshot_verify"]["median_s"].get<double>();
    const double both = r["verify_replay_plus_commit"]["median_s"].get<double>();
    std::printf("%5lld | %13.2f %10.3f | %13.2f %10.3f %10.3f %10.3f | %9.2f\n", static_cast<long long>(r["N"].get<int64_t>()),
                r["snapshot_bytes_per_request"].get<double>() / 1e6, snap * 1e3,
                r["replay_bytes_per_request"].get<double>() / 1e6, r["verify_replay"]["median_s"].get<double>() * 1e3,
                r["commit"]["median_s"].get<double>() * 1e3, both * 1e3, both / snap);
  }
  if (header) std::printf("(MB/r: state memory per request: T snapshot states, or one state + its replay window)\n");
}

Status run(Args& a) {
  if (!a.output.empty()) K3_RETURN_IF_ERROR(check_output_path("--output", a.output));
  const bool cuda = a.c.backend == "cuda";
  // The environment becomes options here: K3_NUM_THREADS, K3_ISA.
  if (a.c.threads <= 0) a.c.threads = default_thread_count();
  auto isa = a.isa.empty() ? active_isa_level() : parse_isa_level(a.isa);
  if (!isa.is_ok()) return Status(isa.status().code(), (a.isa.empty() ? "" : "--isa: ") + isa.status().message());
  a.c.isa = isa.value();
  bool header = false, decode_header = false;
  Status save_status;
  harness::BenchHooks hooks;
  hooks.progress = progress;
  hooks.record = [&](const std::string& text) {
    if (!cuda) return;
    const json r = json::parse(text);
    if (r["kind"] == "decode" && !decode_header) {
      decode_header = true;
      std::printf("\ndecode H=%lld K=V=%lld, one token per sequence (state read + written once per step)\n",
                  static_cast<long long>(a.c.heads), static_cast<long long>(a.c.head_dim));
      std::printf("%5s %6s | %28s %12s %9s %12s\n", "N", "state", "step ms", "state MB", "GB/s", "of copy bw");
    }
    print_cuda_row(r);
  };
  hooks.partial = [&](const std::string& doc) {
    if (cuda && !header) {
      header = true;
      print_cuda_header(json::parse(doc), a.c);
    }
    // A device sweep stopped half way keeps what it measured.
    if (!a.output.empty() && save_status.is_ok()) save_status = write_file_atomic(a.output, doc, "--output");
  };
  const harness::BenchResult r = harness::bench_kda(a.c, hooks);
  K3_RETURN_IF_ERROR(save_status);
  if (r.json.empty()) return r.status;
  if (!cuda) print_cpu_tables(json::parse(r.json), a.c);
  if (!a.output.empty()) K3_RETURN_IF_ERROR(write_file_atomic(a.output, r.json, "--output"));
  return r.status;
}

const BenchRegistration kRegistration("kda", [](CLI::App& bench) -> CommandRun {
  auto* cmd = bench.add_subcommand("kda", "KDA prefill (chunked vs recurrent), decode and speculative-verify sweeps");
  auto a = std::make_shared<Args>();
  harness::KdaBenchConfig& c = a->c;
  cmd->add_option("--backend", c.backend, "cpu | cuda (cuda: CUDA events, vs the device copy bandwidth)")
      ->capture_default_str();
  cmd->add_option("--threads", c.threads, "Threads (default: K3_NUM_THREADS or all CPUs)")
      ->check(CLI::Range(0, k3::kMaxThreadCount));
  cmd->add_option("--isa", a->isa,
                  "CPU kernel level: scalar | avx2 | avx512 | avx512bf16 (default: K3_ISA or the CPU's best); the "
                  "FMA peak is measured for the same level");
  cmd->add_option("--heads", c.heads, "Heads H")->capture_default_str()->check(CLI::Range(1, 1024));
  cmd->add_option("--head-dim", c.head_dim, "K = V")->capture_default_str()->check(CLI::Range(1, 512));
  // Checked by CLI11, so `--prefill-t -5` is a flag error, not a failure deep in the library.
  cmd->add_option("--prefill-t", c.prefill_t, "Prefill lengths T (1 to 1048576)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--decode-n", c.decode_n, "Decode batch sizes N (1 to 65536)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
  cmd->add_option("--iters", c.iters, "Timed iterations per case")->capture_default_str()->check(CLI::Range(1, 1000));
  cmd->add_option("--pool-mib", c.pool_mib, "Decode: state MiB rotated over (defeats the cache)")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  cmd->add_option("--bw-mib", c.bw_mib, "Buffer of the read-bandwidth probe in MiB")
      ->capture_default_str()
      ->check(CLI::Range(16, 65536));
  cmd->add_option("--verify-n", c.verify_n,
                  "Speculative verify: requests N (1 to 65536; a single 0 skips the section): snapshot verify against "
                  "verify_replay + commit")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 16));
  cmd->add_option("--draft-tokens", c.draft_tokens, "Speculative verify: draft tokens T per request")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, kda::kMaxWindowTokens));
  cmd->add_option("--output", a->output, "Write JSON records to this file");
  return [a]() { return run(*a); };
});

}  // namespace
}  // namespace k3::tool
