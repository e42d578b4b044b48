// The benchmarks as a library (docs/moe.md, benchmark protocol): per op the input sets, the
// iteration policy, the traffic and FLOP models, the timer and the JSON document `k3 bench
// --output` writes. `k3 bench` parses flags and prints tables from the records; Python's k3.bench
// calls the same functions. A figure is a median over timed calls with its min and max, rated
// against machine limits measured in the same run.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "k3/harness/comm_bench.hpp"
#include "k3/harness/ep_bench.hpp"
#include "k3/harness/limits.hpp"
#include "k3/status.hpp"
#include "k3/system.hpp"

namespace k3::harness {

// ---- the timer ---------------------------------------------------------------------------

// Statistics over timed calls, in seconds.
struct Timing {
  double median = 0, min = 0, max = 0;
  int iterations = 0;
};

// Seconds on a monotonic clock.
double now_s();

// Median, min and max of `seconds` (not empty).
Timing summarize(std::vector<double> seconds);

// Runs fn() `warmup` times untimed, then `iters` times, each timed on its own.
Timing time_runs(const std::function<void()>& fn, int warmup, int iters);

// ---- what a benchmark reports while it runs --------------------------------------------

struct BenchHooks {
  // "[3/22] moe w4a8 M=16": before and after each step.
  std::function<void(int done, int total, const std::string& what)> progress;
  // A line for the log (what is being prepared, a phase's seconds).
  std::function<void(const std::string& line)> log;
  // Each record (one JSON object) as soon as it is measured.
  std::function<void(const std::string& record_json)> record;
  // The whole document so far: once the limits are measured (no records yet), then after each
  // record (a run stopped by a time limit keeps what it measured).
  std::function<void(const std::string& document_json)> partial;

