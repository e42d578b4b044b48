// `k3 validate --op kda [--backend NAME]`: the stress matrix of docs/kda.md against the FP32 and
// FP64 token-recurrent references: resets (g = -1000), D 60 / 100 / 128, T 63 / 500 / 1000 / 1500
// / 8192, varlen with a 15-token sequence, the K3 shape H = 96, K = V = 128; decode and verify on
// a state pool (untouched slots bit-identical); thread-count determinism. Every such row runs
// through the chosen backend's registry entries (k3/backend.hpp; default: default_kda_backend()).
// The CPU backend's SIMD levels run only when the chosen backend is "cpu"; each prefill algorithm
// (chunked, recurrent) and the small ops (conv1d + SiLU, gated RMSNorm) on "cpu" and "cuda". A backend that is unusable here is a FAIL row with
// the registry's reason; an entry a backend lacks (the reference has no decode) is a SKIP row.
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "k3/harness/kda_case.hpp"
#include "k3/backend.hpp"
#include "k3/formats.hpp"
#include "k3/harness/digest.hpp"
#include "k3/kda.hpp"
#include "k3/kda_ops.hpp"
#include "k3/harness/validate.hpp"

namespace k3::harness {
namespace {

using kda::Algorithm;
using kda::GateMode;
using kda::StateLayout;

ValidateRow make_row(const std::string& name, const std::string& backend, const kda::ErrorStats& e, double bound,
                     std::string note) {
  ValidateRow r;
  r.op = "kda";
  r.case_name = name;
  r.backend = backend;
  r.cosine = e.cosine;
  r.nrmse = e.err_ratio;
  r.max_abs = e.max_abs;
  r.pass = e.err_ratio <= bound;  // NaN fails
  char b[64];
  std::snprintf(b, sizeof b, "err_ratio <= %.0e", bound);
  r.note = std::string(b) + (note.empty() ? "" : "; " + note);
  return r;
}

ValidateRow flag_row(const std::string& name, const std::string& backend, bool pass, std::string note) {
  ValidateRow r;
  r.op = "kda";
  r.case_name = name;
  r.backend = backend;
  r.pass = pass;
  r.note = std::move(note);
  return r;
}

// A check the backend cannot take part in (no such entry): shown as SKIP with the reason.
ValidateRow skip_row(const std::string& name, const std::string& backend, const Status& why) {
  ValidateRow r = flag_row(name, backend, true, "skipped: " + why.message());
  r.skipped = true;
  return r;
}

// Worse of the output and final-state errors.
kda::ErrorStats worst(const kda::ErrorStats& a, const kda::ErrorStats& b) {
  kda::ErrorStats w;
  w.err_ratio = std::isnan(a.err_ratio) || a.err_ratio > b.err_ratio ? a.err_ratio : b.err_ratio;
  w.max_abs = std::isnan(a.max_abs) || a.max_abs > b.max_abs ? a.max_abs : b.max_abs;
  w.cosine = std::min(a.cosine, b.cosine);
  return w;
}

struct Out {
  std::vector<float> o, f;
  Status st;
};

// The backend under test and the options the tool passes it (K3_NUM_THREADS, K3_ISA).
struct Target {
  const KdaBackend& b;
  BackendOptions opt;
  bool is_cpu() const { return b.name == "cpu"; }  // its algorithm / ISA variants and the small ops
  // Backends with two prefill algorithms, each checked on its own (cuda: chunked is opt-in).
  bool has_algorithms() const { return b.name == "cpu" || b.name == "cuda"; }
};

// Prefill through the registry; `algo`, `threads`, `isa` override the tool's options.
Out run_prefill(const Target& t, const kda::KdaCase& c, Algorithm algo = Algorithm::kAuto, int threads = 0,
                std::optional<IsaLevel> isa = std::nullopt) {
  Out r{std::vector<float>(c.o_size()), std::vector<float>(c.state_size()), {}};
  BackendOptions o = t.opt;
  o.kda_algorithm = algo;
  if (threads > 0) o.threads = threads;
  if (isa) o.isa = isa;
  r.st = run_kda_prefill(t.b, c.spec.cfg, c.inputs(), {r.o, r.f}, o);
  return r;
}

// The problem restricted to heads [0, h): a cheaper reference for the largest shapes.
kda::KdaCase first_heads(const kda::KdaCase& c, int64_t h) {
  const int64_t H = c.spec.cfg.num_heads, K = c.spec.cfg.head_k, V = c.spec.cfg.head_v;
  if (h >= H) return c;
  kda::KdaCase s = c;
  s.spec.cfg.num_heads = h;
  auto cut = [&](auto& vec, int64_t inner) {
    if (vec.empty()) return;
    const int64_t outer = static_cast<int64_t>(vec.size()) / (H * inner);
    std::remove_reference_t<decltype(vec)> r(static_cast<size_t>(outer * h * inner));
    for (int64_t o = 0; o < outer; ++o) {
      std::copy(vec.begin() + o * H * inner, vec.begin() + o * H * inner + h * inner, r.begin() + o * h * inner);
    }
    vec = std::move(r);
  };
  cut(s.q16, K), cut(s.k16, K), cut(s.v16, V), cut(s.q32, K), cut(s.k32, K), cut(s.v32, V);
  cut(s.g, K), cut(s.beta, 1), cut(s.dt_bias, K), cut(s.initial_state, K * V);
  if (!s.a_log.empty()) s.a_log.resize(static_cast<size_t>(h));
  return s;
}

std::vector<float> heads_of(const std::vector<float>& x, int64_t H, int64_t h, int64_t inner) {
  const int64_t outer = static_cast<int64_t>(x.size()) / (H * inner);
  std::vector<float> r(static_cast<size_t>(outer * h * inner));
  for (int64_t o = 0; o < outer; ++o) {
    std::copy(x.begin() + o * H * inner, x.begin() + o * H * inner + h * inner, r.begin() + o * h * inner);
  }
  return r;
}

struct Case {
  std::string name;
  kda::CaseSpec spec;
  int64_t ref_heads;   // heads checked against the FP32 reference (all when >= H)
  int64_t fp64_heads;  // heads checked against the FP64 reference
};

kda::CaseSpec spec_of(int64_t h, int64_t d, GateMode gate, StateLayout layout, bool bf16, std::vector<int64_t> lens,
                      std::vector<int64_t> resets, uint64_t seed) {
  kda::CaseSpec s;
  s.cfg.num_heads = h;
  s.cfg.head_k = s.cfg.head_v = d;
  s.cfg.gate = gate;
  s.cfg.layout = layout;
  s.bf16 = bf16;
  s.seqlens = std::move(lens);
  s.resets = std::move(resets);
  s.seed = seed;
  return s;
}

void prefill_rows(const Target& t, const Case& k, std::vector<ValidateRow>& rows) {
  const kda::KdaCase c = kda::make_case(k.spec);
  const auto& cfg = c.spec.cfg;
  const int64_t H = cfg.num_heads, K = cfg.head_k, V = cfg.head_v;
  const std::string& bn = t.b.name;
  // The backend as called (algorithm auto); on the cpu and cuda backends also each algorithm.
  const Out run = run_prefill(t, c);
  if (!run.st.is_ok()) {
    rows.push_back(flag_row("prefill " + k.name, bn, false, run.st.to_string()));
    return;
  }
  Out chk, rec;
  if (t.has_algorithms()) {
    chk = run_prefill(t, c, Algorithm::kChunked);
    rec = run_prefill(t, c, Algorithm::kRecurrent);
    if (!chk.st.is_ok() || !rec.st.is_ok()) {
      rows.push_back(flag_row(k.name, bn, false, (chk.st.is_ok() ? rec.st : chk.st).to_string()));
      return;
    }
  }
  const std::string dtype = c.spec.bf16 ? "bf16" : "fp32";
  const std::string subset = k.ref_heads < H ? "; heads 0.." + std::to_string(k.ref_heads - 1) + " of " +
                                                   std::to_string(H)
                                             : "";
  // FP32 reference on (a subset of) the heads.
  const kda::KdaCase cs = first_heads(c, k.ref_heads);
  std::vector<float> ro(cs.o_size()), rf(cs.state_size());
  if (!kda::reference_fp32(cs.spec.cfg, cs.inputs(), {ro, rf}, t.opt.threads).is_ok()) {
    rows.push_back(flag_row(k.name, "reference", false, "FP32 reference failed"));
    return;
  }
  const int64_t hs = cs.spec.cfg.num_heads;
  const double bound32 = c.spec.bf16 ? kda::kTolBf16VsFp32 : kda::kTolFp32;
  auto vs_fp32 = [&](const Out& p, const std::string& what) {
    auto e = worst(kda::compare(heads_of(p.o, H, hs, V), ro), kda::compare(heads_of(p.f, H, hs, K * V), rf));
    auto r = make_row(what + "/fp32 " + k.name, bn, e, bound32, dtype + " inputs; o and final state" + subset);
    r.digest = sha256_hex_of<float>(p.o);
    rows.push_back(r);
  };
  vs_fp32(run, "prefill");
  if (t.has_algorithms()) {
    vs_fp32(chk, "chunked");
    vs_fp32(rec, "recurrent");
  }
  // FP64 reference on fewer heads (the slowest check).
  const kda::KdaCase c64 = first_heads(c, k.fp64_heads);
  const int64_t h64 = c64.spec.cfg.num_heads;
  std::vector<double> o64(c64.o_size()), f64(c64.state_size());
  if (!kda::reference_fp64(c64.spec.cfg, c64.inputs(), o64, f64, t.opt.threads).is_ok()) {
    rows.push_back(flag_row(k.name, "reference", false, "FP64 reference failed"));
    return;
  }
  const std::string sub64 = h64 < H ? "heads 0.." + std::to_string(h64 - 1) + " of " + std::to_string(H) : "";
  const auto e64 = worst(kda::compare(heads_of(run.o, H, h64, V), o64), kda::compare(heads_of(run.f, H, h64, K * V), f64));
  rows.push_back(make_row("prefill/fp64 " + k.name, bn, e64, kda::kTolFp32, sub64));
  if (bn != "reference") {  // the FP32 reference itself (with --backend reference: the row above)
    const auto e_ref = worst(kda::compare(heads_of(ro, hs, h64, V), o64), kda::compare(heads_of(rf, hs, h64, K * V), f64));
    rows.push_back(make_row("fp32/fp64 " + k.name, "reference", e_ref, kda::kTolFp32, sub64));
  }
  if (t.has_algorithms()) {
    const auto eq = worst(kda::compare(rec.o, chk.o), kda::compare(rec.f, chk.f));
    rows.push_back(make_row("recurrent/chunked " + k.name, bn, eq, kda::kTolFp32, "o and final state"));
  }
}

void pool_rows(const Target& tgt, int64_t heads, uint64_t seed, std::vector<ValidateRow>& rows) {
  const std::string& bn = tgt.b.name;
  // K3 shape: decode 5 rows (one padding) and verify 3 x 8 draft tokens on a 40-slot pool.
  kda::CaseSpec s = spec_of(heads, 128, GateMode::kSafe, StateLayout::kKFirst, true, {24}, {}, seed);
  const std::string hs = "H=" + std::to_string(heads);
  s.initial_state = false;
  const kda::KdaCase c = kda::make_case(s);
  const auto& cfg = c.spec.cfg;
  const int64_t block = cfg.num_heads * cfg.head_k * cfg.head_v, slots = 40, hv = cfg.num_heads * cfg.head_v;
  kda::CaseSpec ps = s;
  ps.seqlens = std::vector<int64_t>(slots, 0);
  ps.initial_state = true;
  const std::vector<float> pool0 = kda::make_case(ps).initial_state;

  // One token of case c (token `t`) from a given state, by the FP32 reference: o and state.
  auto ref_steps = [&](int64_t first, int64_t count, const float* state, std::vector<float>& o, std::vector<float>& f) {
    kda::KdaInputs in = c.inputs();
    in.q.bf16 = in.q.bf16.subspan(first * cfg.num_heads * cfg.head_k, count * cfg.num_heads * cfg.head_k);
    in.k.bf16 = in.k.bf16.subspan(first * cfg.num_heads * cfg.head_k, count * cfg.num_heads * cfg.head_k);
    in.v.bf16 = in.v.bf16.subspan(first * hv, count * hv);
    in.g = in.g.subspan(first * cfg.num_heads * cfg.head_k, count * cfg.num_heads * cfg.head_k);
    in.beta = in.beta.subspan(first * cfg.num_heads, count * cfg.num_heads);
    in.initial_state = {state, static_cast<size_t>(block)};
    o.assign(count * hv, 0.0f);
    f.assign(block, 0.0f);
    return kda::reference_fp32(cfg, in, {o, f}, tgt.opt.threads).is_ok();
  };

  {  // decode: rows 0..4 of the first 5 tokens
    std::vector<float> pool = pool0, o(5 * hv);
    const std::vector<int32_t> idx = {7, 31, -1, 0, 12};
    kda::KdaInputs in = c.inputs();
    in.q.bf16 = in.q.bf16.first(5 * cfg.num_heads * cfg.head_k);
    in.k.bf16 = in.k.bf16.first(5 * cfg.num_heads * cfg.head_k);
    in.v.bf16 = in.v.bf16.first(5 * hv);
    in.g = in.g.first(5 * cfg.num_heads * cfg.head_k);
    in.beta = in.beta.first(5 * cfg.num_heads);
    const Status st = run_kda_decode(tgt.b, cfg, {in, pool, idx, o}, tgt.opt);
    if (!tgt.b.decode) {
      rows.push_back(skip_row("decode " + hs + " N=5", bn, st));
    } else if (!st.is_ok()) {
      rows.push_back(flag_row("decode " + hs + " N=5", bn, false, st.to_string()));
    } else {
      kda::ErrorStats e;
      bool untouched = true, pad_zero = true;
      for (int64_t n = 0; n < 5; ++n) {
        if (idx[n] < 0) {
          for (int64_t j = 0; j < hv; ++j) pad_zero &= o[n * hv + j] == 0.0f;
          continue;
        }
        std::vector<float> ro, rf;
        ref_steps(n, 1, pool0.data() + idx[n] * block, ro, rf);
        e = worst(e, worst(kda::compare(std::span<const float>(o).subspan(n * hv, hv), ro),
                           kda::compare(std::span<const float>(pool).subspan(idx[n] * block, block), rf)));
      }
      for (int64_t sl = 0; sl < slots; ++sl) {
        if (sl == 7 || sl == 31 || sl == 0 || sl == 12) continue;
        untouched &= std::equal(pool.begin() + sl * block, pool.begin() + (sl + 1) * block, pool0.begin() + sl * block);
      }
      auto r = make_row("decode/fp32 " + hs + " K=V=128 N=5 (1 pad)", bn, e, kda::kTolFp32, "o and slot states");
      r.digest = sha256_hex_of<float>(o);
      rows.push_back(r);
      rows.push_back(flag_row("decode: 36 unnamed slots bit-identical", bn, untouched && pad_zero,
                              untouched ? (pad_zero ? "and the padding row's o is 0" : "padding row o not 0")
                                        : "an unnamed slot changed"));
    }
  }
  if (bn == "cuda") {  // decode from / to a BF16 state pool (a cuda option): its own tolerance
    std::vector<uint16_t> pool16(pool0.size());
    for (size_t i = 0; i < pool0.size(); ++i) pool16[i] = bf16_from_f32(pool0[i]);
    std::vector<float> widened(pool0.size()), o(4 * hv);
    for (size_t i = 0; i < pool0.size(); ++i) widened[i] = bf16_to_f32(pool16[i]);
    const std::vector<int32_t> idx = {3, 9, 20, 39};
    kda::KdaInputs in = c.inputs();
    in.q.bf16 = in.q.bf16.first(4 * cfg.num_heads * cfg.head_k);
    in.k.bf16 = in.k.bf16.first(4 * cfg.num_heads * cfg.head_k);
    in.v.bf16 = in.v.bf16.first(4 * hv);
    in.g = in.g.first(4 * cfg.num_heads * cfg.head_k);
    in.beta = in.beta.first(4 * cfg.num_heads);
    kda::DecodeArgs a{in, {}, idx, o};
    a.state_pool_bf16 = pool16;
    const Status st = run_kda_decode(tgt.b, cfg, a, tgt.opt);
    if (!st.is_ok()) {
      rows.push_back(flag_row("decode/bf16-state " + hs + " N=4", bn, false, st.to_string()));
    } else {
      kda::ErrorStats e;
      for (int64_t n = 0; n < 4; ++n) {
        std::vector<float> ro, rf, got(block);
        ref_steps(n, 1, widened.data() + idx[n] * block, ro, rf);
        for (int64_t i = 0; i < block; ++i) got[i] = bf16_to_f32(pool16[idx[n] * block + i]);
        e = worst(e, worst(kda::compare(std::span<const float>(o).subspan(n * hv, hv), ro), kda::compare(got, rf)));
      }
      rows.push_back(make_row("decode/bf16-state " + hs + " K=V=128 N=4", bn, e, kda::kTolBf16State,
                              "BF16 pool, FP32 math; vs the FP32 reference from the same slots"));
    }
  }
  {  // verify: 3 sequences x 8 draft tokens
    const int64_t T = 8;
    std::vector<float> pool = pool0, o(3 * T * hv);
    std::vector<int32_t> idx(3 * T);
    for (int64_t i = 0; i < 3 * T; ++i) idx[i] = static_cast<int32_t>(i + 2);  // slots 2..25; 0, 1, 26.. untouched
    idx[5] = -1;  // sequence 0 does not keep the state after its 6th token
    const std::vector<int32_t> acc = {3, 8, 1};
    const Status st = run_kda_verify(tgt.b, cfg, {c.inputs(), T, pool, idx, acc, o}, tgt.opt);
    if (!tgt.b.verify) {
      rows.push_back(skip_row("verify " + hs + " N=3 T=8", bn, st));
    } else if (!st.is_ok()) {
      rows.push_back(flag_row("verify " + hs + " N=3 T=8", bn, false, st.to_string()));
    } else {
      kda::ErrorStats e;
      for (int64_t n = 0; n < 3; ++n) {
        const int64_t read = idx[n * T + acc[n] - 1];
        std::vector<float> ro, rf;
        for (int64_t t = 0; t < T; ++t) {
          ref_steps(n * T, t + 1, pool0.data() + read * block, ro, rf);
          e = worst(e, kda::compare(std::span<const float>(o).subspan((n * T + t) * hv, hv),
                                    std::span<const float>(ro).subspan(t * hv, hv)));
          if (idx[n * T + t] >= 0) {
            e = worst(e, kda::compare(std::span<const float>(pool).subspan(idx[n * T + t] * block, block), rf));
          }
        }
      }
      bool untouched = true;
      for (int64_t sl : {0, 1, 7}) {  // slot 7 = idx[5]'s would-be slot, not written
        untouched &= std::equal(pool.begin() + sl * block, pool.begin() + (sl + 1) * block, pool0.begin() + sl * block);
      }
      for (int64_t sl = 26; sl < slots; ++sl) {
        untouched &= std::equal(pool.begin() + sl * block, pool.begin() + (sl + 1) * block, pool0.begin() + sl * block);
      }
      auto r = make_row("verify/fp32 " + hs + " N=3 T=8 acc 3/8/1", bn, e, kda::kTolFp32,
                        "o and every prefix state");
      r.digest = sha256_hex_of<float>(o);
      rows.push_back(r);
      rows.push_back(flag_row("verify: 17 unwritten slots bit-identical", bn, untouched,
                              untouched ? "" : "an unwritten slot changed"));
    }
  }
}

// Speculative verify without snapshots on the K3 shape: 4 sequences of 8 / 5 / 3 / 2 draft tokens
// (varlen, a 8-token window; one padding row) from slots of a 40-slot pool, accepting 3 / 5 / - / 0.
// verify_replay + commit against decode run token by token through the same backend (bit for
// bit), against the FP32 reference (err_ratio), with non-finite inputs, and the refusals.
void replay_rows(const Target& tgt, int64_t heads, uint64_t seed, std::vector<ValidateRow>& rows) {
  const std::string& bn = tgt.b.name;
  const std::string hs = "H=" + std::to_string(heads);
  const std::vector<int64_t> lens = {8, 5, 3, 2};
  kda::CaseSpec s = spec_of(heads, 128, GateMode::kSafe, StateLayout::kKFirst, true, lens, {}, seed + 9);
  s.initial_state = false;
  kda::KdaCase c = kda::make_case(s);
  const auto& cfg = c.spec.cfg;
  const int64_t H = cfg.num_heads, K = cfg.head_k, V = cfg.head_v, block = H * K * V, slots = 40, tw = 8;
  kda::CaseSpec ps = s;
  ps.seqlens = std::vector<int64_t>(slots, 0);
  ps.initial_state = true;
  const std::vector<float> pool0 = kda::make_case(ps).initial_state;
  const std::vector<int32_t> idx = {4, 17, -1, 30}, acc = {3, 5, 0, 0};
  const int64_t per_window = kda::replay_window_floats(cfg, tw).value();
  const std::string name = "replay " + hs + " K=V=128 varlen 8/5/3/2 acc 3/5/-/0";

  // Decode token by token through the backend: every draft token's o, and each slot after its
  // accepted prefix.
  auto decode_steps = [&](const kda::KdaCase& k, std::vector<float>& o, std::vector<float>& pool) -> Status {
    const kda::KdaInputs in = k.inputs();
    std::vector<float> run = pool0;
    pool = pool0;
    o.assign(k.o_size(), 0.0f);
    for (int64_t t = 0; t <= tw; ++t) {
      for (size_t n = 0; n < idx.size(); ++n) {
        if (idx[n] >= 0 && acc[n] == t) {
          std::copy(run.begin() + idx[n] * block, run.begin() + (idx[n] + 1) * block, pool.begin() + idx[n] * block);
        }
      }
      if (t == tw) break;
      std::vector<uint16_t> q, kk, v;
      std::vector<float> g, beta;
      std::vector<int32_t> sidx;
      std::vector<int64_t> tok;
      for (size_t n = 0; n < idx.size(); ++n) {
        const int64_t r = k.cu_seqlens[n] + t;
        if (r >= k.cu_seqlens[n + 1]) continue;
        q.insert(q.end(), in.q.bf16.begin() + r * H * K, in.q.bf16.begin() + (r + 1) * H * K);
        kk.insert(kk.end(), in.k.bf16.begin() + r * H * K, in.k.bf16.begin() + (r + 1) * H * K);
        v.insert(v.end(), in.v.bf16.begin() + r * H * V, in.v.bf16.begin() + (r + 1) * H * V);
        g.insert(g.end(), in.g.begin() + r * H * K, in.g.begin() + (r + 1) * H * K);
        beta.insert(beta.end(), in.beta.begin() + r * H, in.beta.begin() + (r + 1) * H);
        sidx.push_back(idx[n]);
        tok.push_back(r);
      }
      if (tok.empty()) continue;
      kda::KdaInputs step = in;
      step.cu_seqlens = {};
      step.q = kda::ActSpan::of(std::span<const uint16_t>(q));
      step.k = kda::ActSpan::of(std::span<const uint16_t>(kk));
      step.v = kda::ActSpan::of(std::span<const uint16_t>(v));
      step.g = g;
      step.beta = beta;
      std::vector<float> so(tok.size() * H * V);
      K3_RETURN_IF_ERROR(run_kda_decode(tgt.b, cfg, {step, run, sidx, so}, tgt.opt));
      for (size_t j = 0; j < tok.size(); ++j) {
        std::copy(so.begin() + j * H * V, so.begin() + (j + 1) * H * V, o.begin() + tok[j] * H * V);
      }
    }
    return Status::ok();
  };
  auto replay = [&](const kda::KdaCase& k, std::vector<float>& o, std::vector<float>& pool,
                    std::vector<float>& window) -> Status {
    pool = pool0;
    o.assign(k.o_size(), 0.0f);
    window.assign(slots * per_window, 0.0f);
    kda::ReplayVerifyArgs va{k.inputs(), tw, pool, idx, window, o};
    K3_RETURN_IF_ERROR(run_kda_verify_replay(tgt.b, cfg, va, tgt.opt));
    if (pool != pool0) return check_failed("verify_replay wrote the state pool");
    return run_kda_commit(tgt.b, cfg, {tw, pool, window, idx, acc}, tgt.opt);
  };
  auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };

