// The FP64 oracles (k3/moe_ref.hpp) against an independent naive implementation written here
// (sequential loops, its own E2M1 table and activation formulas), against hand-computed values,
// and for bit-identical results across OpenMP thread counts.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "k3/formats.hpp"
#include "k3/moe_ref.hpp"
#include "k3/mx.hpp"
#include "core/moe_case_util.hpp"

namespace k3 {
namespace {

// Cases: k3::test::random_moe_case (core/moe_case_util.hpp) with scale codes 121..123.
using Case = test::MoeCase;
Case random_case(int64_t k, int64_t n, int e, int top_k, int64_t m, int ep_size, int ep_rank, uint64_t seed) {
  return test::random_moe_case(k, n, e, top_k, m, ep_size, ep_rank, seed, 127 - 5);
}

// ---- the naive oracle -------------------------------------------------------------------------
double e2m1_value(int code) {
  static const double kMag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return (code & 8) ? -kMag[code & 7] : kMag[code & 7];
}

// Element (row, col) of expert e's MXFP4 matrix [rows, cols].
double weight(const std::vector<uint8_t>& q, const std::vector<uint8_t>& s, int64_t e, int64_t rows, int64_t cols,
              int64_t row, int64_t col) {
  const uint8_t byte = q[(e * rows + row) * (cols / 2) + col / 2];
  const int code = (col % 2 == 0) ? (byte & 0xF) : (byte >> 4);
  return std::ldexp(e2m1_value(code), s[(e * rows + row) * (cols / 32) + col / 32] - 127);
}

// MXFP8 round trip of a float row through the library's row API (the codec is tested on its own).
std::vector<double> mxfp8_round_trip(const std::vector<float>& v) {
  const int64_t cols = static_cast<int64_t>(v.size());
  std::vector<uint8_t> q(cols), s(cols / 32);
  std::vector<float> back(cols);
  EXPECT_TRUE(mx_quantize(v, 1, cols, MxElement::kE4M3, ScaleRule::kRceil, q, s).is_ok());
  EXPECT_TRUE(mx_dequantize(q, s, 1, cols, MxElement::kE4M3, back).is_ok());
  return {back.begin(), back.end()};
}

double naive_act(const Activation& a, double g, double u, double b, double lb) {
  auto sig = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  switch (a.kind) {
    case ActivationKind::kSiTU: return b * std::tanh(g / b) * sig(g) * lb * std::tanh(u / lb);
    case ActivationKind::kSwiGLU: {
      const double lim = a.swiglu_limit;
      const double gg = std::isnan(g) ? g : std::min(g, lim);
      const double uu = std::isnan(u) ? u : std::max(-lim, std::min(u, lim));
      return gg * sig(a.swiglu_alpha * gg) * (uu + a.swiglu_beta);
    }
    case ActivationKind::kSiLU: return g * sig(g) * u;
  }
  return NAN;
}

std::vector<double> naive_oracle(const Case& c, OracleKind kind) {
  const auto& sh = c.p.shape;
  const int64_t k = sh.hidden, n = sh.intermediate;
  const int first = sh.first_local_expert(), el = sh.local_experts();
  std::vector<double> out(c.m * k, 0.0);
  for (int64_t t = 0; t < c.m; ++t) {
    std::vector<float> xf(k);
    for (int64_t i = 0; i < k; ++i) xf[i] = bf16_to_f32(c.x[t * k + i]);
    std::vector<double> xin = c.p.recipe == Recipe::kW4A8 ? mxfp8_round_trip(xf) : std::vector<double>(xf.begin(), xf.end());
    for (int s = 0; s < sh.top_k; ++s) {
      const int id = c.ids[t * sh.top_k + s];
      if (id < first || id >= first + el) continue;
      const int e = id - first;
      const double b = c.betas.empty() ? c.p.activation.situ_beta : c.betas[e];
      const double lb = c.lbetas.empty() ? c.p.activation.situ_linear_beta : c.lbetas[e];
      std::vector<double> act(n);
      for (int64_t j = 0; j < n; ++j) {
        double g = 0, u = 0;
        for (int64_t i = 0; i < k; ++i) {
          g += xin[i] * weight(c.f1q, c.f1s, e, 2 * n, k, j, i);
          u += xin[i] * weight(c.f1q, c.f1s, e, 2 * n, k, n + j, i);
        }
        act[j] = naive_act(c.p.activation, g, u, b, lb);
      }
      if (kind == OracleKind::kContract) {
        if (c.p.recipe == Recipe::kW4A8) {
          act = mxfp8_round_trip(std::vector<float>(act.begin(), act.end()));
        } else {
          for (auto& v : act) v = bf16_to_f32(bf16_from_f32(static_cast<float>(v)));
        }
      }
      for (int64_t r = 0; r < k; ++r) {
        double y = 0;
        for (int64_t j = 0; j < n; ++j) y += act[j] * weight(c.f2q, c.f2s, e, k, n, r, j);
        out[t * k + r] += static_cast<double>(c.wts[t * sh.top_k + s]) * y;
      }
    }
  }
  return out;
}

std::vector<double> run_oracle(const Case& c, OracleKind kind) {
  std::vector<double> out(c.m * c.p.shape.hidden, -1.0);
  const Status st = moe_oracle(c.p, c.wv(), c.iv(), kind, out);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return out;
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  double scale = 1.0;
  for (double v : want) scale = std::max(scale, std::fabs(v));
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::fabs(got[i] - want[i]) <= 1e-12 * scale) && bad++ < 5) {
      ADD_FAILURE() << what << ": element " << i << " oracle " << got[i] << " naive " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

// ---- tests ------------------------------------------------------------------------------------

TEST(MoeOracle, MatchesNaiveAtOddShapesForEveryRecipeActivationAndKind) {
  // K 96, N 160, E 5, top-3, M 19 (the odd shape of the project's test rules).
  for (Recipe r : {Recipe::kW4A8, Recipe::kW4A16}) {
    for (ActivationKind a : {ActivationKind::kSiTU, ActivationKind::kSwiGLU, ActivationKind::kSiLU}) {
      Case c = random_case(96, 160, 5, 3, 19, 1, 0, 11);
      c.p.recipe = r;
      c.p.activation.kind = a;
      for (OracleKind kind : {OracleKind::kContract, OracleKind::kBf16Reference}) {
        const std::string what = std::string(recipe_name(r)) + "/" + activation_name(a) + "/" + oracle_kind_name(kind);
        expect_close(run_oracle(c, kind), naive_oracle(c, kind), what.c_str());
      }
    }
  }
}

TEST(MoeOracle, ContractAndReferenceDifferOnlyByTheIntermediateRounding) {
  Case c = random_case(96, 160, 5, 3, 19, 1, 0, 12);
  for (Recipe r : {Recipe::kW4A8, Recipe::kW4A16}) {
    c.p.recipe = r;
    const auto con = run_oracle(c, OracleKind::kContract), ref = run_oracle(c, OracleKind::kBf16Reference);
    double num = 0, den = 0;
    for (size_t i = 0; i < con.size(); ++i) {
      num += (con[i] - ref[i]) * (con[i] - ref[i]);
      den += ref[i] * ref[i];
    }
    const double nrmse = std::sqrt(num / den);
    // E4M3 keeps 3 mantissa bits (relative rounding error up to 2^-4), BF16 keeps 7 (2^-8).
    if (r == Recipe::kW4A8) {
      EXPECT_GT(nrmse, 2e-3);
      EXPECT_LT(nrmse, 6e-2);
    } else {
      EXPECT_GT(nrmse, 1e-4);
      EXPECT_LT(nrmse, 4e-3);
    }
  }
}

// Hand-computed: x = [17, 0, ...]; MXFP8 (RCEIL: scale 2^-4, 272 -> tie -> 256) makes it 16,
// BF16 keeps 17. Gate weights 6 (gate 96 or 102) and up weights 48 (up 768 or 816) saturate SiTU
// exactly: 4 * 1 * 1 * 25 * 1 = 100. Re-quantized to MXFP8: scale 2^-2, 400 -> tie between 384
// and 416 -> even -> 384, i.e. 96. GEMM2 with 32 weights of 1: 32 * 96 = 3072 (W4A8) or 3200.
// Routing weight 0.5.
TEST(MoeOracle, HandComputedSaturatedSituShowsBothRoundingPoints) {
  Case c;
  c.p.shape = {32, 32, 1, 1, 1, 0};
  c.m = 1;
  c.f1q.assign(64 * 16, 0);
  c.f1s.assign(64, 127);
  for (int j = 0; j < 32; ++j) {
    c.f1q[j * 16] = 0x7;              // gate row j: element 0 = 6 (code 7), scale 2^0
    c.f1q[(32 + j) * 16] = 0x7;       // up row j: element 0 = 6, scale 2^3 -> 48
    c.f1s[32 + j] = 127 + 3;
  }
  c.f2q.assign(32 * 16, 0x22);        // every element 1.0 (code 2)
  c.f2s.assign(32, 127);
  c.x.assign(32, 0);
  c.x[0] = bf16_from_f32(17.f);
  c.ids = {0};
  c.wts = {0.5f};
  struct Want { Recipe r; OracleKind kind; double v; };
  for (const Want& w : {Want{Recipe::kW4A8, OracleKind::kContract, 1536.0},
                        Want{Recipe::kW4A8, OracleKind::kBf16Reference, 1600.0},
                        Want{Recipe::kW4A16, OracleKind::kContract, 1600.0},
                        Want{Recipe::kW4A16, OracleKind::kBf16Reference, 1600.0}}) {
    c.p.recipe = w.r;
    const auto out = run_oracle(c, w.kind);
    for (double v : out) ASSERT_EQ(v, w.v) << recipe_name(w.r) << " " << oracle_kind_name(w.kind);
  }
  // Negative up: -100 -> -96 (W4A8), and a per-expert override b = 2 gives 2 * 25 = 50 -> MXFP8
  // scale 2^-3, 400 -> 384, i.e. 48.
  for (int j = 0; j < 32; ++j) c.f1q[(32 + j) * 16] = 0xF;  // -6
  c.p.recipe = Recipe::kW4A8;
  EXPECT_EQ(run_oracle(c, OracleKind::kContract)[5], -1536.0);
  c.betas = {2.0f};
  EXPECT_EQ(run_oracle(c, OracleKind::kContract)[5], -0.5 * 32 * 48);
}

TEST(MoeOracle, PerExpertSituOverridesMatchNaive) {
  Case c = random_case(64, 96, 4, 2, 9, 1, 0, 13);
  c.betas = {4.0f, 2.0f, 8.0f, 1.5f};
  c.lbetas = {25.0f, 10.0f, 40.0f, 3.0f};
  const auto with = run_oracle(c, OracleKind::kContract);
  expect_close(with, naive_oracle(c, OracleKind::kContract), "overrides");
  Case d = c;
  d.betas.clear();
  d.lbetas.clear();
  EXPECT_NE(with, run_oracle(d, OracleKind::kContract));
}

TEST(MoeOracle, ExpertParallelKeepsOnlyLocalSlotsAndZeroesRowsWithoutOne) {
  // E 6 over EP2: rank 1 holds global experts 3, 4, 5.
  Case c = random_case(64, 32, 6, 3, 7, 2, 1, 14);
  c.ids = {0, 3, 5,  1, 2, -1,  -1, -1, -1,  4, -1, 0,  5, 4, 3,  2, 1, 0,  3, -1, 2};
  c.wts[4] = NAN;  // remote slot: must not poison the row
  c.wts[6] = NAN;  // masked slot
  for (Recipe r : {Recipe::kW4A8, Recipe::kW4A16}) {
    c.p.recipe = r;
    const auto out = run_oracle(c, OracleKind::kContract);
    expect_close(out, naive_oracle(c, OracleKind::kContract), "ep2 rank 1");
    for (int64_t t : {1, 2, 5}) {  // no local slot: exact +0.0
      for (int64_t i = 0; i < 64; ++i) {
        uint64_t bits;
        std::memcpy(&bits, &out[t * 64 + i], 8);
        ASSERT_EQ(bits, 0u) << "row " << t;
      }
    }
    for (int64_t i = 0; i < 64; ++i) ASSERT_TRUE(std::isfinite(out[i]));
  }
  // Rank 0 of the same problem sees the complementary slots; the ranks' sum is the EP1 result
  // up to FP64 rounding.
  Case r0 = c, one = c;
  r0.p.shape.ep_rank = 0;
  one.p.shape.ep_size = 1;
  one.p.shape.ep_rank = 0;
  std::vector<uint8_t>* parts[4][3] = {{&one.f1q, &r0.f1q, &c.f1q}, {&one.f1s, &r0.f1s, &c.f1s},
                                       {&one.f2q, &r0.f2q, &c.f2q}, {&one.f2s, &r0.f2s, &c.f2s}};
  for (auto& pr : parts) {  // EP1 weights = rank 0's experts then rank 1's
    std::mt19937_64 rng(99);
    for (auto& b : *pr[1]) b = static_cast<uint8_t>(pr[1] == &r0.f1s || pr[1] == &r0.f2s ? 120 + rng() % 3 : rng());
    *pr[0] = *pr[1];
    pr[0]->insert(pr[0]->end(), pr[2]->begin(), pr[2]->end());
  }
  one.wts[4] = one.wts[6] = 0.25f;
  r0.wts = c.wts = one.wts;
  c.p.recipe = r0.p.recipe = one.p.recipe = Recipe::kW4A8;
  const auto a = run_oracle(r0, OracleKind::kContract), b = run_oracle(c, OracleKind::kContract),
             all = run_oracle(one, OracleKind::kContract);
  for (size_t i = 0; i < all.size(); ++i) EXPECT_NEAR(a[i] + b[i], all[i], 1e-12 * (1 + std::fabs(all[i])));
}

TEST(MoeOracle, BitIdenticalAcrossThreadCountsAndChunks) {
  // M 70 crosses the 64-token chunk; one expert takes many slots.
  Case c = random_case(96, 64, 5, 3, 70, 1, 0, 15);
  for (int64_t t = 0; t < 70; ++t) c.ids[t * 3] = 2;
  for (int64_t t = 0; t < 70; ++t) {
    if (c.ids[t * 3 + 1] == 2) c.ids[t * 3 + 1] = -1;
    if (c.ids[t * 3 + 2] == 2) c.ids[t * 3 + 2] = -1;
  }
  const int saved = omp_get_max_threads();
  std::vector<double> first;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    const auto out = run_oracle(c, OracleKind::kContract);
    if (first.empty()) {
      first = out;
    } else {
      ASSERT_EQ(std::memcmp(first.data(), out.data(), out.size() * 8), 0) << threads << " threads";
    }
  }
  omp_set_num_threads(saved);
  expect_close(first, naive_oracle(c, OracleKind::kContract), "m70");
}

TEST(MoeOracle, NanInputPoisonsOnlyItsRowAndInfIsDefined) {
  Case c = random_case(64, 32, 3, 2, 4, 1, 0, 16);
  c.ids = {0, 1, 1, 2, 2, 0, 0, 2};
  c.x[1 * 64 + 40] = 0x7FC0;  // NaN in token 1
  c.x[2 * 64 + 3] = 0x7F80;   // +Inf in token 2
  for (Recipe r : {Recipe::kW4A8, Recipe::kW4A16}) {
    c.p.recipe = r;
    const auto out = run_oracle(c, OracleKind::kContract);
    for (int64_t i = 0; i < 64; ++i) {
      EXPECT_TRUE(std::isfinite(out[i])) << recipe_name(r);
      EXPECT_TRUE(std::isnan(out[64 + i])) << recipe_name(r);  // every GEMM1 sum meets the NaN
      EXPECT_TRUE(std::isfinite(out[3 * 64 + i])) << recipe_name(r);
    }
    // Inf: the naive oracle applies the same IEEE rules (Inf * 0 = NaN, Inf - Inf = NaN).
    const auto want = naive_oracle(c, OracleKind::kContract);
    for (int64_t i = 0; i < 64; ++i) {
      const double g = out[2 * 64 + i], w = want[2 * 64 + i];
      EXPECT_TRUE((std::isnan(g) && std::isnan(w)) || g == w || std::fabs(g - w) <= 1e-9 * std::fabs(w))
          << recipe_name(r) << " " << g << " vs " << w;
    }
  }
}

// Rows an FP32 backend can overflow where FP64 does not are marked (k3/moe_ref.hpp): the largest
// finite BF16 in a W4A16 row meets weights of magnitude >= 1, so sum|x| * max|W1| > FLT_MAX. NaN
// and Inf rows are not marked (their class is the same in FP32), nor are ordinary rows; the
// outputs do not change.
TEST(MoeOracle, MarksTheRowsBeyondFp32RangeOnly) {
  Case c = random_case(64, 32, 3, 2, 5, 1, 0, 17);
  c.p.recipe = Recipe::kW4A16;
  c.ids = {0, 1, 1, 2, 2, 0, 0, 2, 1, 2};
  c.f1s.assign(c.f1s.size(), 127);  // |W1| up to 6
  c.x[1 * 64 + 40] = 0x7FC0;        // NaN in token 1
  c.x[2 * 64 + 3] = 0x7F80;         // +Inf in token 2
  c.x[3 * 64 + 0] = 0x7F7F;         // 3.39e38 in token 3
  std::vector<double> out(5 * 64), ref(5 * 64), plain(5 * 64);
  std::vector<bool> beyond;
  ASSERT_TRUE(moe_oracle(c.p, c.wv(), c.iv(), OracleKind::kContract, out, &beyond).is_ok());
  EXPECT_EQ(beyond, (std::vector<bool>{false, false, false, true, false}));
  ASSERT_TRUE(moe_oracle(c.p, c.wv(), c.iv(), OracleKind::kContract, plain).is_ok());
  EXPECT_EQ(std::memcmp(out.data(), plain.data(), out.size() * sizeof(double)), 0);
  std::vector<bool> both;
  ASSERT_TRUE(moe_oracles(c.p, c.wv(), c.iv(), out, ref, &both).is_ok());
  EXPECT_EQ(both, beyond);
  std::vector<bool> ref_only;
  ASSERT_TRUE(moe_oracle(c.p, c.wv(), c.iv(), OracleKind::kBf16Reference, ref, &ref_only).is_ok());
  EXPECT_EQ(ref_only, beyond);
  // The same row under W4A8 is +Inf by definition (MXFP8 of 3.39e38 overflows): nothing to mark.
  c.p.recipe = Recipe::kW4A8;
  ASSERT_TRUE(moe_oracle(c.p, c.wv(), c.iv(), OracleKind::kContract, out, &beyond).is_ok());
  EXPECT_EQ(beyond, std::vector<bool>(5, false));
  // Ordinary scales and inputs: no row is marked.
  Case d = random_case(64, 32, 3, 2, 4, 1, 0, 18);
  std::vector<double> out_d(4 * 64);
  ASSERT_TRUE(moe_oracle(d.p, d.wv(), d.iv(), OracleKind::kContract, out_d, &beyond).is_ok());
  EXPECT_EQ(beyond, std::vector<bool>(4, false));
}

TEST(MoeOracle, ErrorsNameTheProblem) {
  Case c = random_case(64, 32, 3, 2, 4, 1, 0, 17);
  std::vector<double> out(4 * 64);
  std::vector<double> short_out(10);
  Status st = moe_oracle(c.p, c.wv(), c.iv(), OracleKind::kContract, short_out);
  EXPECT_NE(st.message().find("out [M, K] has 10 elements, expected 256"), std::string::npos) << st.message();
  c.ids[3] = 3;
  st = moe_oracle(c.p, c.wv(), c.iv(), OracleKind::kContract, out);
  EXPECT_NE(st.message().find("topk_ids[1, 1] = 3"), std::string::npos) << st.message();
  c.ids[3] = 0;
  c.betas = {4.f, 0.f, 4.f};
  st = moe_oracle(c.p, c.wv(), c.iv(), OracleKind::kContract, out);
  EXPECT_NE(st.message().find("local expert 1: activation: situ beta = 0"), std::string::npos) << st.message();
  c.betas = {4.f, 4.f};
  st = moe_oracle(c.p, c.wv(), c.iv(), OracleKind::kContract, out);
  EXPECT_NE(st.message().find("situ_beta [E_local] has 2 elements, expected 3"), std::string::npos) << st.message();
  c.betas.clear();
  c.p.activation.swiglu_limit = NAN;
  st = moe_oracle(c.p, c.wv(), c.iv(), OracleKind::kContract, out);
  EXPECT_NE(st.message().find("swiglu limit"), std::string::npos) << st.message();
  c.p.activation.swiglu_limit = 7.f;
  c.p.shape.hidden = 48;
  st = moe_oracle(c.p, c.wv(), c.iv(), OracleKind::kContract, out);
  EXPECT_NE(st.message().find("hidden (K) = 48"), std::string::npos) << st.message();
}

TEST(MoeOracle, BothOraclesInOnePassEqualSeparateCalls) {
  Case c = random_case(96, 64, 5, 3, 21, 1, 0, 19);
  std::vector<double> con(21 * 96), ref(21 * 96);
  ASSERT_TRUE(moe_oracles(c.p, c.wv(), c.iv(), con, ref).is_ok());
  const auto con1 = run_oracle(c, OracleKind::kContract), ref1 = run_oracle(c, OracleKind::kBf16Reference);
  EXPECT_EQ(std::memcmp(con.data(), con1.data(), con.size() * 8), 0);
  EXPECT_EQ(std::memcmp(ref.data(), ref1.data(), ref.size() * 8), 0);
  EXPECT_NE(con, ref);
  std::vector<double> bad(5);
  EXPECT_NE(moe_oracles(c.p, c.wv(), c.iv(), con, bad).message().find("bf16_reference [M, K] has 5 elements"),
            std::string::npos);
}

TEST(MoeOracle, EmptyBatchIsFine) {
  Case c = random_case(64, 32, 3, 2, 0, 1, 0, 18);
  std::vector<double> out;
  EXPECT_TRUE(moe_oracle(c.p, c.wv(), c.iv(), OracleKind::kContract, out).is_ok());
}

// ---- activations --------------------------------------------------------------------------------

TEST(Activations, FormulasAndLimits) {
  EXPECT_DOUBLE_EQ(sigmoid_ref(0.0), 0.5);
  EXPECT_EQ(situ_ref(1000.0, 1000.0, 4.0, 25.0), 100.0);  // both factors saturate exactly
  EXPECT_EQ(situ_ref(0.0, 3.0, 4.0, 25.0), 0.0);
  const double g = 1.3, u = -0.7;
  EXPECT_DOUBLE_EQ(situ_ref(g, u, 4.0, 25.0), 4 * std::tanh(g / 4) / (1 + std::exp(-g)) * 25 * std::tanh(u / 25));
  EXPECT_DOUBLE_EQ(silu_and_mul_ref(g, u), g / (1 + std::exp(-g)) * u);
  // SwiGLU clamps: gate above the limit uses 7; up clamped to [-7, 7].
  EXPECT_DOUBLE_EQ(swiglu_ref(9.0, 20.0, 1.702, 1.0, 7.0), 7.0 / (1 + std::exp(-1.702 * 7)) * 8.0);
  EXPECT_DOUBLE_EQ(swiglu_ref(-3.0, -20.0, 1.702, 1.0, 7.0), -3.0 / (1 + std::exp(1.702 * 3)) * -6.0);
  EXPECT_TRUE(std::isnan(swiglu_ref(NAN, 1.0, 1.702, 1.0, 7.0)));  // NaN is not clamped away
  EXPECT_TRUE(std::isnan(swiglu_ref(1.0, NAN, 1.702, 1.0, 7.0)));
  Activation a;
  a.kind = ActivationKind::kSiLU;
  EXPECT_EQ(activation_ref(a, g, u, 4, 25), silu_and_mul_ref(g, u));
  EXPECT_TRUE(validate_activation(a).is_ok());
  a.situ_linear_beta = -1;
  EXPECT_NE(validate_activation(a).message().find("situ linear beta = -1"), std::string::npos);
}

TEST(Activations, SituAndMulRefHonoursRowStrideAndChecksArguments) {
  const int64_t rows = 3, d = 5, ld = 13;  // 3 padding columns per row
  std::vector<float> in(rows * ld);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i % 11) - 4.5f;
  std::vector<float> out(rows * d);
  ASSERT_TRUE(situ_and_mul_ref(in, rows, d, ld, 4.f, 25.f, out).is_ok());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < d; ++j) {
      const double gg = in[r * ld + j], uu = in[r * ld + d + j];
      EXPECT_EQ(out[r * d + j], static_cast<float>(4 * std::tanh(gg / 4) / (1 + std::exp(-gg)) * 25 * std::tanh(uu / 25)));
    }
  }
  EXPECT_NE(situ_and_mul_ref(in, rows, d, 9, 4.f, 25.f, out).message().find("ld = 9 must be >= 2*d = 10"),
            std::string::npos);
  EXPECT_NE(situ_and_mul_ref(std::span<const float>(in).first(20), rows, d, ld, 4.f, 25.f, out)
                .message()
                .find("in holds 20 elements, needs 36"),
            std::string::npos);
  EXPECT_NE(situ_and_mul_ref(in, rows, d, ld, 4.f, 25.f, std::span<float>(out).first(4)).message().find("out holds 4"),
            std::string::npos);
  EXPECT_NE(situ_and_mul_ref(in, rows, d, ld, 0.f, 25.f, out).message().find("situ beta = 0"), std::string::npos);
  EXPECT_NE(situ_and_mul_ref(in, rows, 0, ld, 4.f, 25.f, out).message().find("d = 0"), std::string::npos);
  EXPECT_NE(situ_and_mul_ref(in, -1, d, ld, 4.f, 25.f, out).message().find("rows = -1"), std::string::npos);
}