  void step(int done, int total, const std::string& what) const {
    if (progress) progress(done, total, what);
  }
  void say(const std::string& line) const {
    if (log) log(line);
  }
};

// What a benchmark gives back: the JSON document (machine, limits, records) and the first error
// of a sweep that goes on past a failed case (the document then holds that case's error record).
struct BenchResult {
  std::string json;
  Status status;
};

// The machine of a record (cpu, logical_cpus, threads, isa, k3_version, build_type) as a JSON
// object.
std::string machine_json(int threads, IsaLevel isa);

// `k3 bench limits`: the read bandwidth over `buffer_mib` MiB, the dot-product peak and the FP32
// FMA peak of the best level, with `threads` (0: all logical CPUs).
BenchResult bench_limits(int threads, int64_t buffer_mib);

// ---- fused MoE ---------------------------------------------------------------------------

// `k3 bench moe`: the fused-MoE backend over an M sweep. A host backend (cpu, reference, ...):
// against the read bandwidth (decode, M <= 64) and the level's dot peak (prefill); cuda: against
// the device copy bandwidth and cuBLAS BF16 GEMMs on pre-dequantized weights. Every input is
// generated from `seed`.
struct MoeBenchConfig {
  std::string backend = "cpu";              // a name of k3::moe_backends(): cuda on the device, any other
                                            // on the host through its PreparedMoe
  std::vector<int64_t> ms;                  // empty: the default sweep (1 .. 2048; 8192 with full)
  bool full = false;
  std::string recipe = "w4a8";              // w4a8 | w4a16 | both
  std::string routing = "ep_mixed";         // uniform | zipf:S | ep_mixed | replay:FILE
  std::string activation = "situ";
  int64_t hidden = 3584, intermediate = 3072;
  int experts = 896, top_k = 16, ep_size = 32, ep_rank = 7;
  int iters = 0;                            // 0: by M (cpu 15 for M <= 16 down to 1; cuda 20)
  int warmup = 1;                           // cpu; the cuda sweep warms up 3 times
  int input_sets = 4;                       // cpu: input / routing sets rotated across calls
  int64_t bandwidth_mib = 1024;             // cpu: buffer of the read-bandwidth probe
  uint64_t seed = 20261129;
  int threads = 0;                          // cpu: 0 = all logical CPUs
  IsaLevel isa = best_isa_level();          // cpu: the kernel level, and the peak measured for it
  bool avx_vnni = true;                     // cpu: BackendOptions::avx_vnni
  std::string path;                         // cuda: a kernel path name, "" = the plan's choice
  std::string save_routing;                 // cpu: write the ids of the largest M here (replay format)
};

// Checks the whole configuration (M list, recipe, activation, routing, shape, a replay file)
// before anything is measured; errors name the flag.
Status check_moe_bench(const MoeBenchConfig& c);
BenchResult bench_moe(const MoeBenchConfig& c, const BenchHooks& hooks = {});

// ---- Kimi Delta Attention ------------------------------------------------------------------

// `k3 bench kda`: prefill over T (chunked against recurrent, A/B interleaved, FLOP/s against the
// FP32 FMA peak), decode over N (state bytes read + written per second against the read
// bandwidth, rotating over a pool larger than the cache) and speculative verify (snapshot verify
// against verify_replay + commit). cuda: prefill and decode timed with CUDA events against the
// device copy bandwidth.
struct KdaBenchConfig {
  std::string backend = "cpu";  // cpu | cuda
  int64_t heads = 96, head_dim = 128;
  std::vector<int64_t> prefill_t = {8, 16, 32, 48, 64, 96, 128, 256, 1024, 8192};
  std::vector<int64_t> decode_n = {1, 2, 4, 8, 16, 32, 64};
  std::vector<int64_t> verify_n = {64};  // a single 0: no verify section
  int64_t draft_tokens = 4;
  int iters = 5;
  int64_t pool_mib = 256;  // decode rotates over at least this much state
  int64_t bw_mib = 512;    // buffer of the read-bandwidth probe
  int threads = 0;
  IsaLevel isa = best_isa_level();
};

// FLOP per token and head of each prefill algorithm (multiply-add = 2).
double kda_flop_recurrent(double K, double V);
double kda_flop_chunked(double K, double V);

Status check_kda_bench(const KdaBenchConfig& c);
BenchResult bench_kda(const KdaBenchConfig& c, const BenchHooks& hooks = {});

// ---- dense linear --------------------------------------------------------------------------

// `k3 bench linear`: the dense linear layer (MXFP8 or BF16 weights) over an M sweep at the seed's
// and Kimi-Linear's shapes; small M against the read bandwidth, large M against the level's peak
// (W16A16: the FP32 FMA peak), weights rotated over pool_mib of prepacked copies, rounds
// interleaving the cases. torch's BF16 F.linear runs beside it when `torch_python` imports torch.
struct LinearBenchConfig {
  std::vector<std::string> shapes = {"1536x7168", "7168x3584", "3584x7168", "2304x4096", "4096x2304"};  // KxN
  std::vector<std::string> recipes = {"w8a16", "w8a8"};
  std::vector<int64_t> m = {1, 2, 4, 8, 32, 256, 1024};
  int iters = 10;
  int rounds = 3;
  int64_t pool_mib = 256;
  int64_t bw_mib = 512;
  int threads = 0;
  IsaLevel isa = best_isa_level();
  std::string torch_python = "python3";  // "" or "off": no torch baseline
};

// "1536x7168" -> {K, N}; errors quote the text.
Result<std::pair<int64_t, int64_t>> parse_linear_shape(const std::string& s);
Status check_linear_bench(const LinearBenchConfig& c);
BenchResult bench_linear(const LinearBenchConfig& c, const BenchHooks& hooks = {});

// ---- many ranks ----------------------------------------------------------------------------

// `k3 bench comm` (under mpirun): the JSON document of the EP dispatch / combine and TP
// all-reduce records (comm::bench_ep, comm::bench_allreduce*), measured on `world` ranks over
// `transport`.
std::string comm_bench_json(const std::vector<comm::EpBenchRecord>& ep,
                            const std::vector<comm::AllreduceBenchRecord>& allreduce, int world,
                            const std::string& transport, IsaLevel isa);

}  // namespace k3::harness