  std::vector<float> o, pool, window, od, pd;
  const Status st = replay(c, o, pool, window);
  if (!tgt.b.verify_replay || !tgt.b.commit) {
    rows.push_back(skip_row(name, bn, st));
    return;
  }
  if (!st.is_ok()) {
    rows.push_back(flag_row(name, bn, false, st.to_string()));
    return;
  }
  const Status sd = decode_steps(c, od, pd);
  if (!sd.is_ok()) {
    rows.push_back(flag_row(name, bn, false, "decode: " + sd.to_string()));
    return;
  }
  // Against the FP32 reference: each sequence's o from its slot, and the committed states.
  kda::ErrorStats e;
  for (size_t n = 0; n < idx.size(); ++n) {
    if (idx[n] < 0) continue;
    kda::KdaInputs in = c.inputs();
    const int64_t first = c.cu_seqlens[n], count = c.cu_seqlens[n + 1] - first;
    in.cu_seqlens = {};
    in.q.bf16 = in.q.bf16.subspan(first * H * K, count * H * K);
    in.k.bf16 = in.k.bf16.subspan(first * H * K, count * H * K);
    in.v.bf16 = in.v.bf16.subspan(first * H * V, count * H * V);
    in.g = in.g.subspan(first * H * K, count * H * K);
    in.beta = in.beta.subspan(first * H, count * H);
    in.initial_state = {pool0.data() + idx[n] * block, static_cast<size_t>(block)};
    std::vector<float> ro(count * H * V), rf(block);
    (void)kda::reference_fp32(cfg, in, {ro, {}}, tgt.opt.threads);
    e = worst(e, kda::compare(std::span<const float>(o).subspan(first * H * V, count * H * V), ro));
    kda::KdaInputs acc_in = in;  // the accepted prefix only: the committed state
    acc_in.q.bf16 = acc_in.q.bf16.first(acc[n] * H * K);
    acc_in.k.bf16 = acc_in.k.bf16.first(acc[n] * H * K);
    acc_in.v.bf16 = acc_in.v.bf16.first(acc[n] * H * V);
    acc_in.g = acc_in.g.first(acc[n] * H * K);
    acc_in.beta = acc_in.beta.first(acc[n] * H);
    std::vector<float> ao(acc[n] * H * V);
    if (acc[n] > 0) {
      (void)kda::reference_fp32(cfg, acc_in, {ao, rf}, tgt.opt.threads);
    } else {
      rf.assign(pool0.begin() + idx[n] * block, pool0.begin() + (idx[n] + 1) * block);
    }
    e = worst(e, kda::compare(std::span<const float>(pool).subspan(idx[n] * block, block), rf));
  }
  auto r = make_row(name, bn, e, kda::kTolFp32, "o and committed states vs the FP32 reference");
  r.digest = sha256_hex_of<float>(pool);
  rows.push_back(r);
  rows.push_back(flag_row("replay: commit = decode token by token, bit for bit", bn, same(o, od) && same(pool, pd),
                          same(o, od) ? (same(pool, pd) ? "o of every draft token and all 40 slots (acc 0: untouched)"
                                                        : "the committed states differ from decode's")
                                      : "verify_replay's o differs from decode's"));
  {  // non-finite inputs: a NaN k in sequence 0's accepted token 1, +inf v in sequence 1's token 2
    kda::KdaCase bad = c;
    bad.k16[(c.cu_seqlens[0] + 1) * H * K + 5 * K + 3] = bf16_from_f32(std::nanf(""));
    bad.v16[(c.cu_seqlens[1] + 2) * H * V + 7 * V + 9] = bf16_from_f32(INFINITY);
    std::vector<float> bo, bp, bw, bdo, bdp;
    const Status s1 = replay(bad, bo, bp, bw), s2 = decode_steps(bad, bdo, bdp);
    const bool poisoned = std::isnan(bp[idx[0] * block + 5 * K * V]) && std::isnan(bp[idx[1] * block + 7 * K * V + 9]);
    const bool ok = s1.is_ok() && s2.is_ok() && same(bo, bdo) && same(bp, bdp) && poisoned;
    rows.push_back(flag_row("replay: non-finite k / v follow decode's policy, bit for bit", bn, ok,
                            !s1.is_ok() ? s1.to_string()
                            : !s2.is_ok() ? s2.to_string()
                            : ok ? "the poisoned head / column of the committed states is NaN, as decode's"
                                 : "differs from decode"));
  }
  {  // refusals: each named, nothing changed
    std::vector<float> p2 = pool0, w2(slots * per_window, 0.0f), o2(c.o_size());
    kda::ReplayVerifyArgs va{c.inputs(), tw, p2, idx, w2, o2};
    bool ok = run_kda_verify_replay(tgt.b, cfg, va, tgt.opt).is_ok();
    const std::vector<int32_t> too_many = {3, 6, 0, 0}, twice = {4, 4, -1, 30};
    const std::string m1 = run_kda_commit(tgt.b, cfg, {tw, p2, w2, idx, too_many}, tgt.opt).message();
    const std::string m2 = run_kda_commit(tgt.b, cfg, {tw, p2, w2, twice, acc}, tgt.opt).message();
    ok &= m1.find("num_accepted[1] = 6 exceeds the 5 draft tokens") != std::string::npos;
    ok &= m2 == "state_indices: state slot 4 is named twice (sequences 0 and 1)";
    ok &= same(p2, pool0);
    ok &= run_kda_commit(tgt.b, cfg, {tw, p2, w2, idx, acc}, tgt.opt).is_ok();
    const std::string m3 = run_kda_commit(tgt.b, cfg, {tw, p2, w2, idx, acc}, tgt.opt).message();
    ok &= m3.find("exceeds the 0 draft tokens verified into window slot 4") != std::string::npos;
    rows.push_back(flag_row("replay: refusals (num_accepted past the verified tokens, a slot named twice, a second "
                            "commit)",
                            bn, ok, ok ? "each refused by name, the pool unchanged" : m1 + " | " + m2 + " | " + m3));
  }
}

// The same bytes for 1, 2 and 3 threads, twice each: the backend as called (algorithm auto); on
// the cpu and cuda backends each algorithm instead (cuda: the thread count is not used, the runs
// check run-to-run determinism).
void determinism_rows(const Target& t, uint64_t seed, std::vector<ValidateRow>& rows) {
  const kda::KdaCase c = kda::make_case(
      spec_of(12, 128, GateMode::kSafe, StateLayout::kVFirst, true, {15, 200, 77}, {100}, seed + 5));
  const std::vector<Algorithm> algos =
      t.has_algorithms() ? std::vector<Algorithm>{Algorithm::kChunked, Algorithm::kRecurrent} : std::vector<Algorithm>{Algorithm::kAuto};
  for (Algorithm algo : algos) {
    std::string d1;
    bool same = true, ok = true;
    for (int threads : {1, 2, 3}) {
      for (int rep = 0; rep < 2; ++rep) {
        const Out r = run_prefill(t, c, algo, threads);
        ok &= r.st.is_ok();
        const std::string d = sha256_hex_of<float>(r.o) + sha256_hex_of<float>(r.f);
        if (d1.empty()) d1 = d;
        same &= d == d1;
      }
    }
    auto r = flag_row(std::string("1/2/3 threads x 2 runs ") + kda::algorithm_name(algo), t.b.name, ok && same,
                      !ok ? "a run failed" : same ? "bit-identical o and final state (digests)" : "digests differ");
    r.digest = d1.substr(0, 16);
    rows.push_back(r);
  }
}

// The CPU backend at every SIMD level this CPU has, each algorithm.
void isa_rows(const Target& t, uint64_t seed, std::vector<ValidateRow>& rows) {
  const kda::KdaCase c = kda::make_case(
      spec_of(4, 100, GateMode::kSoftplus, StateLayout::kKFirst, false, {130, 15}, {40, 41}, seed + 6));
  std::vector<float> ro(c.o_size()), rf(c.state_size());
  if (!kda::reference_fp32(c.spec.cfg, c.inputs(), {ro, rf}, t.opt.threads).is_ok()) {
    rows.push_back(flag_row("isa levels", "reference", false, "FP32 reference failed"));
    return;
  }
  for (int l = 0; l <= static_cast<int>(best_isa_level()); ++l) {
    const auto isa = static_cast<IsaLevel>(l);
    for (Algorithm algo : {Algorithm::kChunked, Algorithm::kRecurrent}) {
      const Out r = run_prefill(t, c, algo, 0, isa);
      if (!r.st.is_ok()) {
        rows.push_back(flag_row(std::string("isa ") + isa_level_name(isa), t.b.name, false, r.st.to_string()));
        continue;
      }
      auto row = make_row(std::string(kda::algorithm_name(algo)) + "/fp32 isa " + isa_level_name(isa), t.b.name,
                          worst(kda::compare(r.o, ro), kda::compare(r.f, rf)), kda::kTolFp32,
                          "D=100 softplus varlen 130/15, fp32 inputs");
      row.digest = sha256_hex_of<float>(r.o);
      rows.push_back(row);
    }
  }
}

// The small ops (the registry's conv / rmsnorm entries of the backend under test) against their
// FP64 references.
void ops_rows(const Target& t, uint64_t seed, std::vector<ValidateRow>& rows) {
  auto conv = [&](const kda::ConvArgs& a) { return run_kda_conv(t.b, a, t.opt); };
  auto norm = [&](const kda::GatedRmsNormArgs& a) { return run_kda_rmsnorm(t.b, a, t.opt); };
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto randv = [&](size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = nd(rng);
    return v;
  };
  {  // conv on the K3 q projection width (H * K = 12288) with varlen and rolling state
    const int64_t D = 12288, W = 4;
    const std::vector<int64_t> cu = {0, 15, 16, 80};
    const auto x = randv(80 * D), w = randv(D * W), b = randv(D);
    const auto st0 = randv(3 * D * (W - 1));
    std::vector<float> y(80 * D), yr(80 * D), s = st0, sr = st0;
    const bool ok = conv({D, W, true, x, w, b, cu, s, y}).is_ok() &&
                    kda::causal_conv1d_reference({D, W, true, x, w, b, cu, sr, yr}).is_ok();
    auto r = make_row("conv1d+silu/fp64 W=4 D=12288 varlen", t.b.name, kda::compare(y, yr), kda::kTolFp32,
                      s == sr ? "T 15/1/64; rolling state exact" : "rolling state differs");
    r.pass = r.pass && ok && s == sr;
    r.digest = sha256_hex_of<float>(y);
    rows.push_back(r);
  }
  {  // gated RMSNorm over [T = 64, H = 96, V = 128]
    const int64_t D = 128, R = 64 * 96;
    const auto x = randv(R * D), g = randv(R * D), w = randv(D);
    std::vector<float> y(R * D), yr(R * D);
    const bool ok = norm({D, 1e-5f, x, g, w, y}).is_ok() &&
                    kda::gated_rmsnorm_reference({D, 1e-5f, x, g, w, yr}).is_ok();
    auto r = make_row("gated rmsnorm/fp64 T=64 H=96 V=128", t.b.name, kda::compare(y, yr), kda::kTolFp32, "");
    r.pass = r.pass && ok;
    r.digest = sha256_hex_of<float>(y);
    rows.push_back(r);
  }
}

// --require NAME, where NAME is a KDA backend: a row that fails unless it is usable here.
void require_rows(const ValidateOptions& opt, std::vector<ValidateRow>& rows) {
  for (const auto& cap : opt.require) {
    auto b = find_kda_backend(cap);
    if (!b.is_ok()) continue;  // a capability of another op
    const Status st = b.value()->available();
    rows.push_back(flag_row("require " + cap, cap, st.is_ok(), st.is_ok() ? "available" : st.message()));
  }
}

std::vector<ValidateRow> run_kda(const ValidateOptions& opt) {
  std::vector<ValidateRow> rows;
  require_rows(opt, rows);
  // --backend all (the default): the registry's default KDA backend.
  const std::string name = opt.backend == "all" ? default_kda_backend().name : opt.backend;
  auto found = find_kda_backend(name);
  if (!found.is_ok()) {
    rows.push_back(flag_row("backend " + name, name, false, found.status().message()));
    return rows;
  }
  const Target t{*found.value(), opt.backend_options};
  if (const Status st = t.b.available(); !st.is_ok()) {
    rows.push_back(flag_row("backend " + name + " usable", name, false, st.message()));
    return rows;
  }
  const bool smoke = opt.suite == "smoke";
  const uint64_t s = opt.seed;
  std::vector<Case> cases = {
      {"T=63 D=60 H=8 safe kf bf16", spec_of(8, 60, GateMode::kSafe, StateLayout::kKFirst, true, {63}, {}, s), 8, 8},
      {"T=500 D=100 H=8 softplus vf bf16", spec_of(8, 100, GateMode::kSoftplus, StateLayout::kVFirst, true,
                                                               {500}, {0, 17, 250, 499}, s + 1), 8, 8},
      {"varlen 15/500/1/63/300 H=8 bf16", spec_of(8, 128, GateMode::kSafe, StateLayout::kKFirst, true,
                                                              {15, 500, 1, 63, 300}, {15, 300}, s + 3), 8, 4},
  };
  if (!smoke) {
    cases.push_back({"T=1000 D=128 H=8 g=-1000 kf bf16", spec_of(8, 128, GateMode::kLogDecay, StateLayout::kKFirst,
                                                                 true, {1000}, {63, 64, 100, 517, 999}, s + 2), 8, 4});
    cases.push_back({"T=1500 D=128 H=8 log_decay vf fp32",
                     spec_of(8, 128, GateMode::kLogDecay, StateLayout::kVFirst, false, {1500}, {700}, s + 4), 8, 2});
    // The K3 shape: all 96 heads against the FP32 reference; the FP64 reference checks heads
    // 0 and 1 only, to keep the default run to about a minute on 2 cores.
    cases.push_back({"K3 T=8192 H=96 K=V=128 bf16",
                     spec_of(96, 128, GateMode::kSafe, StateLayout::kKFirst, true, {8192}, {4000}, s + 7), 96, 2});
  }
  for (const auto& k : cases) prefill_rows(t, k, rows);
  pool_rows(t, smoke ? 8 : 96, s + 8, rows);
  replay_rows(t, smoke ? 8 : 96, s + 8, rows);
  determinism_rows(t, s, rows);
  if (t.is_cpu()) isa_rows(t, s, rows);
  if (t.is_cpu() || t.b.name == "cuda") ops_rows(t, s + 9, rows);
  return rows;
}

}  // namespace

std::vector<ValidateRow> validate_kda(const ValidateOptions& o) { return run_kda(o); }

}  // namespace k3::harness