// ---- round_output -------------------------------------------------------------------------------

uint16_t u16_at(const std::vector<uint8_t>& b, size_t i) { return static_cast<uint16_t>(b[2 * i] | (b[2 * i + 1] << 8)); }

TEST(RoundOutput, AgreesWithFloatCodecsOnFloatsAndRoundsOnceFromDouble) {
  std::mt19937_64 rng(5);
  std::vector<double> v;
  for (int i = 0; i < 20000; ++i) {
    v.push_back(static_cast<double>(bits_to_f32(static_cast<uint32_t>(rng()))));  // any float, incl. NaN/Inf/subnormal
  }
  std::vector<uint8_t> bf(v.size() * 2), hf(v.size() * 2), ff(v.size() * 4);
  round_output(v, OutDType::kBF16, bf);
  round_output(v, OutDType::kFP16, hf);
  round_output(v, OutDType::kFP32, ff);
  for (size_t i = 0; i < v.size(); ++i) {
    const float f = static_cast<float>(v[i]);
    ASSERT_EQ(u16_at(bf, i), bf16_from_f32(f)) << v[i];
    ASSERT_EQ(u16_at(hf, i), fp16_from_f32(f)) << v[i];
    uint32_t bits;
    std::memcpy(&bits, &ff[4 * i], 4);
    ASSERT_EQ(bits, std::isnan(f) ? 0x7FC00000u : f32_to_bits(f)) << v[i];
  }
  // 1 + 2^-8 + 2^-30: just above a BF16 tie. Via FP32 it would become the tie 1 + 2^-8 and round
  // to even (1.0); rounded once it goes up to 1 + 2^-7.
  const std::vector<double> tie = {1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30), 1.0 + std::ldexp(1.0, -8),
                                   65520.0, 65519.99, 0x1.FFp127, -1e300, 1e-300, -0.0};
  std::vector<uint8_t> b2(tie.size() * 2), h2(tie.size() * 2);
  round_output(tie, OutDType::kBF16, b2);
  round_output(tie, OutDType::kFP16, h2);
  EXPECT_EQ(u16_at(b2, 0), 0x3F81);
  EXPECT_EQ(u16_at(b2, 1), 0x3F80);
  EXPECT_EQ(u16_at(h2, 2), 0x7C00);  // 65520 rounds to FP16 Inf
  EXPECT_EQ(u16_at(h2, 3), 0x7BFF);  // 65504
  EXPECT_EQ(u16_at(b2, 4), 0x7F80);  // above BF16 max + half ulp -> Inf
  EXPECT_EQ(u16_at(b2, 5), 0xFF80);
  EXPECT_EQ(u16_at(b2, 6), 0x0000);
  EXPECT_EQ(u16_at(b2, 7), 0x8000);
  EXPECT_EQ(round_to_f32(0x1.FFFFFEp127), 0x1.FFFFFEp127f);   // FLT_MAX
  EXPECT_EQ(round_to_f32(0x1.FFFFFEFp127), 0x1.FFFFFEp127f);  // below the midpoint
  EXPECT_EQ(round_to_f32(0x1.FFFFFFp127), INFINITY);          // the midpoint rounds to even: Inf
  EXPECT_EQ(round_to_f32(-1e300), -INFINITY);
  EXPECT_TRUE(std::isnan(round_to_f32(NAN)));
  // Wrong sizes write nothing.
  std::vector<uint8_t> wrong(3, 0xAB);
  round_output(tie, OutDType::kBF16, wrong);
  EXPECT_EQ(wrong, std::vector<uint8_t>(3, 0xAB));
}

}  // namespace
}  // namespace k3
