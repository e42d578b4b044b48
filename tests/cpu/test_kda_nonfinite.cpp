// The KDA non-finite policy (docs/kda.md, "Non-finite values"), the same in every backend: the
// FP64 and FP32 references and the CPU backend at every SIMD level this CPU has, recurrent and
// chunked, head by head and chunk-major, prefill, decode and verify. Every output and state
// element must be NaN exactly where the policy says (computed here from the inputs alone), never
// +-Inf, and finite elsewhere; the finite elements must still match the FP64 reference.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "k3/harness/kda_case.hpp"
#include "k3/formats.hpp"
#include "k3/cpu_kda.hpp"
#include "k3/kda.hpp"

namespace k3::kda {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<IsaLevel> levels() {
  std::vector<IsaLevel> l;
  for (int i = 0; i <= static_cast<int>(best_isa_level()); ++i) l.push_back(static_cast<IsaLevel>(i));
  return l;
}


// 0: finite, 1: NaN, 2: +-Inf
int cls(double x) { return std::isnan(x) ? 1 : (std::isinf(x) ? 2 : 0); }

float act(const KdaCase& c, const std::vector<uint16_t>& b, const std::vector<float>& f, int64_t i) {
  return c.spec.bf16 ? bf16_to_f32(b[static_cast<size_t>(i)]) : f[static_cast<size_t>(i)];
}
void set_act(KdaCase& c, std::vector<uint16_t>& b, std::vector<float>& f, int64_t i, float x) {
  if (c.spec.bf16) b[static_cast<size_t>(i)] = bf16_from_f32(x);
  else f[static_cast<size_t>(i)] = x;
}

// The policy, from the inputs alone: expected class of every o and final_state element.
struct Expected {
  std::vector<int> o, f;
};

Expected expected_classes(const KdaCase& c) {
  const KdaConfig& k = c.spec.cfg;
  const int64_t H = k.num_heads, K = k.head_k, V = k.head_v, T = c.num_tokens, N = c.num_seqs;
  const bool kf = k.layout == StateLayout::kKFirst;
  Expected e{std::vector<int>(static_cast<size_t>(T * H * V)), std::vector<int>(static_cast<size_t>(N * H * K * V))};
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t0 = c.cu_seqlens.empty() ? 0 : c.cu_seqlens[n], t1 = c.cu_seqlens.empty() ? T : c.cu_seqlens[n + 1];
    for (int64_t h = 0; h < H; ++h) {
      const int64_t so = (n * H + h) * K * V;
      auto sidx = [&](int64_t d, int64_t j) { return so + (kf ? d * V + j : j * K + d); };
      std::vector<bool> col(static_cast<size_t>(V), false);
      if (t1 == t0) {  // no token: the initial state passes through unchanged
        for (int64_t d = 0; d < K; ++d) {
          for (int64_t j = 0; j < V; ++j) {
            e.f[static_cast<size_t>(sidx(d, j))] = c.initial_state.empty() ? 0 : cls(c.initial_state[sidx(d, j)]);
          }
        }
        continue;
      }
      if (!c.initial_state.empty()) {  // a non-finite entry poisons its column from the first token
        for (int64_t d = 0; d < K; ++d) {
          for (int64_t j = 0; j < V; ++j) col[j] = col[j] || !std::isfinite(c.initial_state[sidx(d, j)]);
        }
      }
      for (int64_t t = t0; t < t1; ++t) {
        bool q_bad = false, whole = false;
        for (int64_t d = 0; d < K; ++d) {
          const int64_t i = (t * H + h) * K + d;
          q_bad = q_bad || !std::isfinite(act(c, c.q16, c.q32, i));
          whole = whole || !std::isfinite(act(c, c.k16, c.k32, i));
          const double f = c.g[i];
          if (k.gate == GateMode::kLogDecay) {
            whole = whole || std::isnan(f) || f > kMaxLogDecay;
          } else {
            const double bias = c.dt_bias.empty() ? 0.0 : c.dt_bias[h * K + d];
            whole = whole || std::isnan(f + bias);  // +-Inf saturates the gate
          }
        }
        const float b = c.beta[t * H + h];
        whole = whole || (k.beta_logits ? std::isnan(b) : !std::isfinite(b));
        for (int64_t j = 0; j < V; ++j) {
          col[j] = col[j] || whole || !std::isfinite(act(c, c.v16, c.v32, (t * H + h) * V + j));
          e.o[static_cast<size_t>((t * H + h) * V + j)] = (q_bad || col[j]) ? 1 : 0;
        }
      }
      for (int64_t d = 0; d < K; ++d) {
        for (int64_t j = 0; j < V; ++j) e.f[static_cast<size_t>(sidx(d, j))] = col[j] ? 1 : 0;
      }
    }
  }
  return e;
}

