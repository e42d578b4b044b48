// KDA references: closed forms of tiny cases, gates, layouts, varlen, FP32 vs FP64, errors.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "k3/harness/kda_case.hpp"
#include "k3/kda.hpp"

namespace k3::kda {
namespace {

KdaConfig small_cfg(int64_t h, int64_t k, int64_t v, GateMode gate = GateMode::kLogDecay) {
  KdaConfig c;
  c.num_heads = h;
  c.head_k = k;
  c.head_v = v;
  c.gate = gate;
  return c;
}

TEST(KdaReference, FirstTokenFromZeroStateIsBetaTimesQkTimesV) {
  // S = beta k v^T (k normalized) so o = scale beta (q_n . k_n) v, whatever the decay.
  const KdaConfig c = small_cfg(1, 3, 2);
  const std::vector<float> q = {1, 2, 2}, k = {0, 3, 4}, v = {5, -1}, g = {-0.5f, -1, -2}, b = {0.25f};
  KdaInputs in;
  in.q = ActSpan::of(std::span<const float>(q));
  in.k = ActSpan::of(std::span<const float>(k));
  in.v = ActSpan::of(std::span<const float>(v));
  in.g = g;
  in.beta = b;
  std::vector<double> o(2), fs(6);
  ASSERT_TRUE(reference_fp64(c, in, o, fs).is_ok());
  const double beta = 1.0 / (1.0 + std::exp(-0.25));  // 0.25 and the q, k, v values are exact floats
  const double qn = 1.0 / std::sqrt(9.0 + 1e-6), kn = 1.0 / std::sqrt(25.0 + 1e-6);
  const double qk = (0 * 1 + 3 * 2 + 4 * 2) * qn * kn;
  for (int j = 0; j < 2; ++j) EXPECT_NEAR(o[j], beta * qk * v[j] / std::sqrt(3.0), 1e-12);
  for (int d = 0; d < 3; ++d) {
    for (int j = 0; j < 2; ++j) EXPECT_NEAR(fs[d * 2 + j], beta * k[d] * kn * v[j], 1e-12);
  }
}

TEST(KdaReference, TwoTokensFollowTheDeltaRuleByHand) {
  // K = V = 1: s1 = b1 v1 (k = 1 after normalization), s2 = a2 s1 + b2 (v2 - a2 s1), o2 = scale s2.
  const KdaConfig c = small_cfg(1, 1, 1);
  const std::vector<float> q = {1, 1}, k = {1, 1}, v = {2, -3}, g = {-0.1f, -0.7f}, b = {0.3f, -1.2f};
  KdaInputs in;
  in.q = ActSpan::of(std::span<const float>(q));
  in.k = ActSpan::of(std::span<const float>(k));
  in.v = ActSpan::of(std::span<const float>(v));
  in.g = g;
  in.beta = b;
  std::vector<double> o(2), fs(1);
  ASSERT_TRUE(reference_fp64(c, in, o, fs).is_ok());
  const double n = 1.0 / std::sqrt(1.0 + 1e-6);  // both q and k
  auto sig = [](float x) { return 1.0 / (1.0 + std::exp(-static_cast<double>(x))); };
  const double s1 = sig(0.3f) * n * 2.0;
  const double a2 = std::exp(static_cast<double>(-0.7f));
  const double s2 = a2 * s1 + n * sig(-1.2f) * (-3.0 - a2 * s1 * n);
  EXPECT_NEAR(o[0], s1 * n, 1e-12);
  EXPECT_NEAR(o[1], s2 * n, 1e-12);
  EXPECT_NEAR(fs[0], s2, 1e-12);
}

TEST(KdaReference, GateModesMatchTheirFormulas) {
  for (GateMode mode : {GateMode::kSafe, GateMode::kSoftplus}) {
    CaseSpec s;
    s.cfg = small_cfg(3, 5, 4, mode);
    s.seqlens = {9};
    s.bf16 = false;
    const KdaCase gated = make_case(s);
    // Same problem with the decay computed here and passed as log_decay.
    KdaCase plain = gated;
    plain.spec.cfg.gate = GateMode::kLogDecay;
    for (int64_t t = 0; t < 9; ++t) {
      for (int64_t h = 0; h < 3; ++h) {
        const double a = std::exp(static_cast<double>(gated.a_log[h]));
        for (int64_t d = 0; d < 5; ++d) {
          const double x = gated.g[(t * 3 + h) * 5 + d] + static_cast<double>(gated.dt_bias[h * 5 + d]);
          const double g = mode == GateMode::kSafe ? -5.0 / (1.0 + std::exp(-a * x))
                                                   : -a * (x > 20 ? x : std::log1p(std::exp(x)));
          plain.g[(t * 3 + h) * 5 + d] = static_cast<float>(g);
        }
      }
    }
    plain.a_log.clear();
    plain.dt_bias.clear();
    std::vector<double> o1(gated.o_size()), o2(gated.o_size()), f1(gated.state_size()), f2(gated.state_size());
    ASSERT_TRUE(reference_fp64(gated.spec.cfg, gated.inputs(), o1, f1).is_ok());
    ASSERT_TRUE(reference_fp64(plain.spec.cfg, plain.inputs(), o2, f2).is_ok());
    for (size_t i = 0; i < o1.size(); ++i) EXPECT_NEAR(o1[i], o2[i], 1e-6) << gate_mode_name(mode);
    for (size_t i = 0; i < f1.size(); ++i) EXPECT_NEAR(f1[i], f2[i], 1e-6) << gate_mode_name(mode);
  }
}

TEST(KdaReference, HardResetForgetsEverythingBefore) {
  CaseSpec s;
  s.cfg = small_cfg(2, 6, 5);
  s.seqlens = {12};
  s.resets = {7};
  const KdaCase a = make_case(s);
  // Same tokens from 7 on, different history and initial state.
  s.seed = 99;
  KdaCase b = make_case(s);
  const int64_t hk = 2 * 6, hv = 2 * 5;
  for (int64_t t = 7; t < 12; ++t) {
    std::copy(a.q16.begin() + t * hk, a.q16.begin() + (t + 1) * hk, b.q16.begin() + t * hk);
    std::copy(a.k16.begin() + t * hk, a.k16.begin() + (t + 1) * hk, b.k16.begin() + t * hk);
    std::copy(a.v16.begin() + t * hv, a.v16.begin() + (t + 1) * hv, b.v16.begin() + t * hv);
    std::copy(a.g.begin() + t * hk, a.g.begin() + (t + 1) * hk, b.g.begin() + t * hk);
    std::copy(a.beta.begin() + t * 2, a.beta.begin() + (t + 1) * 2, b.beta.begin() + t * 2);
  }
  std::vector<double> oa(a.o_size()), ob(b.o_size()), fa(a.state_size()), fb(b.state_size());
  ASSERT_TRUE(reference_fp64(a.spec.cfg, a.inputs(), oa, fa).is_ok());
  ASSERT_TRUE(reference_fp64(b.spec.cfg, b.inputs(), ob, fb).is_ok());
  for (int64_t i = 7 * hv; i < 12 * hv; ++i) EXPECT_EQ(oa[i], ob[i]);
  EXPECT_EQ(fa, fb);
  bool differ_before = false;
  for (int64_t i = 0; i < 7 * hv; ++i) differ_before |= oa[i] != ob[i];
  EXPECT_TRUE(differ_before);
}

TEST(KdaReference, VFirstLayoutIsTheTranspose) {
  CaseSpec s;
  s.cfg = small_cfg(2, 7, 3);
  s.seqlens = {5, 4};
  const KdaCase kf = make_case(s);
  KdaCase vf = kf;
  vf.spec.cfg.layout = StateLayout::kVFirst;
  const int64_t K = 7, V = 3;
  for (int64_t b = 0; b < 4; ++b) {
    for (int64_t d = 0; d < K; ++d) {
      for (int64_t j = 0; j < V; ++j) vf.initial_state[b * K * V + j * K + d] = kf.initial_state[b * K * V + d * V + j];
    }
  }
  std::vector<double> o1(kf.o_size()), o2(kf.o_size()), f1(kf.state_size()), f2(kf.state_size());
  ASSERT_TRUE(reference_fp64(kf.spec.cfg, kf.inputs(), o1, f1).is_ok());
  ASSERT_TRUE(reference_fp64(vf.spec.cfg, vf.inputs(), o2, f2).is_ok());
  EXPECT_EQ(o1, o2);
  for (int64_t b = 0; b < 4; ++b) {
    for (int64_t d = 0; d < K; ++d) {
      for (int64_t j = 0; j < V; ++j) EXPECT_EQ(f2[b * K * V + j * K + d], f1[b * K * V + d * V + j]);
    }
  }
}

// The state shape the library (and Python, through it) gives each layout: the one the transpose
// above indexes.
TEST(KdaReference, StateShapeFollowsTheLayout) {
  KdaConfig c = small_cfg(2, 7, 3);
  EXPECT_EQ(state_shape(c, 4), (std::array<int64_t, 4>{4, 2, 7, 3}));
  c.layout = StateLayout::kVFirst;
  EXPECT_EQ(state_shape(c, 4), (std::array<int64_t, 4>{4, 2, 3, 7}));
  EXPECT_EQ(state_shape(c, 0)[0], 0);
}

TEST(KdaReference, VarlenEqualsSeparateSequences) {
  CaseSpec s;
  s.cfg = small_cfg(3, 8, 6, GateMode::kSafe);
  s.seqlens = {15, 0, 4};
  const KdaCase all = make_case(s);
  std::vector<double> o(all.o_size()), f(all.state_size());
  ASSERT_TRUE(reference_fp64(all.spec.cfg, all.inputs(), o, f).is_ok());
  const int64_t H = 3, K = 8, V = 6;
  for (int64_t n = 0; n < 3; ++n) {
    const int64_t t0 = all.cu_seqlens[n], len = all.cu_seqlens[n + 1] - t0;
    KdaInputs in = all.inputs();
    in.q.bf16 = in.q.bf16.subspan(t0 * H * K, len * H * K);
    in.k.bf16 = in.k.bf16.subspan(t0 * H * K, len * H * K);
    in.v.bf16 = in.v.bf16.subspan(t0 * H * V, len * H * V);
    in.g = in.g.subspan(t0 * H * K, len * H * K);
    in.beta = in.beta.subspan(t0 * H, len * H);
    in.cu_seqlens = {};
    in.initial_state = in.initial_state.subspan(n * H * K * V, H * K * V);
    std::vector<double> on(len * H * V), fn(H * K * V);
    ASSERT_TRUE(reference_fp64(all.spec.cfg, in, on, fn).is_ok());
    for (int64_t i = 0; i < len * H * V; ++i) EXPECT_EQ(on[i], o[t0 * H * V + i]);
    for (int64_t i = 0; i < H * K * V; ++i) EXPECT_EQ(fn[i], f[n * H * K * V + i]);
  }
}

TEST(KdaReference, Fp32AgreesWithFp64) {
  for (bool bf16 : {true, false}) {
    CaseSpec s;
    s.cfg = small_cfg(2, 60, 100, GateMode::kSafe);
    s.seqlens = {70, 15};
    s.bf16 = bf16;
    s.resets = {20};
    const KdaCase c = make_case(s);
    std::vector<double> o64(c.o_size()), f64(c.state_size());
    std::vector<float> o32(c.o_size()), f32(c.state_size());
    ASSERT_TRUE(reference_fp64(c.spec.cfg, c.inputs(), o64, f64).is_ok());
    ASSERT_TRUE(reference_fp32(c.spec.cfg, c.inputs(), {o32, f32}).is_ok());
    EXPECT_LT(compare(o32, o64).err_ratio, 1e-5);
    EXPECT_LT(compare(f32, f64).err_ratio, 1e-5);
  }
}

TEST(KdaReference, ErrorsNameTheTensorAndTheSizes) {
  CaseSpec s;
  s.cfg = small_cfg(2, 4, 3, GateMode::kSafe);
  s.seqlens = {5, 3};
  const KdaCase c = make_case(s);
  std::vector<float> o(c.o_size()), f(c.state_size());
  auto expect_error = [&](const KdaConfig& cfg, const KdaInputs& in, std::span<float> oo, const std::string& text) {
    const Status st = reference_fp32(cfg, in, {oo, f});
    EXPECT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find(text), std::string::npos) << st.message();
  };
  KdaInputs in = c.inputs();
  in.k.bf16 = in.k.bf16.first(7);
  expect_error(c.spec.cfg, in, o, "k has 7 elements, expected 64");
  in = c.inputs();
  in.q.bf16 = in.q.bf16.first(7);
  expect_error(c.spec.cfg, in, o, "not a multiple of H * K = 8");
  in = c.inputs();
  in.q.f32 = c.g;
  expect_error(c.spec.cfg, in, o, "q: set either the bf16 or the f32 span, not both");
  in = c.inputs();
  in.a_log = in.a_log.first(1);
  expect_error(c.spec.cfg, in, o, "a_log has 1 elements");
  in = c.inputs();
  in.dt_bias = in.dt_bias.first(3);
  expect_error(c.spec.cfg, in, o, "dt_bias has 3 elements, expected 8");
  in = c.inputs();
  const std::vector<int64_t> bad_cu = {0, 6, 5, 8};
  in.cu_seqlens = bad_cu;
  expect_error(c.spec.cfg, in, o, "cu_seqlens[2] = 5 is below cu_seqlens[1] = 6");
  const std::vector<int64_t> bad_end = {0, 5, 7};
  in.cu_seqlens = bad_end;
  expect_error(c.spec.cfg, in, o, "(the last entry) = 7 must equal the token count T = 8");
  const std::vector<int64_t> bad_start = {1, 8};
  in.cu_seqlens = bad_start;
  expect_error(c.spec.cfg, in, o, "cu_seqlens[0] = 1 must be 0");
  in = c.inputs();
  in.initial_state = in.initial_state.first(10);
  expect_error(c.spec.cfg, in, o, "initial_state has 10 elements, expected 48");
  expect_error(c.spec.cfg, c.inputs(), std::span<float>(o).first(3), "o has 3 elements, expected 48");
  KdaConfig bad = c.spec.cfg;
  bad.head_k = 0;
  expect_error(bad, c.inputs(), o, "head_k = 0 must be in [1, 512]");
  bad = c.spec.cfg;
  bad.num_heads = 5000;
  expect_error(bad, c.inputs(), o, "num_heads = 5000 must be in [1, 1024]");
  bad = c.spec.cfg;
  bad.gate_lower_bound = 1.0f;
  expect_error(bad, c.inputs(), o, "gate_lower_bound");
  bad = c.spec.cfg;
  bad.scale = -1.0f;
  expect_error(bad, c.inputs(), o, "scale");
  bad = c.spec.cfg;
  bad.gate = GateMode::kLogDecay;
  expect_error(bad, c.inputs(), o, "gate = log_decay takes the decay g directly");
  EXPECT_FALSE(parse_gate_mode("sigmoid").is_ok());
  EXPECT_EQ(parse_gate_mode("softplus").value(), GateMode::kSoftplus);
  EXPECT_EQ(parse_state_layout("v_first").value(), StateLayout::kVFirst);
  EXPECT_FALSE(parse_state_layout("kv").is_ok());
  EXPECT_EQ(parse_algorithm("chunked").value(), Algorithm::kChunked);
  EXPECT_FALSE(parse_algorithm("fast").is_ok());
}

}  // namespace
}  // namespace k3::kda
