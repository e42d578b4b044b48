// The KDA benchmark (k3/harness/bench.hpp): prefill over T (chunked vs recurrent, A/B
// interleaved per round so that drift cancels), decode over N and speculative verify on the cpu
// backend; prefill and decode with CUDA events on the cuda backend.
#include <algorithm>
#include <string>
#include <vector>

#include "bench_json.hpp"
#include "k3/backend.hpp"
#include "k3/cuda.hpp"
#include "k3/harness/bench.hpp"
#include "k3/harness/cuda_bench.hpp"
#include "k3/harness/kda_case.hpp"
#include "k3/kda.hpp"

namespace k3::harness {

// Recurrent: decay K V, S^T k, k v'^T, S^T q. Chunked (C = 16, per token at full chunks): L and
// Aqk dots, forward substitution of W and U, W S and (q Gamma) S, Aqk v_new, the rank-C state
// update and its decay.
double kda_flop_recurrent(double K, double V) { return 7 * K * V; }
double kda_flop_chunked(double K, double V) {
  const double C = static_cast<double>(kda::kChunk);
  const double dots = (C * (C - 1) / 2 + C * (C + 1) / 2) * 2 * K;
  const double subst = C * (C - 1) / 2 * 2 * (K + V);
  const double gemms = 2 * C * 2 * K * V + C * C * 2 * V + C * 2 * K * V + K * V;
  return (dots + subst + gemms) / C;
}

namespace {

kda::KdaConfig config_of(const KdaBenchConfig& c) {
  kda::KdaConfig cfg;
  cfg.num_heads = c.heads;
  cfg.head_k = cfg.head_v = c.head_dim;
  cfg.gate = kda::GateMode::kSafe;
  return cfg;
}

// One sequence of `tokens` tokens (no cu_seqlens) of the bench's configuration.
kda::KdaCase sequence_case(const kda::KdaConfig& cfg, int64_t tokens, bool initial_state) {
  kda::CaseSpec spec;
  spec.cfg = cfg;
  spec.seqlens = {tokens};
  spec.initial_state = initial_state;
  return kda::make_case(spec);
}

// The layer prepared through the registry on the bench's backend (the cpu one: its plan).
Result<std::unique_ptr<PreparedKda>> prepared(const KdaBenchConfig& c, const kda::KdaConfig& cfg,
                                              kda::Algorithm algorithm = kda::Algorithm::kAuto) {
  K3_ASSIGN_OR_RETURN(const KdaBackend* b, find_kda_backend(c.backend));
  BackendOptions o;
  o.threads = c.threads;
  o.isa = c.isa;
  o.kda_algorithm = algorithm;
  return prepare_kda(*b, cfg, o);
}

bool has_verify(const KdaBenchConfig& c) { return !(c.verify_n.size() == 1 && c.verify_n[0] == 0); }

// Decode rotates over enough slots that one rotation touches >= pool_mib of state (no step finds
// its states in cache).
int64_t pool_slots(const KdaBenchConfig& c, const kda::KdaConfig& cfg, int64_t N) {
  const double slot_bytes = static_cast<double>(cfg.num_heads * cfg.head_k * cfg.head_v) * 4;
  const int64_t groups = std::max<int64_t>(
      2, static_cast<int64_t>((static_cast<double>(c.pool_mib) * 1048576.0) / (slot_bytes * static_cast<double>(N))) + 1);
  return groups * N;
}

BenchResult bench_cuda(const KdaBenchConfig& c, const BenchHooks& hooks) {
  const kda::KdaConfig cfg = config_of(c);
  const int64_t copy_bytes = int64_t{1} << 30;
  auto copy = cuda::time_device_copy(copy_bytes, 2, 10);
  if (!copy.is_ok()) return {"", copy.status()};
  const double copy_bw = 2.0 * static_cast<double>(copy_bytes) / copy->median_s;  // read + written
  auto devs = cuda::devices();
  Document doc({{"device", devs.is_ok() ? devs.value()[0].name : std::string("?")},
                {"device_copy_Bps", copy_bw},
                {"note", "CUDA KDA backend; see docs/kda.md"}},
               hooks);
  // A failed case is a record with its error; the others still run; the first error is returned.
  Status first_error = Status::ok();
  auto timing = [](const cuda::DeviceTiming& t) {
    return nlohmann::json{{"median_s", t.median_s}, {"min_s", t.min_s}, {"max_s", t.max_s}, {"iterations", t.iterations}};
  };
  for (const int64_t T : c.prefill_t) {
    const kda::KdaCase kc = sequence_case(cfg, T, true);
    nlohmann::json rec = {{"kind", "prefill"}, {"backend", "cuda"}, {"T", T}, {"H", cfg.num_heads}, {"K", cfg.head_k},
                          {"V", cfg.head_v}};
    for (kda::Algorithm algo : {kda::Algorithm::kRecurrent, kda::Algorithm::kChunked}) {
      auto t = cuda::time_kda_prefill(cfg, kc.inputs(), algo, 1, T >= 4096 ? 3 : c.iters);
      if (t.is_ok()) {
        rec[kda::algorithm_name(algo)] = timing(t.value());
      } else if (t.status().code() == StatusCode::kUnsupported) {
        rec[kda::algorithm_name(algo)] = {{"error", t.status().message()}, {"unsupported", true}};
      } else {
        const Status err(t.status().code(), std::string("prefill T=") + std::to_string(T) + " " +
                                                kda::algorithm_name(algo) + ": " + t.status().message());
        rec[kda::algorithm_name(algo)] = {{"error", err.message()}};
        if (first_error.is_ok()) first_error = err;
      }
    }
    doc.add(std::move(rec));
  }
  for (const int64_t N : c.decode_n) {
    const kda::KdaCase kc = sequence_case(cfg, N, false);
    for (const bool bf16_state : {false, true}) {
      const double slot_bytes = static_cast<double>(cfg.num_heads * cfg.head_k * cfg.head_v) * (bf16_state ? 2 : 4);
      // At least 4x the 50 MB L2 of an H100 / H200 rotated over, and at least 4 groups.
      const int64_t groups =
          std::max<int64_t>(4, static_cast<int64_t>(200e6 / (slot_bytes * static_cast<double>(N))) + 1);
      auto t = cuda::time_kda_decode(cfg, kc.inputs(), groups * N, 2, std::max<int>(c.iters * 4, 20), bf16_state);
      nlohmann::json rec = {{"kind", "decode"}, {"backend", "cuda"}, {"state_dtype", bf16_state ? "bf16" : "fp32"},
                            {"N", N}};
      if (!t.is_ok()) {
        const Status err(t.status().code(), "decode N=" + std::to_string(N) + ": " + t.status().message());
        rec["error"] = err.message();
        if (first_error.is_ok()) first_error = err;
        doc.add(std::move(rec));
        continue;
      }
      const double bytes = 2.0 * slot_bytes * static_cast<double>(N), rate = bytes / t->median_s;
      rec.update({{"H", cfg.num_heads}, {"K", cfg.head_k}, {"V", cfg.head_v}, {"state_bytes_read_written", bytes},
                  {"pool_slots", groups * N}, {"timing", timing(t.value())}, {"fraction_of_copy_bw", rate / copy_bw}});
      doc.add(std::move(rec));
    }
  }
  return {doc.text(), first_error};
}

Result<nlohmann::json> prefill_record(const KdaBenchConfig& c, const kda::KdaConfig& cfg, int64_t T) {
  const kda::KdaCase kc = sequence_case(cfg, T, true);
  K3_ASSIGN_OR_RETURN(const auto rec_layer, prepared(c, cfg, kda::Algorithm::kRecurrent));
  K3_ASSIGN_OR_RETURN(const auto chk_layer, prepared(c, cfg, kda::Algorithm::kChunked));
  const PreparedKda& rec_plan = *rec_layer;
  const PreparedKda& chk_plan = *chk_layer;
  std::vector<uint8_t> ws(static_cast<size_t>(std::max(rec_plan.workspace_bytes(), chk_plan.workspace_bytes())));
  std::vector<float> out(kc.o_size()), fin(kc.state_size());
  const kda::KdaInputs in = kc.inputs();
  Status failed;  // the first failing prefill, if any
  auto once = [&](const PreparedKda& p) {
    const double t0 = now_s();
    const Status st = p.prefill(in, {out, fin}, ws);
    const double dt = now_s() - t0;
    if (!st.is_ok() && failed.is_ok()) failed = st;
    return dt;
  };
  once(rec_plan);  // warm-up of both
  once(chk_plan);
  const int iters = T >= 4096 ? std::max(2, c.iters / 2) : c.iters;
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
  const double units = static_cast<double>(T) * static_cast<double>(cfg.num_heads);
  const double K = static_cast<double>(cfg.head_k), V = static_cast<double>(cfg.head_v);
  return nlohmann::json{{"kind", "prefill"}, {"isa", isa_level_name(c.isa)}, {"T", T}, {"H", cfg.num_heads},
                        {"K", cfg.head_k}, {"V", cfg.head_v}, {"recurrent", to_json(summarize(tr))},
                        {"chunked", to_json(summarize(tc))}, {"recurrent_flop", units * kda_flop_recurrent(K, V)},
                        {"chunked_flop", units * kda_flop_chunked(K, V)},
                        {"recurrent_over_chunked_median_ratio", summarize(ratio).median}};
}

Result<nlohmann::json> decode_record(const KdaBenchConfig& c, const kda::KdaConfig& cfg, int64_t N) {
  const int64_t slots = pool_slots(c, cfg, N), groups = slots / N;
  std::vector<float> pool(static_cast<size_t>(slots * cfg.num_heads * cfg.head_k * cfg.head_v), 0.01f);
  const kda::KdaCase kc = sequence_case(cfg, N, false);
  K3_ASSIGN_OR_RETURN(const auto layer, prepared(c, cfg));
  std::vector<uint8_t> ws(static_cast<size_t>(layer->workspace_bytes()));
  std::vector<float> out(kc.o_size());
  std::vector<int32_t> idx(static_cast<size_t>(N));
  std::vector<double> times;
  const int iters = std::max<int>(c.iters * 4, static_cast<int>(groups));
  for (int i = -1; i < iters; ++i) {  // i = -1: warm-up
    const int64_t grp = (i + 1) % groups;
    for (int64_t n = 0; n < N; ++n) idx[n] = static_cast<int32_t>(grp * N + n);
    const double t0 = now_s();
    const Status st = layer->decode({kc.inputs(), pool, idx, out}, ws);
    const double dt = now_s() - t0;
    K3_RETURN_IF_ERROR(st);
    if (i >= 0) times.push_back(dt);
  }
  const double slot_bytes = static_cast<double>(cfg.num_heads * cfg.head_k * cfg.head_v) * 4;
  return nlohmann::json{{"kind", "decode"}, {"isa", isa_level_name(c.isa)}, {"N", N}, {"H", cfg.num_heads},
                        {"K", cfg.head_k}, {"V", cfg.head_v},
                        {"state_bytes_read_written", 2.0 * slot_bytes * static_cast<double>(N)},
                        {"pool_slots", slots}, {"timing", to_json(summarize(times))}};
}

// Speculative verify of T draft tokens for N requests, all accepted (the commit's largest fold):
// the snapshot verify (T states written per request) against verify_replay + commit, run
// alternately (A B, B A, ...).
Result<nlohmann::json> verify_record(const KdaBenchConfig& c, const kda::KdaConfig& cfg, int64_t N) {
  const int64_t Td = c.draft_tokens;
  K3_ASSIGN_OR_RETURN(const int64_t window_floats, kda::replay_window_floats(cfg, Td));
  const kda::KdaCase kc = sequence_case(cfg, N * Td, false);
  K3_ASSIGN_OR_RETURN(const auto layer, prepared(c, cfg));
  std::vector<uint8_t> ws(static_cast<size_t>(layer->workspace_bytes()));
  const int64_t block = cfg.num_heads * cfg.head_k * cfg.head_v;
  std::vector<float> snap_pool(static_cast<size_t>(N * Td * block), 0.01f), pool(static_cast<size_t>(N * block), 0.01f);
  std::vector<float> window(static_cast<size_t>(N * window_floats), 0.0f), out(kc.o_size());
  std::vector<int32_t> snap_idx(static_cast<size_t>(N * Td)), snap_acc(static_cast<size_t>(N), static_cast<int32_t>(Td));
  std::vector<int32_t> idx(static_cast<size_t>(N)), acc(static_cast<size_t>(N), static_cast<int32_t>(Td));
  for (int64_t i = 0; i < N * Td; ++i) snap_idx[i] = static_cast<int32_t>(i);
  for (int64_t n = 0; n < N; ++n) idx[n] = static_cast<int32_t>(n);
  kda::KdaInputs in = kc.inputs();
  in.cu_seqlens = {};
  Status failed;
  auto snap_once = [&]() {
    const double t0 = now_s();
    const Status st = layer->verify({in, Td, snap_pool, snap_idx, snap_acc, out}, ws);
    if (!st.is_ok() && failed.is_ok()) failed = st;
    return now_s() - t0;
  };
  auto replay_once = [&](double& tv, double& tc) {
    const double t0 = now_s();
    Status st = layer->verify_replay({in, Td, pool, idx, window, out}, ws);
    const double t1 = now_s();
    if (st.is_ok()) st = layer->commit({Td, pool, window, idx, acc}, ws);
    tc = now_s() - t1;
    tv = t1 - t0;
    if (!st.is_ok() && failed.is_ok()) failed = st;
  };
  double tv = 0, tc = 0;
  snap_once();  // warm-up of both
  replay_once(tv, tc);
  K3_RETURN_IF_ERROR(failed);
  std::vector<double> ts, tr, tcm, tb;
  for (int i = 0; i < c.iters; ++i) {
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
  const double slot_bytes = static_cast<double>(block) * 4;
  return nlohmann::json{{"kind", "verify"}, {"isa", isa_level_name(c.isa)}, {"N", N}, {"T", Td}, {"accepted", Td},
                        {"H", cfg.num_heads}, {"K", cfg.head_k}, {"V", cfg.head_v},
                        {"snapshot_bytes_per_request", static_cast<double>(Td) * slot_bytes},
                        {"replay_bytes_per_request", slot_bytes + static_cast<double>(window_floats) * 4},
                        {"snapshot_verify", to_json(summarize(ts))}, {"verify_replay", to_json(summarize(tr))},
                        {"commit", to_json(summarize(tcm))}, {"verify_replay_plus_commit", to_json(summarize(tb))}};
}

BenchResult bench_cpu(const KdaBenchConfig& c0, const BenchHooks& hooks) {
  KdaBenchConfig c = c0;
  if (c.threads <= 0) c.threads = hardware_thread_count();
  const kda::KdaConfig cfg = config_of(c);
  const bool verify = has_verify(c);
  const int total = static_cast<int>(c.prefill_t.size() + c.decode_n.size() + (verify ? c.verify_n.size() : 0)) + 1;
  int done = 0;
  hooks.step(done, total, "measuring FP32 FMA peak and read bandwidth");
  const MeasuredRate peak = measure_fp32_fma_peak(c.threads, c.isa);  // the level's widest FMA
  const MeasuredRate bw = measure_read_bandwidth(c.threads, c.bw_mib << 20);
  hooks.step(++done, total, "limits measured");
  Document doc({{"machine", machine(c.threads, c.isa)},
                {"fp32_fma_peak_flops", to_json(peak)},
                {"read_bandwidth_Bps", to_json(bw)},
                {"flop_model", "recurrent 7KV, chunked (C=16) per token and head (k3::harness::kda_flop_*)"}},
               hooks);
  auto section = [&](const std::vector<int64_t>& values, const char* name,
                     Result<nlohmann::json> (*measure)(const KdaBenchConfig&, const kda::KdaConfig&, int64_t)) -> Status {
    for (const int64_t v : values) {
      const std::string what = std::string(name) + "=" + std::to_string(v);
      hooks.step(done, total, what);
      K3_ASSIGN_OR_RETURN(nlohmann::json rec, measure(c, cfg, v));
      doc.add(std::move(rec));
      hooks.step(++done, total, what);
    }
    return Status::ok();
  };
  Status st = section(c.prefill_t, "prefill T", prefill_record);
  if (st.is_ok()) st = section(c.decode_n, "decode N", decode_record);
  if (st.is_ok() && verify) st = section(c.verify_n, "verify N", verify_record);
  if (!st.is_ok()) return {"", st};
  return {doc.text(), Status::ok()};
}

}  // namespace

Status check_kda_bench(const KdaBenchConfig& c) {
  if (c.backend != "cpu" && c.backend != "cuda") return invalid_argument("--backend " + c.backend + " is not known (cpu or cuda)");
  if (c.iters < 1 || c.iters > 1000) return invalid_argument("--iters " + std::to_string(c.iters) + " must be in [1, 1000]");
  if (c.pool_mib < 1 || c.pool_mib > 65536) return invalid_argument("--pool-mib " + std::to_string(c.pool_mib) + " must be in [1, 65536]");
  if (c.bw_mib < 16 || c.bw_mib > 65536) return invalid_argument("--bw-mib " + std::to_string(c.bw_mib) + " must be in [16, 65536]");
  const kda::KdaConfig cfg = config_of(c);
  K3_RETURN_IF_ERROR(kda::validate_config(cfg));
  // Every prefill case's tensors (q, k, g [T, H, K], v, o [T, H, V], FP32) fit before anything runs.
  for (const int64_t T : c.prefill_t) {
    if (T < 1 || T > (int64_t{1} << 20)) return invalid_argument("--prefill-t " + std::to_string(T) + " must be in [1, 1048576]");
    K3_RETURN_IF_ERROR(kda::check_buffer_bytes("--prefill-t " + std::to_string(T) + ": the case's q, k, v, g, o",
                                               T * cfg.num_heads, (3 * cfg.head_k + 2 * cfg.head_v) * 4));
  }
  for (const int64_t N : c.decode_n) {
    if (N < 1 || N > (int64_t{1} << 16)) return invalid_argument("--decode-n " + std::to_string(N) + " must be in [1, 65536]");
    if (c.backend == "cpu") {  // every pool fits before anything runs
      K3_RETURN_IF_ERROR(kda::check_buffer_bytes("--decode-n " + std::to_string(N) + ": the state pool of " +
                                                     std::to_string(pool_slots(c, cfg, N)) + " slots",
                                                 pool_slots(c, cfg, N) * cfg.num_heads * cfg.head_k * cfg.head_v, 4));
    }
  }
  // Speculative verify (cpu): the snapshot design's pool holds N T states.
  if (c.backend == "cpu" && has_verify(c)) {
    if (c.draft_tokens < 1 || c.draft_tokens > kda::kMaxWindowTokens) {
      return invalid_argument("--draft-tokens " + std::to_string(c.draft_tokens) + " must be in [1, " +
                              std::to_string(kda::kMaxWindowTokens) + "]");
    }
    for (const int64_t N : c.verify_n) {
      if (N < 1 || N > (int64_t{1} << 16)) {
        return invalid_argument("--verify-n " + std::to_string(N) + " must be >= 1 (or a single 0: no verify section)");
      }
      K3_RETURN_IF_ERROR(kda::check_buffer_bytes("--verify-n " + std::to_string(N) + " --draft-tokens " +
                                                     std::to_string(c.draft_tokens) + ": the snapshot pool of N T states",
                                                 N * c.draft_tokens * cfg.num_heads * cfg.head_k * cfg.head_v, 4));
    }
  }
  return Status::ok();
}

BenchResult bench_kda(const KdaBenchConfig& c, const BenchHooks& hooks) {
  const Status checked = check_kda_bench(c);
  if (c.backend == "cpu") return checked.is_ok() ? bench_cpu(c, hooks) : BenchResult{"", checked};
  BenchResult r = checked.is_ok() ? bench_cuda(c, hooks) : BenchResult{"", checked};
  if (!r.status.is_ok()) r.status = Status(r.status.code(), "--backend cuda: " + r.status.message());
  return r;
}

}  // namespace k3::harness