// Class check of one backend's result plus accuracy of its finite part against the FP64 one.
template <typename R>
void expect_policy(const std::string& what, const Expected& e, const std::vector<R>& o, const std::vector<R>& f,
                   const std::vector<double>& o64, const std::vector<double>& f64) {
  int bad = 0;
  auto check = [&](const char* name, const std::vector<int>& want, const std::vector<R>& got,
                   const std::vector<double>& ref) {
    ASSERT_EQ(want.size(), got.size()) << what << " " << name;
    double e2 = 0, r2 = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const int g = cls(static_cast<double>(got[i]));
      if (g != want[i] && bad++ < 8) {
        ADD_FAILURE() << what << ": " << name << "[" << i << "] = " << got[i] << ", expected "
                      << (want[i] == 1 ? "NaN" : (want[i] == 2 ? "Inf" : "finite"));
      }
      if (g == 0 && want[i] == 0 && std::isfinite(ref[i])) {
        const double d = static_cast<double>(got[i]) - ref[i];
        e2 += d * d;
        r2 += ref[i] * ref[i];
      }
    }
    if (r2 > 0) {
      EXPECT_LT(std::sqrt(e2 / r2), 2e-5) << what << " " << name << ": finite part vs FP64";
    }
  };
  check("o", e.o, o, o64);
  check("final_state", e.f, f, f64);
}

// Runs every prefill backend on the case and checks each against the policy.
void check_all_backends(const KdaCase& c, const std::string& label) {
  const Expected e = expected_classes(c);
  const KdaInputs in = c.inputs();
  std::vector<double> o64(static_cast<size_t>(c.o_size())), f64(static_cast<size_t>(c.state_size()));
  ASSERT_TRUE(reference_fp64(c.spec.cfg, in, o64, f64).is_ok()) << label;
  expect_policy(label + " fp64-reference", e, o64, f64, o64, f64);
  std::vector<float> o(static_cast<size_t>(c.o_size())), f(static_cast<size_t>(c.state_size()));
  ASSERT_TRUE(reference_fp32(c.spec.cfg, in, {o, f}).is_ok()) << label;
  expect_policy(label + " fp32-reference", e, o, f, o64, f64);
  for (IsaLevel isa : levels()) {
    for (Algorithm algo : {Algorithm::kRecurrent, Algorithm::kChunked}) {
      // 1 thread: chunk-major; 3 threads > H = 2: head by head.
      for (int threads : {1, 3}) {
        std::fill(o.begin(), o.end(), 7.0f);
        std::fill(f.begin(), f.end(), 7.0f);
        const Status st = k3::cpu::prefill(c.spec.cfg, in, {o, f}, cpu_options_at(isa, algo, threads));
        ASSERT_TRUE(st.is_ok()) << st.to_string();
        expect_policy(label + " cpu " + isa_level_name(isa) + " " + algorithm_name(algo) + " threads " +
                          std::to_string(threads),
                      e, o, f, o64, f64);
      }
    }
  }
}

// Two heads, K 20 (padded to 32 inside), V 20 (staged state) or 32; sequences of 37, 0 and 19
// tokens (chunks of 16 with a tail); FP32 or BF16 activations.
KdaCase base_case(GateMode gate, bool bf16 = false, int64_t v = 20, StateLayout layout = StateLayout::kKFirst) {
  CaseSpec s;
  s.cfg.num_heads = 2;
  s.cfg.head_k = 20;
  s.cfg.head_v = v;
  s.cfg.gate = gate;
  s.cfg.layout = layout;
  s.seqlens = {37, 0, 19};
  s.bf16 = bf16;
  s.seed = 5;
  return make_case(s);
}

// token t, head h, channel d of g / q / k; column j of v
int64_t gi(const KdaCase& c, int64_t t, int64_t h, int64_t d) { return (t * c.spec.cfg.num_heads + h) * c.spec.cfg.head_k + d; }
int64_t vi(const KdaCase& c, int64_t t, int64_t h, int64_t j) { return (t * c.spec.cfg.num_heads + h) * c.spec.cfg.head_v + j; }

