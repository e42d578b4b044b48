// `k3 bench kda`: prefill T sweep (chunked vs recurrent, FLOP/s against the measured FP32 FMA
// peak) and decode batch sweep (state bytes read + written per second against the measured read
// bandwidth). Medians with min / max; A/B interleaved per round so that drift cancels.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "bench.hpp"
#include "k3/harness/kda_case.hpp"
#include "k3/harness/atomic_file.hpp"
#include "k3/cpu_kda.hpp"
#include "k3/cuda.hpp"
#include "k3/harness/cuda_bench.hpp"
#include "k3/kda.hpp"
#include "k3/system.hpp"

namespace k3::tool {
namespace {

struct Args {
  std::string backend = "cpu";
  int threads = 0;
  std::string isa;  // empty: K3_ISA or the CPU's best level
  int64_t heads = 96, head_dim = 128;
  std::vector<int64_t> prefill_t = {8, 16, 32, 48, 64, 96, 128, 256, 1024, 8192};
  std::vector<int64_t> decode_n = {1, 2, 4, 8, 16, 32, 64};
  int iters = 5;
  int64_t pool_mib = 256;  // decode rotates over at least this much state (8x a 32 MiB L3)
  int64_t bw_mib = 512;    // buffer of the read-bandwidth probe
  std::vector<int64_t> verify_n = {64};  // speculative verify: requests (0: skip the section)
  int64_t draft_tokens = 4;               // T of the speculative verify
  std::string output;
};

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

Timing summarize(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front(), t.back(), static_cast<int>(t.size())};
}

// FLOP per token and head of each path (multiply-add = 2). Recurrent: decay K V, S^T k, k v'^T,
// S^T q. Chunked (C = 16, per token at full chunks): L and Aqk dots, forward substitution of
// W and U, W S and (q Gamma) S, Aqk v_new, the rank-C state update and its decay.
double flop_recurrent(double K, double V) { return 7 * K * V; }
double flop_chunked(double K, double V) {
  const double C = static_cast<double>(kda::kChunk);
  const double dots = (C * (C - 1) / 2 + C * (C + 1) / 2) * 2 * K;
  const double subst = C * (C - 1) / 2 * 2 * (K + V);
  const double gemms = 2 * C * 2 * K * V + C * C * 2 * V + C * 2 * K * V + K * V;
  return (dots + subst + gemms) / C;
}

// --backend cuda: the device API timed with CUDA events, against the device-to-device copy
// bandwidth measured in the same run (decode moves 2 N H K V 4 bytes of state per step).
// Ran on an H200 (2026-12-04).
Status run_cuda(const Args& a) {
  kda::KdaConfig cfg;
  cfg.num_heads = a.heads;
  cfg.head_k = cfg.head_v = a.head_dim;
  cfg.gate = kda::GateMode::kSafe;
  K3_RETURN_IF_ERROR(kda::validate_config(cfg));
  for (const int64_t T : a.prefill_t) {  // the host copy of every case fits before anything runs
    K3_RETURN_IF_ERROR(kda::check_buffer_bytes("--prefill-t " + std::to_string(T) + ": the case's q, k, v, g, o",
                                               T * cfg.num_heads, (3 * cfg.head_k + 2 * cfg.head_v) * 4));
  }
  const int64_t copy_bytes = int64_t{1} << 30;
  K3_ASSIGN_OR_RETURN(const cuda::DeviceTiming copy, cuda::time_device_copy(copy_bytes, 2, 10));
  const double copy_bw = 2.0 * static_cast<double>(copy_bytes) / copy.median_s;  // read + written
  auto devs = cuda::devices();
  const std::string device = devs.is_ok() ? devs.value()[0].name : std::string("?");
  nlohmann::json records = nlohmann::json::array();
  // The JSON is rewritten after every case, so that a run stopped half way keeps what it measured;
  // a failed case is a record with its error, the others still run, the command fails at the end.
  Status first_error = Status::ok();
  auto save = [&]() -> Status {
    if (a.output.empty()) return Status::ok();
    const nlohmann::json j = {{"device", device},
                              {"device_copy_Bps", copy_bw},
                              {"note", "CUDA KDA backend; see docs/kda.md"},
                              {"records", records}};
    return write_file_atomic(a.output, j.dump(2) + "\n", "--output");
  };
  K3_RETURN_IF_ERROR(save());
  auto timing_json = [](const cuda::DeviceTiming& t) {
    return nlohmann::json{{"median_s", t.median_s}, {"min_s", t.min_s}, {"max_s", t.max_s}, {"iterations", t.iterations}};
  };
  std::printf("device: %s; device-to-device copy %.1f GB/s (read + written, 1 GiB)\n\n", device.c_str(), copy_bw / 1e9);
  std::printf("prefill H=%lld K=V=%lld, one sequence, BF16 q/k/v, safe gate (median [min, max] ms)\n",
              static_cast<long long>(cfg.num_heads), static_cast<long long>(cfg.head_k));
  std::printf("%7s | %28s | %28s\n", "T", "recurrent ms", "chunked ms");
  for (const int64_t T : a.prefill_t) {
    kda::CaseSpec spec;
    spec.cfg = cfg;
    spec.seqlens = {T};
    const kda::KdaCase c = kda::make_case(spec);
    nlohmann::json rec = {{"kind", "prefill"}, {"backend", "cuda"}, {"T", T}, {"H", cfg.num_heads}, {"K", cfg.head_k},
                          {"V", cfg.head_v}};
    std::string cols[2];
    int i = 0;
    for (kda::Algorithm algo : {kda::Algorithm::kRecurrent, kda::Algorithm::kChunked}) {
      auto t = cuda::time_kda_prefill(cfg, c.inputs(), algo, 1, T >= 4096 ? 3 : a.iters);
      char buf[64];
      if (t.is_ok()) {
        std::snprintf(buf, sizeof buf, "%9.3f [%7.3f, %7.3f]", t->median_s * 1e3, t->min_s * 1e3, t->max_s * 1e3);
        rec[kda::algorithm_name(algo)] = timing_json(t.value());
      } else if (t.status().code() == StatusCode::kUnsupported) {
        std::snprintf(buf, sizeof buf, "%28s", "not built");
        rec[kda::algorithm_name(algo)] = {{"error", t.status().message()}};
      } else {
        const Status err(t.status().code(), std::string("prefill T=") + std::to_string(T) + " " +
                                                kda::algorithm_name(algo) + ": " + t.status().message());
        std::snprintf(buf, sizeof buf, "%28s", "FAILED");
        rec[kda::algorithm_name(algo)] = {{"error", err.message()}};
        if (first_error.is_ok()) first_error = err;
      }
      cols[i++] = buf;
    }
    std::printf("%7lld | %s | %s\n", static_cast<long long>(T), cols[0].c_str(), cols[1].c_str());
    std::fflush(stdout);
    records.push_back(rec);
    K3_RETURN_IF_ERROR(save());
  }
  std::printf("\ndecode H=%lld K=V=%lld, one token per sequence (state read + written once per step)\n",
              static_cast<long long>(cfg.num_heads), static_cast<long long>(cfg.head_k));
  std::printf("%5s %6s | %28s %12s %9s %12s\n", "N", "state", "step ms", "state MB", "GB/s", "of copy bw");
  for (const int64_t N : a.decode_n) {
    kda::CaseSpec spec;
    spec.cfg = cfg;
    spec.seqlens = {N};
    spec.initial_state = false;
    const kda::KdaCase c = kda::make_case(spec);
    for (const bool bf16_state : {false, true}) {
      const double slot_bytes = static_cast<double>(cfg.num_heads * cfg.head_k * cfg.head_v) * (bf16_state ? 2 : 4);
      // At least 4x the 50 MB L2 of an H100 / H200 rotated over, and at least 4 groups.
      const int64_t groups =
          std::max<int64_t>(4, static_cast<int64_t>(200e6 / (slot_bytes * static_cast<double>(N))) + 1);
      auto t = cuda::time_kda_decode(cfg, c.inputs(), groups * N, 2, std::max<int>(a.iters * 4, 20), bf16_state);
      if (!t.is_ok()) {
        const Status err(t.status().code(), "decode N=" + std::to_string(N) + ": " + t.status().message());
        std::printf("%5lld %6s | FAILED: %s\n", static_cast<long long>(N), bf16_state ? "bf16" : "fp32", err.message().c_str());
        std::fflush(stdout);
        records.push_back({{"kind", "decode"}, {"backend", "cuda"}, {"state_dtype", bf16_state ? "bf16" : "fp32"},
                           {"N", N}, {"error", err.message()}});
        if (first_error.is_ok()) first_error = err;
        K3_RETURN_IF_ERROR(save());
        continue;
      }
      const double bytes = 2.0 * slot_bytes * static_cast<double>(N), rate = bytes / t->median_s;
      std::printf("%5lld %6s | %9.3f [%7.3f, %7.3f] %12.1f %9.1f %11.1f%%\n", static_cast<long long>(N),
                  bf16_state ? "bf16" : "fp32", t->median_s * 1e3, t->min_s * 1e3, t->max_s * 1e3, bytes / 1e6,
                  rate / 1e9, 100 * rate / copy_bw);
      records.push_back({{"kind", "decode"}, {"backend", "cuda"}, {"state_dtype", bf16_state ? "bf16" : "fp32"},
                         {"N", N}, {"H", cfg.num_heads}, {"K", cfg.head_k}, {"V", cfg.head_v},
                         {"state_bytes_read_written", bytes}, {"pool_slots", groups * N},
                         {"timing", timing_json(t.value())}, {"fraction_of_copy_bw", rate / copy_bw}});
      std::fflush(stdout);
      K3_RETURN_IF_ERROR(save());
    }
  }
  return first_error;
}

Status run(const Args& a) {
  if (a.backend == "cuda") {
    if (!a.output.empty()) K3_RETURN_IF_ERROR(check_output_path("--output", a.output));
    const Status st = run_cuda(a);
    return st.is_ok() ? st : Status(st.code(), "--backend cuda: " + st.message());
  }
  if (a.backend != "cpu") return invalid_argument("--backend " + a.backend + " is not known (cpu or cuda)");
  if (!a.output.empty()) {
    K3_RETURN_IF_ERROR(check_output_path("--output", a.output));
  }
  const int threads = a.threads > 0 ? a.threads : default_thread_count();
  auto isa = a.isa.empty() ? active_isa_level() : parse_isa_level(a.isa);
  if (!isa.is_ok()) return Status(isa.status().code(), (a.isa.empty() ? "" : "--isa: ") + isa.status().message());
  kda::KdaConfig cfg;
  cfg.num_heads = a.heads;
  cfg.head_k = cfg.head_v = a.head_dim;
  cfg.gate = kda::GateMode::kSafe;
  K3_RETURN_IF_ERROR(kda::validate_config(cfg));
  // Every prefill case's tensors (q, k, g [T, H, K], v, o [T, H, V], FP32) fit before anything runs.
  for (const int64_t T : a.prefill_t) {
    K3_RETURN_IF_ERROR(kda::check_buffer_bytes("--prefill-t " + std::to_string(T) + ": the case's q, k, v, g, o",
                                               T * cfg.num_heads, (3 * cfg.head_k + 2 * cfg.head_v) * 4));
  }
  // Decode rotates over enough slots that one rotation touches >= pool_mib of state (no step finds
  // its states in cache); every pool fits before anything runs.
  const double slot_bytes = static_cast<double>(cfg.num_heads * cfg.head_k * cfg.head_v) * 4;
  const auto pool_slots = [&](int64_t N) {
    const int64_t groups = std::max<int64_t>(2, static_cast<int64_t>((static_cast<double>(a.pool_mib) * 1048576.0) /
                                                                    (slot_bytes * static_cast<double>(N))) + 1);
    return groups * N;
  };
  for (const int64_t N : a.decode_n) {
    K3_RETURN_IF_ERROR(kda::check_buffer_bytes("--decode-n " + std::to_string(N) + ": the state pool of " +
                                                   std::to_string(pool_slots(N)) + " slots",
                                               pool_slots(N) * cfg.num_heads * cfg.head_k * cfg.head_v, 4));
  }
  // Speculative verify: the snapshot design's pool holds N T states, the replay design's N states
  // and N windows.
  const int64_t Td = a.draft_tokens;
  const bool verify_section = !(a.verify_n.size() == 1 && a.verify_n[0] == 0);
  if (verify_section) {
    for (const int64_t N : a.verify_n) {
      if (N < 1) return invalid_argument("--verify-n " + std::to_string(N) + " must be >= 1 (or a single 0: no verify section)");
      K3_RETURN_IF_ERROR(kda::check_buffer_bytes("--verify-n " + std::to_string(N) + " --draft-tokens " +
                                                     std::to_string(Td) + ": the snapshot pool of N T states",
                                                 N * Td * cfg.num_heads * cfg.head_k * cfg.head_v, 4));
    }
  }
  const int total = static_cast<int>(a.prefill_t.size() + a.decode_n.size() + (verify_section ? a.verify_n.size() : 0)) + 1;
  int done = 0;
  progress(done, total, "measuring FP32 FMA peak and read bandwidth");
  const MeasuredRate peak = measure_fp32_fma_peak(threads, isa.value());  // the level's widest FMA
  const MeasuredRate bw = measure_read_bandwidth(threads, a.bw_mib << 20);
  progress(++done, total, "limits measured");
  nlohmann::json records = nlohmann::json::array();
  const double K = static_cast<double>(cfg.head_k), V = static_cast<double>(cfg.head_v);

  struct PrefillRow { int64_t t; Timing rec, chk; double ratio; };
  std::vector<PrefillRow> prows;
  for (int64_t T : a.prefill_t) {
    progress(done, total, "prefill T=" + std::to_string(T));
    kda::CaseSpec spec;
    spec.cfg = cfg;
    spec.seqlens = {T};
    const kda::KdaCase c = kda::make_case(spec);
    cpu::KdaOptions o;
    o.threads = threads;
    o.isa = isa.value();
    o.algorithm = kda::Algorithm::kRecurrent;
    K3_ASSIGN_OR_RETURN(const cpu::KdaPlan rec_plan, cpu::plan(cfg, o));
    o.algorithm = kda::Algorithm::kChunked;
    K3_ASSIGN_OR_RETURN(const cpu::KdaPlan chk_plan, cpu::plan(cfg, o));
    std::vector<uint8_t> ws(static_cast<size_t>(rec_plan.workspace_bytes));
    std::vector<float> out(c.o_size()), fin(c.state_size());
    const kda::KdaInputs in = c.inputs();
    Status failed;  // the first failing prefill, if any
    auto once = [&](const cpu::KdaPlan& p) {
      const double t0 = now_s();
      const Status st = cpu::prefill(p, in, {out, fin}, ws);
      const double dt = now_s() - t0;
      if (!st.is_ok() && failed.is_ok()) failed = st;
      return dt;
    };
    once(rec_plan);  // warm-up of both
    once(chk_plan);
    const int iters = T >= 4096 ? std::max(2, a.iters / 2) : a.iters;
    std::vector<double> tr, tc, ratio;
    for (int i = 0; i < iters; ++i) {  // A B, B A, ...
      double r, k;
      if (i % 2 == 0) {
        r = once(rec_plan);
        k = once(chk_plan);
      } else {
        k = once(chk_plan);
        r = once(rec_plan);
      }
      K3_RETURN_IF_ERROR(failed);
      tr.push_back(r);
      tc.push_back(k);
      ratio.push_back(r / k);
    }
    std::sort(ratio.begin(), ratio.end());
    PrefillRow row{T, summarize(tr), summarize(tc), ratio[ratio.size() / 2]};
    prows.push_back(row);
    const double units = static_cast<double>(T) * static_cast<double>(cfg.num_heads);
    records.push_back({{"kind", "prefill"}, {"isa", isa_level_name(isa.value())}, {"T", T}, {"H", cfg.num_heads}, {"K", cfg.head_k}, {"V", cfg.head_v},
                       {"recurrent", to_json(row.rec)}, {"chunked", to_json(row.chk)},
                       {"recurrent_flop", units * flop_recurrent(K, V)}, {"chunked_flop", units * flop_chunked(K, V)},
                       {"recurrent_over_chunked_median_ratio", row.ratio}});
    progress(++done, total, "prefill T=" + std::to_string(T));
  }

  struct DecodeRow { int64_t n; Timing t; double bytes; };
  std::vector<DecodeRow> drows;
  for (int64_t N : a.decode_n) {
    progress(done, total, "decode N=" + std::to_string(N));
    // Enough slots that one rotation touches >= pool_mib of state: no step finds its states in cache.
    const int64_t slots = pool_slots(N), groups = slots / N;
    std::vector<float> pool(static_cast<size_t>(slots * cfg.num_heads * cfg.head_k * cfg.head_v), 0.01f);
    kda::CaseSpec spec;
    spec.cfg = cfg;
    spec.seqlens = {N};
    spec.initial_state = false;
    const kda::KdaCase c = kda::make_case(spec);
    cpu::KdaOptions o;
    o.threads = threads;
    o.isa = isa.value();
    K3_ASSIGN_OR_RETURN(const cpu::KdaPlan plan, cpu::plan(cfg, o));
    std::vector<uint8_t> ws(static_cast<size_t>(plan.workspace_bytes));
    std::vector<float> out(c.o_size());
    std::vector<int32_t> idx(static_cast<size_t>(N));
    std::vector<double> times;
    const int iters = std::max<int>(a.iters * 4, static_cast<int>(groups));
    for (int i = -1; i < iters; ++i) {  // i = -1: warm-up
      const int64_t grp = (i + 1) % groups;
      for (int64_t n = 0; n < N; ++n) idx[n] = static_cast<int32_t>(grp * N + n);
      const double t0 = now_s();
      const Status st = cpu::decode(plan, {c.inputs(), pool, idx, out}, ws);
      const double dt = now_s() - t0;
      K3_RETURN_IF_ERROR(st);
      if (i >= 0) times.push_back(dt);
    }
    DecodeRow row{N, summarize(times), 2.0 * slot_bytes * static_cast<double>(N)};
    drows.push_back(row);
    records.push_back({{"kind", "decode"}, {"isa", isa_level_name(isa.value())}, {"N", N}, {"H", cfg.num_heads}, {"K", cfg.head_k}, {"V", cfg.head_v},
                       {"state_bytes_read_written", row.bytes}, {"pool_slots", slots}, {"timing", to_json(row.t)}});
    progress(++done, total, "decode N=" + std::to_string(N));
  }

  // Speculative verify of T draft tokens for N requests, all accepted (the commit's largest fold):
  // the snapshot verify (T states written per request) against verify_replay + commit, run
  // alternately (A B, B A, ...).
  struct VerifyRow { int64_t n; Timing snap, replay, commit, both; double snap_bytes, replay_bytes; };
  std::vector<VerifyRow> vrows;
  const int64_t window_floats = kda::replay_window_floats(cfg, Td).value();
  for (int64_t N : verify_section ? a.verify_n : std::vector<int64_t>{}) {
    progress(done, total, "verify N=" + std::to_string(N));
    kda::CaseSpec spec;
    spec.cfg = cfg;
    spec.seqlens = {N * Td};
    spec.initial_state = false;
    const kda::KdaCase c = kda::make_case(spec);
    cpu::KdaOptions o;
    o.threads = threads;
    o.isa = isa.value();
    K3_ASSIGN_OR_RETURN(const cpu::KdaPlan plan, cpu::plan(cfg, o));
    std::vector<uint8_t> ws(static_cast<size_t>(plan.workspace_bytes));
    const int64_t block = cfg.num_heads * cfg.head_k * cfg.head_v;
    std::vector<float> snap_pool(static_cast<size_t>(N * Td * block), 0.01f), pool(static_cast<size_t>(N * block), 0.01f);
    std::vector<float> window(static_cast<size_t>(N * window_floats), 0.0f), out(c.o_size());
    std::vector<int32_t> snap_idx(static_cast<size_t>(N * Td)), snap_acc(static_cast<size_t>(N), static_cast<int32_t>(Td));
    std::vector<int32_t> idx(static_cast<size_t>(N)), acc(static_cast<size_t>(N), static_cast<int32_t>(Td));
    for (int64_t i = 0; i < N * Td; ++i) snap_idx[i] = static_cast<int32_t>(i);
    for (int64_t n = 0; n < N; ++n) idx[n] = static_cast<int32_t>(n);
    kda::KdaInputs in = c.inputs();
    in.cu_seqlens = {};
    Status failed;
    auto snap_once = [&]() {
      const double t0 = now_s();
      const Status st = cpu::verify(plan, {in, Td, snap_pool, snap_idx, snap_acc, out}, ws);
      if (!st.is_ok() && failed.is_ok()) failed = st;
      return now_s() - t0;
    };
    auto replay_once = [&](double& tv, double& tc) {
      const double t0 = now_s();
      Status st = cpu::verify_replay(plan, {in, Td, pool, idx, window, out}, ws);
      const double t1 = now_s();
      if (st.is_ok()) st = cpu::commit(plan, {Td, pool, window, idx, acc}, ws);
      tc = now_s() - t1;
      tv = t1 - t0;
      if (!st.is_ok() && failed.is_ok()) failed = st;
    };
    double tv = 0, tc = 0;
    snap_once();  // warm-up of both
    replay_once(tv, tc);
    K3_RETURN_IF_ERROR(failed);
    std::vector<double> ts, tr, tcm, tb;
    for (int i = 0; i < a.iters; ++i) {
      double sn;
      if (i % 2 == 0) {
        sn = snap_once();
        replay_once(tv, tc);
      } else {
        replay_once(tv, tc);
        sn = snap_once();
      }
      K3_RETURN_IF_ERROR(failed);
      ts.push_back(sn);
      tr.push_back(tv);
      tcm.push_back(tc);
      tb.push_back(tv + tc);
    }
    VerifyRow row{N, summarize(ts), summarize(tr), summarize(tcm), summarize(tb),
                  static_cast<double>(Td) * slot_bytes, slot_bytes + static_cast<double>(window_floats) * 4};
    vrows.push_back(row);
    records.push_back({{"kind", "verify"}, {"isa", isa_level_name(isa.value())}, {"N", N}, {"T", Td}, {"accepted", Td},
                       {"H", cfg.num_heads}, {"K", cfg.head_k}, {"V", cfg.head_v},
                       {"snapshot_bytes_per_request", row.snap_bytes}, {"replay_bytes_per_request", row.replay_bytes},
                       {"snapshot_verify", to_json(row.snap)}, {"verify_replay", to_json(row.replay)},
                       {"commit", to_json(row.commit)}, {"verify_replay_plus_commit", to_json(row.both)}});
    progress(++done, total, "verify N=" + std::to_string(N));
  }

  std::printf("machine: %s, %d thread(s), isa %s\n", cpu_info().model.c_str(), threads, isa_level_name(isa.value()));
  std::printf("limits:  %s %.1f GFLOP/s; %s %.2f GB/s\n\n", peak.what.c_str(), peak.value / 1e9, bw.what.c_str(),
              bw.value / 1e9);
  std::printf("prefill H=%lld K=V=%lld, one sequence (median [min, max] ms; GFLOP/s and %% of FMA peak)\n",
              static_cast<long long>(cfg.num_heads), static_cast<long long>(cfg.head_k));
  std::printf("%7s | %28s %9s %6s | %28s %9s %6s | %9s\n", "T", "recurrent ms", "GFLOP/s", "peak", "chunked ms",
              "GFLOP/s", "peak", "rec/chk");
  for (const auto& r : prows) {
    const double units = static_cast<double>(r.t) * static_cast<double>(cfg.num_heads);
    const double fr = units * flop_recurrent(K, V) / r.rec.median, fc = units * flop_chunked(K, V) / r.chk.median;
    std::printf("%7lld | %9.3f [%7.3f, %7.3f] %9.1f %5.1f%% | %9.3f [%7.3f, %7.3f] %9.1f %5.1f%% | %9.2f\n",
                static_cast<long long>(r.t), r.rec.median * 1e3, r.rec.min * 1e3, r.rec.max * 1e3, fr / 1e9,
                100 * fr / peak.value, r.chk.median * 1e3, r.chk.min * 1e3, r.chk.max * 1e3, fc / 1e9,
                100 * fc / peak.value, r.ratio);
  }
  bool above_peak = false;
  for (const auto& r : prows) {
    const double units = static_cast<double>(r.t) * static_cast<double>(cfg.num_heads);
    above_peak |= units * flop_recurrent(K, V) / r.rec.median > peak.value;
  }
  if (above_peak) {
    std::printf("note: a rate above 100%% means the FMA-peak probe under-measured the peak on this machine "
                "(shared or throttled cores, or a probe limited by its own loop); compare paths by rec/chk\n");
  }
  std::printf("\ndecode H=%lld K=V=%lld, one token per sequence (state read + written once per step)\n",
              static_cast<long long>(cfg.num_heads), static_cast<long long>(cfg.head_k));
  std::printf("%5s | %28s %12s %9s %10s\n", "N", "step ms", "state MB", "GB/s", "of read bw");
  for (const auto& r : drows) {
    const double rate = r.bytes / r.t.median;
    std::printf("%5lld | %9.3f [%7.3f, %7.3f] %12.1f %9.2f %9.1f%%\n", static_cast<long long>(r.n), r.t.median * 1e3,
                r.t.min * 1e3, r.t.max * 1e3, r.bytes / 1e6, rate / 1e9, 100 * rate / bw.value);
  }
  if (!vrows.empty()) {
    std::printf("\nspeculative verify H=%lld K=V=%lld, T=%lld draft tokens per request, all accepted (median ms)\n",
                static_cast<long long>(cfg.num_heads), static_cast<long long>(cfg.head_k), static_cast<long long>(Td));
    std::printf("%5s | %13s %10s | %13s %10s %10s %10s | %9s\n", "N", "snapshot MB/r", "verify ms", "replay MB/r",
                "verify ms", "commit ms", "total ms", "total/snap");
    for (const auto& r : vrows) {
      std::printf("%5lld | %13.2f %10.3f | %13.2f %10.3f %10.3f %10.3f | %9.2f\n", static_cast<long long>(r.n),
                  r.snap_bytes / 1e6, r.snap.median * 1e3, r.replay_bytes / 1e6, r.replay.median * 1e3,
                  r.commit.median * 1e3, r.both.median * 1e3, r.both.median / r.snap.median);
    }
    std::printf("(MB/r: state memory per request: T snapshot states, or one state + its replay window)\n");
  }
  if (!a.output.empty()) {
    nlohmann::json machine = machine_json(threads);
    machine["isa"] = isa_level_name(isa.value());
    const nlohmann::json j = {{"machine", machine},
                              {"fp32_fma_peak_flops", to_json(peak)},
                              {"read_bandwidth_Bps", to_json(bw)},
                              {"flop_model", "recurrent 7KV, chunked (C=16) per token and head, see bench_kda.cpp"},
                              {"records", records}};
    K3_RETURN_IF_ERROR(write_file_atomic(a.output, j.dump(2) + "\n", "--output"));
  }
  return Status::ok();
}

const BenchRegistration kRegistration("kda", [](CLI::App& bench) -> CommandRun {
  auto* cmd = bench.add_subcommand("kda", "KDA prefill (chunked vs recurrent), decode and speculative-verify sweeps");
  auto a = std::make_shared<Args>();
  cmd->add_option("--backend", a->backend, "cpu | cuda (cuda: CUDA events, vs the device copy bandwidth)")
      ->capture_default_str();
  cmd->add_option("--threads", a->threads, "Threads (default: K3_NUM_THREADS or all CPUs)");
  cmd->add_option("--isa", a->isa,
                  "CPU kernel level: scalar | avx2 | avx512 | avx512bf16 (default: K3_ISA or the CPU's best); the "
                  "FMA peak is measured for the same level");
  cmd->add_option("--heads", a->heads, "Heads H")->capture_default_str()->check(CLI::Range(1, 1024));
  cmd->add_option("--head-dim", a->head_dim, "K = V")->capture_default_str()->check(CLI::Range(1, 512));
  // Checked by CLI11, so `--prefill-t -5` is a flag error, not a failure deep in the library.
  cmd->add_option("--prefill-t", a->prefill_t, "Prefill lengths T (1 to 1048576)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--decode-n", a->decode_n, "Decode batch sizes N (1 to 65536)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
  cmd->add_option("--iters", a->iters, "Timed iterations per case")->capture_default_str()->check(CLI::Range(1, 1000));
  cmd->add_option("--pool-mib", a->pool_mib, "Decode: state MiB rotated over (defeats the cache)")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  cmd->add_option("--bw-mib", a->bw_mib, "Buffer of the read-bandwidth probe in MiB")
      ->capture_default_str()
      ->check(CLI::Range(16, 65536));
  cmd->add_option("--verify-n", a->verify_n,
                  "Speculative verify: requests N (1 to 65536; a single 0 skips the section): snapshot verify against "
                  "verify_replay + commit")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 16));
  cmd->add_option("--draft-tokens", a->draft_tokens, "Speculative verify: draft tokens T per request")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, kda::kMaxWindowTokens));
  cmd->add_option("--output", a->output, "Write JSON records to this file");
  return [a]() { return run(*a); };
});

}  // namespace
}  // namespace k3::tool