TEST(KdaNonfinite, GatePlusInfPoisonsTheWholeStateFromItsToken) {
  for (float bad : {kInf, kNaN, 100.0f, 88.5f}) {
    KdaCase c = base_case(GateMode::kLogDecay);
    c.g[gi(c, 21, 1, 3)] = bad;  // sequence 0, head 1, in the second chunk
    c.g[gi(c, 40, 0, 0)] = bad;  // sequence 2 (tokens 37..55), head 0, its token 3
    check_all_backends(c, "g = " + std::to_string(bad));
    // Exactly those: the outputs of head 1 before token 21 and of head 0 in sequence 0 stay finite.
    const Expected e = expected_classes(c);
    EXPECT_EQ(e.o[vi(c, 20, 1, 0)], 0);
    EXPECT_EQ(e.o[vi(c, 21, 1, 0)], 1);
    EXPECT_EQ(e.o[vi(c, 36, 0, 5)], 0);
  }
}

TEST(KdaNonfinite, GateMinusInfIsAResetNotPoison) {
  KdaCase c = base_case(GateMode::kLogDecay);
  for (int64_t d = 0; d < 20; ++d) c.g[gi(c, 9, 0, d)] = -kInf;
  c.g[gi(c, 30, 1, 4)] = -kInf;
  check_all_backends(c, "g = -inf");
  // Exactly a finite hard reset (exp(-1000) = 0 in FP64 too).
  KdaCase r = c;
  for (auto& x : r.g) x = std::isinf(x) ? -1000.0f : x;
  std::vector<double> a(static_cast<size_t>(c.o_size())), b(a.size()), fa(static_cast<size_t>(c.state_size())), fb(fa.size());
  ASSERT_TRUE(reference_fp64(c.spec.cfg, c.inputs(), a, fa).is_ok());
  ASSERT_TRUE(reference_fp64(r.spec.cfg, r.inputs(), b, fb).is_ok());
  EXPECT_EQ(a, b);
}

TEST(KdaNonfinite, GatedModesSaturateInfinitiesAndPoisonNaN) {
  for (GateMode gate : {GateMode::kSafe, GateMode::kSoftplus}) {
    KdaCase c = base_case(gate);
    c.g[gi(c, 3, 0, 1)] = kInf;
    c.g[gi(c, 4, 1, 2)] = -kInf;
    check_all_backends(c, std::string(gate_mode_name(gate)) + " f = +-inf");
    for (int v : expected_classes(c).o) ASSERT_EQ(v, 0);  // saturated: nothing poisoned
    c.g[gi(c, 25, 1, 7)] = kNaN;
    check_all_backends(c, std::string(gate_mode_name(gate)) + " f = NaN");
    c = base_case(gate);
    c.dt_bias[1 * 20 + 6] = kNaN;  // head 1: every token of every sequence
    check_all_backends(c, std::string(gate_mode_name(gate)) + " dt_bias = NaN");
    c = base_case(gate);
    c.dt_bias[0 * 20 + 6] = -kInf;
    c.g[gi(c, 2, 0, 6)] = kInf;  // -inf + inf = NaN: poison
    check_all_backends(c, std::string(gate_mode_name(gate)) + " f + dt_bias = inf - inf");
  }
}

TEST(KdaNonfinite, QPoisonsOnlyItsOutputRow) {
  for (bool bf16 : {false, true}) {
    for (bool l2norm : {true, false}) {
      KdaCase c = base_case(GateMode::kSafe, bf16);
      c.spec.cfg.l2norm_qk = l2norm;
      set_act(c, c.q16, c.q32, gi(c, 5, 1, 19), kInf);
      set_act(c, c.q16, c.q32, gi(c, 16, 0, 0), -kInf);
      set_act(c, c.q16, c.q32, gi(c, 50, 1, 8), kNaN);
      check_all_backends(c, std::string("q non-finite") + (bf16 ? " bf16" : " fp32") + (l2norm ? "" : " no l2norm"));
      const Expected e = expected_classes(c);
      EXPECT_EQ(e.o[vi(c, 5, 1, 0)], 1);
      EXPECT_EQ(e.o[vi(c, 6, 1, 0)], 0);
    }
  }
}

TEST(KdaNonfinite, KAndBetaPoisonTheWholeState) {
  for (bool bf16 : {false, true}) {
    KdaCase c = base_case(GateMode::kLogDecay, bf16);
    set_act(c, c.k16, c.k32, gi(c, 17, 0, 2), kInf);
    set_act(c, c.k16, c.k32, gi(c, 45, 1, 0), kNaN);
    check_all_backends(c, std::string("k non-finite") + (bf16 ? " bf16" : " fp32"));
  }
  KdaCase c = base_case(GateMode::kSafe);
  c.beta[30 * 2 + 1] = kNaN;  // logits: NaN poisons
  c.beta[12 * 2 + 0] = kInf;  // logits: +-inf saturate to beta = 1 / 0
  c.beta[13 * 2 + 0] = -kInf;
  check_all_backends(c, "beta logits NaN / +-inf");
  c.spec.cfg.beta_logits = false;  // beta given: any non-finite value poisons
  for (auto& b : c.beta) b = std::isfinite(b) ? 0.5f + 0.4f * std::tanh(b) : b;
  check_all_backends(c, "beta given NaN / +-inf");
}

TEST(KdaNonfinite, VPoisonsItsColumnFromItsToken) {
  for (bool bf16 : {false, true}) {
    for (int64_t v : {int64_t{20}, int64_t{32}}) {
      KdaCase c = base_case(GateMode::kSafe, bf16, v);
      set_act(c, c.v16, c.v32, vi(c, 18, 0, 3), kInf);
      set_act(c, c.v16, c.v32, vi(c, 18, 0, 4), -kInf);
      set_act(c, c.v16, c.v32, vi(c, 2, 1, v - 1), kNaN);
      set_act(c, c.v16, c.v32, vi(c, 54, 1, 0), kInf);  // last token of sequence 2
      check_all_backends(c, "v non-finite V " + std::to_string(v) + (bf16 ? " bf16" : " fp32"));
      const Expected e = expected_classes(c);
      EXPECT_EQ(e.o[vi(c, 17, 0, 3)], 0);
      EXPECT_EQ(e.o[vi(c, 18, 0, 3)], 1);
      EXPECT_EQ(e.o[vi(c, 36, 0, 3)], 1);
      EXPECT_EQ(e.o[vi(c, 36, 0, 5)], 0);
    }
  }
}

TEST(KdaNonfinite, InitialStatePoisonsItsColumnAndEmptySequencesPassItThrough) {
  for (StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst}) {
    KdaCase c = base_case(GateMode::kLogDecay, false, 20, layout);
    const bool kf = layout == StateLayout::kKFirst;
    auto at = [&](int64_t n, int64_t h, int64_t d, int64_t j) {
      return static_cast<size_t>((n * 2 + h) * 20 * 20 + (kf ? d * 20 + j : j * 20 + d));
    };
    c.initial_state[at(0, 0, 7, 2)] = kInf;
    c.initial_state[at(0, 1, 0, 19)] = kNaN;
    c.initial_state[at(1, 0, 3, 3)] = -kInf;  // sequence 1 is empty: kept as is
    c.initial_state[at(2, 1, 19, 0)] = kInf;
    for (int64_t d = 0; d < 20; ++d) c.g[gi(c, 0, 0, d)] = -kInf;  // a reset does not clear it (Inf * 0)
    check_all_backends(c, std::string("initial_state non-finite ") + state_layout_name(layout));
  }
}

TEST(KdaNonfinite, PoisonIsStickyThroughResets) {
  KdaCase c = base_case(GateMode::kLogDecay);
  c.v32[static_cast<size_t>(vi(c, 4, 0, 9))] = kNaN;
  c.g[gi(c, 10, 1, 0)] = kInf;
  for (int64_t t : {6, 20, 33}) {
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t d = 0; d < 20; ++d) c.g[gi(c, t, h, d)] = -kInf;
    }
  }
  check_all_backends(c, "poison then resets");
  const Expected e = expected_classes(c);
  EXPECT_EQ(e.o[vi(c, 36, 0, 9)], 1);
  EXPECT_EQ(e.o[vi(c, 36, 1, 0)], 1);
}

// Decode and verify follow the same policy, on pool slots (in place: K-first with V = 32; staged:
// V = 20 or V-first), including a slot that already holds a non-finite entry.
TEST(KdaNonfinite, DecodeAndVerifyFollowThePolicy) {
  for (IsaLevel isa : levels()) {
    for (int64_t v : {int64_t{20}, int64_t{32}}) {
      for (StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst}) {
        // One sequence of 6 tokens, decoded token by token and verified in one call.
        CaseSpec s;
        s.cfg.num_heads = 2;
        s.cfg.head_k = 20;
        s.cfg.head_v = v;
        s.cfg.layout = layout;
        s.cfg.gate = GateMode::kLogDecay;
        s.seqlens = {6};
        s.bf16 = false;
        s.seed = 9;
        KdaCase c = make_case(s);
        const bool kf = layout == StateLayout::kKFirst;
        c.initial_state[static_cast<size_t>((1 * 20 * v) + (kf ? 4 * v + 1 : 1 * 20 + 4))] = kInf;  // head 1, column 1
        c.v32[static_cast<size_t>(vi(c, 2, 0, 5))] = -kInf;
        c.q32[static_cast<size_t>(gi(c, 3, 1, 0))] = kNaN;
        c.g[gi(c, 4, 0, 7)] = kInf;
        const Expected e = expected_classes(c);
        const int64_t H = 2, K = 20, block = H * K * v;
        const std::string what = std::string(isa_level_name(isa)) + " V " + std::to_string(v) + " " +
                                 state_layout_name(layout);
        // decode: slot 1 of a 2-slot pool, one token per call.
        std::vector<float> pool(static_cast<size_t>(2 * block), 0.0f);
        std::copy(c.initial_state.begin(), c.initial_state.end(), pool.begin() + block);
        std::vector<float> o(static_cast<size_t>(c.o_size()));
        const std::vector<int32_t> idx = {1};
        for (int64_t t = 0; t < 6; ++t) {
          KdaInputs in;
          in.q = ActSpan::of(std::span<const float>(c.q32).subspan(t * H * K, H * K));
          in.k = ActSpan::of(std::span<const float>(c.k32).subspan(t * H * K, H * K));
          in.v = ActSpan::of(std::span<const float>(c.v32).subspan(t * H * v, H * v));
          in.g = std::span<const float>(c.g).subspan(t * H * K, H * K);
          in.beta = std::span<const float>(c.beta).subspan(t * H, H);
          DecodeArgs a{in, pool, idx, std::span<float>(o).subspan(t * H * v, H * v)};
          ASSERT_TRUE(k3::cpu::decode(s.cfg, a, cpu_options_at(isa, Algorithm::kAuto, 2)).is_ok());
        }
        for (int64_t i = 0; i < block; ++i) EXPECT_EQ(pool[i], 0.0f);  // slot 0 untouched
        std::vector<double> o64(static_cast<size_t>(c.o_size())), f64(static_cast<size_t>(c.state_size()));
        ASSERT_TRUE(reference_fp64(s.cfg, c.inputs(), o64, f64).is_ok());
        const std::vector<float> fin(pool.begin() + block, pool.end());
        expect_policy("decode " + what, e, o, fin, o64, f64);
        // verify: the 6 tokens as drafts read from slot 0 (the initial state); the state after
        // token t goes to slot vidx[t] (token 0's over the read slot), the last one to slot 6.
        std::vector<float> vpool(static_cast<size_t>(7 * block), 0.0f);
        std::copy(c.initial_state.begin(), c.initial_state.end(), vpool.begin());
        KdaInputs in = c.inputs();
        in.initial_state = {};
        const std::vector<int32_t> vidx = {0, 2, 3, 4, 5, 6};  // read slot 0 (accepted 1), store 2..6
        const std::vector<int32_t> acc = {1};
        std::vector<float> vo(static_cast<size_t>(c.o_size()));
        VerifyArgs va{in, 6, vpool, vidx, acc, vo};
        ASSERT_TRUE(k3::cpu::verify(s.cfg, va, cpu_options_at(isa, Algorithm::kAuto, 2)).is_ok());
        const std::vector<float> vfin(vpool.begin() + 6 * block, vpool.end());
        expect_policy("verify " + what, e, vo, vfin, o64, f64);
      }
    }
  }
}

TEST(KdaNonfinite, ALogOutsideItsRangeIsAnErrorNamingTheEntry) {
  KdaCase c = base_case(GateMode::kSafe);
  std::vector<float> o(static_cast<size_t>(c.o_size())), f(static_cast<size_t>(c.state_size()));
  for (float bad : {kNaN, kInf, 100.0f, -90.0f}) {
    c.a_log[1] = bad;
    const Status st = k3::cpu::prefill(c.spec.cfg, c.inputs(), {o, f});
    ASSERT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find("a_log[1] = "), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("is outside [-87, 88]"), std::string::npos) << st.message();
    EXPECT_FALSE(reference_fp32(c.spec.cfg, c.inputs(), {o, f}).is_ok());
  }
  c.a_log[1] = 88.0f;  // the limits themselves are accepted
  EXPECT_TRUE(k3::cpu::prefill(c.spec.cfg, c.inputs(), {o, f}).is_ok());
}

}  // namespace
}  // namespace k3::kda
