// The CPU fused-MoE backend against the FP64 contract oracle (k3/moe_ref.hpp), determinism, and
// every user-facing error path.
//
// Tolerances (docs/cpu_moe.md): the backend computes the contract's rounding points exactly and
// differs from the oracle only by FP32 accumulation (GEMM1, activation, GEMM2, finalize) and by
// the rare intermediate rounding flips this causes (an MXFP8 / BF16 code of the activation output
// one step away from the oracle's when the FP64 value sits next to a rounding boundary).
//   kAccumNrmse      a token without a flip: NRMSE of its row vs the oracle
//   kFlipTokenShare  tokens with a flip, at most this share (and at least 1 allowed)
//   kFlipTokenNrmse  a token with flips: its NRMSE (one flip moves one intermediate element by
//                    one code step, 1/8 relative for E4M3, 1/256 for BF16)
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <thread>

#include "moe_test_util.hpp"
#include "scoped_env.hpp"

namespace k3 {
namespace {

constexpr double kAccumNrmse = 1e-6;
constexpr double kFlipTokenShare = 0.02;
constexpr double kFlipTokenNrmseW4A8 = 3e-2;
constexpr double kFlipTokenNrmseW4A16 = 3e-3;

std::vector<IsaLevel> supported_levels() {
  std::vector<IsaLevel> v;
  for (int l = 0; l <= static_cast<int>(best_isa_level()); ++l) v.push_back(static_cast<IsaLevel>(l));
  return v;
}

// Checks an FP32 backend output against the oracle with the tolerances above.
void expect_matches_oracle(const test::MoeCase& c, const std::vector<double>& got, const std::string& what) {
  const auto ref = test::contract_oracle(c);
  const int64_t k = c.p.shape.hidden;
  const double flip_tol = c.p.recipe == Recipe::kW4A8 ? kFlipTokenNrmseW4A8 : kFlipTokenNrmseW4A16;
  int64_t flip_tokens = 0;
  for (int64_t t = 0; t < c.m; ++t) {
    std::vector<double> g(got.begin() + t * k, got.begin() + (t + 1) * k), r(ref.begin() + t * k, ref.begin() + (t + 1) * k);
    const auto d = test::diff(g, r);
    ASSERT_EQ(d.nonfinite, 0) << what << " token " << t;
    if (d.ref_max == 0) {
      ASSERT_EQ(d.max_abs, 0.0) << what << " token " << t << " must be exactly zero";
      continue;
    }
    if (d.nrmse > kAccumNrmse) ++flip_tokens;
    EXPECT_LE(d.nrmse, flip_tol) << what << " token " << t;
  }
  const int64_t allowed = std::max<int64_t>(1, static_cast<int64_t>(kFlipTokenShare * static_cast<double>(c.m)));
  EXPECT_LE(flip_tokens, allowed) << what;
}

std::vector<double> run_fp32(test::MoeCase c, cpu::MoeOptions opt) {
  c.p.out_dtype = OutDType::kFP32;
  auto r = test::run_cpu(c, opt);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  if (!r.is_ok()) return {};
  return test::decode_output(r.value(), OutDType::kFP32);
}

TEST(CpuMoe, MatchesTheContractOracleOnEveryLevelRecipeAndActivation) {
  // Odd shape, EP2 rank 1 (remote and masked slots), M 19.
  for (IsaLevel isa : supported_levels()) {
    for (Recipe rec : {Recipe::kW4A8, Recipe::kW4A16}) {
      for (ActivationKind act : {ActivationKind::kSiTU, ActivationKind::kSwiGLU, ActivationKind::kSiLU}) {
        auto c = test::random_moe_case(96, 160, 10, 3, 19, 2, 1, 11 + static_cast<uint64_t>(act));
        c.p.recipe = rec;
        c.p.activation.kind = act;
        cpu::MoeOptions o;
        o.isa = isa;
        o.threads = 2;
        const std::string what = std::string(isa_level_name(isa)) + " " + recipe_name(rec) + " " + activation_name(act);
        auto got = run_fp32(c, o);
        ASSERT_FALSE(got.empty()) << what;
        c.p.out_dtype = OutDType::kFP32;
        expect_matches_oracle(c, got, what);
      }
    }
  }
}

TEST(CpuMoe, ManyRowsPerExpertUseRowGroupsAndStillMatch) {
  // ~80 rows per expert (> the 48-row panel group), K and N not multiples of 64.
  for (Recipe rec : {Recipe::kW4A8, Recipe::kW4A16}) {
    auto c = test::random_moe_case(352, 224, 8, 4, 160, 1, 0, 5);
    c.p.recipe = rec;
    cpu::MoeOptions o;
    o.threads = 2;
    auto got = run_fp32(c, o);
    ASSERT_FALSE(got.empty());
    c.p.out_dtype = OutDType::kFP32;
    expect_matches_oracle(c, got, recipe_name(rec));
  }
}

TEST(CpuMoe, PerExpertSituBetasAreUsed) {
  auto c = test::random_moe_case(64, 96, 6, 2, 9, 1, 0, 3);
  c.betas = {1.f, 2.f, 3.f, 4.f, 5.f, 6.f};
  c.lbetas = {5.f, 10.f, 15.f, 20.f, 25.f, 30.f};
  auto got = run_fp32(c, {});
  ASSERT_FALSE(got.empty());
  c.p.out_dtype = OutDType::kFP32;
  expect_matches_oracle(c, got, "per-expert betas");
  auto plain = c;
  plain.betas.clear();
  plain.lbetas.clear();
  EXPECT_NE(run_fp32(plain, {}), got);
}

TEST(CpuMoe, NarrowOutputsAreTheFp32SumRoundedOnce) {
  auto c = test::random_moe_case(96, 160, 5, 3, 13, 1, 0, 21);
  const auto f32 = run_fp32(c, {});
  ASSERT_FALSE(f32.empty());
  for (OutDType d : {OutDType::kBF16, OutDType::kFP16}) {
    c.p.out_dtype = d;
    auto r = test::run_cpu(c, {});
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    for (size_t i = 0; i < f32.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, &r.value()[i * 2], 2);
      const float v = static_cast<float>(f32[i]);
      ASSERT_EQ(h, d == OutDType::kBF16 ? bf16_from_f32(v) : fp16_from_f32(v)) << out_dtype_name(d) << " element " << i;
    }
  }
}

TEST(CpuMoe, BitIdenticalAcrossThreadsRunsChunksAndBatchComposition) {
  for (Recipe rec : {Recipe::kW4A8, Recipe::kW4A16}) {
    auto c = test::random_moe_case(96, 160, 5, 3, 60, 1, 0, 8);  // ~36 rows per expert: panel path
    c.p.recipe = rec;
    c.p.out_dtype = OutDType::kBF16;
    cpu::MoeOptions o;
    o.threads = 1;
    auto ref = test::run_cpu(c, o);
    ASSERT_TRUE(ref.is_ok());
    for (int threads : {1, 2, 3}) {
      o.threads = threads;
      for (int rep = 0; rep < 2; ++rep) {
        auto r = test::run_cpu(c, o);
        ASSERT_TRUE(r.is_ok());
        EXPECT_EQ(r.value(), ref.value()) << recipe_name(rec) << " threads " << threads << " run " << rep;
      }
    }
    // 8 passes of at most 8 tokens: about 24 rows over 5 experts, unevenly, each pass on the
    // decode route (one contiguous range of tasks per thread, split by rows).
    o.chunk_tokens = 8;
    for (int threads : {2, 3}) {
      o.threads = threads;
      auto chunked = test::run_cpu(c, o);
      ASSERT_TRUE(chunked.is_ok());
      EXPECT_EQ(chunked.value(), ref.value()) << "chunk_tokens 8, threads " << threads;
    }
    o.threads = 2;
    // Token 7 alone (its experts then have one row each: the direct path) gives the same bits.
    test::MoeCase one = c;
    one.m = 1;
    one.x.assign(c.x.begin() + 7 * 96, c.x.begin() + 8 * 96);
    one.ids.assign(c.ids.begin() + 7 * 3, c.ids.begin() + 8 * 3);
    one.wts.assign(c.wts.begin() + 7 * 3, c.wts.begin() + 8 * 3);
    auto alone = test::run_cpu(one, o);
    ASSERT_TRUE(alone.is_ok());
    EXPECT_TRUE(std::equal(alone->begin(), alone->end(), ref->begin() + 7 * 96 * 2)) << "token 7 alone";
  }
}

TEST(CpuMoe, ConcurrentCallsWithDistinctWorkspacesAgree) {
  // From std::threads and from inside a caller's OpenMP region (where omp_get_thread_num() of the
  // caller exceeds the plan's thread count).
  auto c = test::random_moe_case(96, 160, 5, 3, 9, 1, 0, 19);
  cpu::MoeOptions o;
  o.threads = 2;
  auto plan = cpu::plan(c.p, o);
  ASSERT_TRUE(plan.is_ok());
  auto packed = cpu::prepack(plan.value(), c.wv());
  ASSERT_TRUE(packed.is_ok());
  const size_t out_bytes = static_cast<size_t>(c.m * 96 * 2);
  auto one = [&](std::vector<uint8_t>& out) {
    std::vector<uint8_t> ws(static_cast<size_t>(plan->workspace_bytes));
    out.assign(out_bytes, 0);
    return cpu::run(plan.value(), packed.value(), c.iv(), ws, out);
  };
  std::vector<uint8_t> ref;
  ASSERT_TRUE(one(ref).is_ok());
  std::vector<std::vector<uint8_t>> outs(4);
  std::vector<Status> st(4);
  std::vector<std::thread> pool;
  for (int i = 0; i < 4; ++i) pool.emplace_back([&, i] { st[static_cast<size_t>(i)] = one(outs[static_cast<size_t>(i)]); });
  for (auto& t : pool) t.join();
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(st[static_cast<size_t>(i)].is_ok()) << st[static_cast<size_t>(i)].to_string();
    EXPECT_EQ(outs[static_cast<size_t>(i)], ref) << "std::thread " << i;
  }
  std::vector<std::vector<uint8_t>> omp_outs(3);
  std::vector<Status> omp_st(3);
#pragma omp parallel for num_threads(3)
  for (int i = 0; i < 3; ++i) omp_st[static_cast<size_t>(i)] = one(omp_outs[static_cast<size_t>(i)]);
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(omp_st[static_cast<size_t>(i)].is_ok());
    EXPECT_EQ(omp_outs[static_cast<size_t>(i)], ref) << "OpenMP thread " << i;
  }
}

TEST(CpuMoe, Fp32LevelsAreBitIdenticalAndBf16AgreesWithTheOracle) {
  // scalar, AVX2 and AVX-512 run the same FMA program: the same bits. The AVX512-BF16 level is
  // checked against the oracle by the tests above (VDPBF16PS's internal order is the CPU's).
  auto c = test::random_moe_case(96, 160, 10, 3, 11, 2, 0, 4);
  cpu::MoeOptions o;
  o.isa = IsaLevel::kScalar;
  const auto scalar = run_fp32(c, o);
  for (IsaLevel isa : supported_levels()) {
    if (isa == IsaLevel::kScalar || isa == IsaLevel::kAvx512Bf16) continue;
    o.isa = isa;
    EXPECT_EQ(run_fp32(c, o), scalar) << isa_level_name(isa);
  }
}

TEST(CpuMoe, RowsWithoutALocalSlotAreExactZeros) {
  auto c = test::random_moe_case(64, 96, 8, 3, 6, 2, 0, 9);  // local experts 0..3
  for (int s = 0; s < 3; ++s) {
    c.ids[0 * 3 + s] = -1;                  // token 0: all masked
    c.ids[1 * 3 + s] = 4 + s;               // token 1: all remote
    c.wts[1 * 3 + s] = std::nanf("");       // ... with NaN weights, which must not leak
  }
  c.ids[2 * 3 + 1] = -1;
  c.wts[2 * 3 + 1] = std::nanf("");         // a masked NaN weight next to local slots
  for (OutDType d : {OutDType::kBF16, OutDType::kFP32}) {
    c.p.out_dtype = d;
    auto r = test::run_cpu(c, {});
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    const size_t row = 64 * static_cast<size_t>(out_dtype_size(d));
    for (size_t i = 0; i < 2 * row; ++i) ASSERT_EQ(r.value()[i], 0) << out_dtype_name(d) << " byte " << i;
    const auto v = test::decode_output(r.value(), d);
    for (size_t i = 2 * 64; i < 3 * 64; ++i) ASSERT_TRUE(std::isfinite(v[i]));
  }
}

TEST(CpuMoe, NanInputPoisonsOnlyItsTokenLikeTheOracle) {
  for (Recipe rec : {Recipe::kW4A8, Recipe::kW4A16}) {
    auto c = test::random_moe_case(64, 96, 4, 2, 5, 1, 0, 12);
    c.p.recipe = rec;
    c.x[3 * 64 + 10] = 0x7FC0;  // NaN in token 3
    const auto got = run_fp32(c, {});
    c.p.out_dtype = OutDType::kFP32;
    const auto ref = test::contract_oracle(c);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(std::isnan(got[i]), std::isnan(ref[i])) << recipe_name(rec) << " element " << i;
      if (i / 64 != 3) {
        ASSERT_TRUE(std::isfinite(got[i]));
      }
    }
  }
}

TEST(CpuMoe, InfAndHugeInputsGiveTheOraclesNanInfClassOnEveryLevel) {
  // +-Inf and the largest finite BF16 in x: W4A8 dequantizes 256 * 2^120 to +Inf in FP32 (as the
  // contract's FP32 dequantization does); W4A16 keeps 3.39e38, whose products with E2M1 values
  // up to 6 must not overflow the block partial sums (rows are scaled, results are not).
  for (IsaLevel isa : supported_levels()) {
    for (Recipe rec : {Recipe::kW4A8, Recipe::kW4A16}) {
      for (ActivationKind act : {ActivationKind::kSiTU, ActivationKind::kSwiGLU, ActivationKind::kSiLU}) {
        auto c = test::random_moe_case(96, 160, 10, 3, 6, 1, 0, 77);
        for (auto& id : c.ids) id = id < 0 ? 9 : id;
        c.x[1 * 96 + 40] = 0x7F80;  // +Inf
        c.x[2 * 96 + 70] = 0xFF80;  // -Inf
        c.x[3 * 96 + 0] = 0x7F7F;   // 3.39e38
        c.x[4 * 96 + 9] = 0xFF7F;   // -3.39e38
        c.p.recipe = rec;
        c.p.activation.kind = act;
        cpu::MoeOptions o;
        o.isa = isa;
        const auto got = run_fp32(c, o);
        c.p.out_dtype = OutDType::kFP32;
        const auto ref = test::contract_oracle(c);
        ASSERT_EQ(got.size(), ref.size());
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_EQ(std::isnan(got[i]), std::isnan(ref[i]))
              << isa_level_name(isa) << " " << recipe_name(rec) << " " << activation_name(act) << " element " << i;
          ASSERT_EQ(std::isinf(got[i]), std::isinf(ref[i]))
              << isa_level_name(isa) << " " << recipe_name(rec) << " " << activation_name(act) << " element " << i;
        }
      }
    }
  }
}

// Sets element el of row `row` (reduction length red) of expert e's packed E2M1 matrix.
void set_e2m1(std::vector<uint8_t>& q, int64_t rows, int64_t red, int64_t e, int64_t row, int64_t el, uint8_t code) {
  uint8_t& b = q[static_cast<size_t>((e * rows + row) * (red / 2) + el / 2)];
  b = el % 2 ? static_cast<uint8_t>((b & 0x0F) | (code << 4)) : static_cast<uint8_t>((b & 0xF0) | code);
}

TEST(CpuMoe, OverflowingWeightBlocksGiveTheOraclesInfTimesZeroNan) {
  // E8M0 codes 253 / 254 under large E2M1 codes dequantize to +-Inf in FP32 (the contract): such
  // an element times a zero activation is NaN, times a nonzero one +-Inf, and +Inf + -Inf is NaN.
  // The kernels scale after the block sum, so run() must add these classes; before it did, the
  // zero-activation products vanished and the outputs stayed finite. Three placements, each in a
  // case of its own (an Inf in GEMM1 poisons the whole token downstream).
  const int64_t k = 64, n = 96;
  enum Where { kGate, kUp, kFc2 };
  for (Where where : {kGate, kUp, kFc2}) {
    for (IsaLevel isa : supported_levels()) {
      for (Recipe rec : {Recipe::kW4A8, Recipe::kW4A16}) {
        for (ActivationKind act : {ActivationKind::kSiTU, ActivationKind::kSwiGLU, ActivationKind::kSiLU}) {
          auto c = test::random_moe_case(k, n, 4, 2, 8, 1, 0, 91);
          for (auto& id : c.ids) id = id < 0 ? 1 : id;
          for (int64_t e = 0; e < 4; ++e) {
            if (where == kGate) {  // gate row 5, block 1: +6 * 2^127 (Inf) at element 3
              c.f1s[static_cast<size_t>((e * 2 * n + 5) * (k / 32) + 1)] = 254;
              set_e2m1(c.f1q, 2 * n, k, e, 5, 32 + 3, 0x7);
            } else if (where == kUp) {  // up row N + 40, block 0: +6 and -4 at 2^126 (both Inf)
              c.f1s[static_cast<size_t>((e * 2 * n + n + 40) * (k / 32))] = 253;
              set_e2m1(c.f1q, 2 * n, k, e, n + 40, 0, 0x7);
              set_e2m1(c.f1q, 2 * n, k, e, n + 40, 1, 0xE);
            } else {  // FC2 row 33, block 2: 2 * 2^127 (Inf) at element 7, the rest zero (the
                      // unscaled block sum times 2^127 stays finite for activations below 1)
              c.f2s[static_cast<size_t>((e * k + 33) * (n / 32) + 2)] = 254;
              for (int64_t el = 0; el < 32; ++el) set_e2m1(c.f2q, k, n, e, 33, 64 + el, el == 7 ? 0x4 : 0x0);
            }
          }
          if (where == kGate) {
            c.x[static_cast<size_t>(0 * k + 35)] = 0;       // token 0: Inf * 0
            c.x[static_cast<size_t>(5 * k + 35)] = 0x0001;  // token 5: Inf * a BF16 subnormal (W4A8: MXFP8 0)
          } else if (where == kUp) {
            c.x[static_cast<size_t>(2 * k + 1)] = 0;        // token 2: Inf * 0
            c.x[static_cast<size_t>(3 * k + 0)] = 0x3F80;   // token 3: +Inf and -Inf products
            c.x[static_cast<size_t>(3 * k + 1)] = 0x3F80;
            c.x[static_cast<size_t>(4 * k + 0)] = 0x3F80;   // token 4: two +Inf products
            c.x[static_cast<size_t>(4 * k + 1)] = 0xBF80;
          }
          c.p.recipe = rec;
          c.p.activation.kind = act;
          cpu::MoeOptions o;
          o.isa = isa;
          const std::string what = std::string(where == kGate ? "gate" : where == kUp ? "up" : "fc2") + " " +
                                   isa_level_name(isa) + " " + recipe_name(rec) + " " + activation_name(act);
          const auto got = run_fp32(c, o);
          ASSERT_FALSE(got.empty()) << what;
          c.p.out_dtype = OutDType::kFP32;
          const auto ref = test::contract_oracle(c);
          ASSERT_EQ(got.size(), ref.size());
          int64_t nonfinite = 0;
          for (size_t i = 0; i < got.size(); ++i) {
            nonfinite += std::isfinite(ref[i]) ? 0 : 1;
            ASSERT_EQ(std::isnan(got[i]), std::isnan(ref[i])) << what << " element " << i;
            ASSERT_EQ(std::isinf(got[i]), std::isinf(ref[i])) << what << " element " << i;
            if (std::isinf(ref[i])) {
              ASSERT_EQ(std::signbit(got[i]), std::signbit(ref[i])) << what << " element " << i;
            }
          }
          EXPECT_GT(nonfinite, 0) << what << ": the case must reach a nonfinite oracle output";
        }
      }
    }
  }
}

TEST(CpuMoe, PrepackListsExactlyTheOverflowingBlocks) {
  const int64_t k = 64, n = 96;
  auto c = test::random_moe_case(k, n, 4, 2, 1, 2, 1, 92);  // EP2 rank 1: 2 local experts
  c.f1s[static_cast<size_t>((1 * 2 * n + n + 40) * (k / 32))] = 253;  // expert 1, up row 40, block 0
  set_e2m1(c.f1q, 2 * n, k, 1, n + 40, 0, 0x7);                       // 6 * 2^126: Inf
  set_e2m1(c.f1q, 2 * n, k, 1, n + 40, 1, 0xE);                       // -4 * 2^126: -Inf
  set_e2m1(c.f1q, 2 * n, k, 1, n + 40, 2, 0x5);                       // 3 * 2^126: finite
  for (int64_t el = 3; el < 32; ++el) set_e2m1(c.f1q, 2 * n, k, 1, n + 40, el, 0x1);
  c.f2s[static_cast<size_t>((0 * k + 33) * (n / 32) + 2)] = 254;  // expert 0, row 33, block 2
  for (int64_t el = 0; el < 32; ++el) set_e2m1(c.f2q, k, n, 0, 33, 64 + el, el == 9 ? 0xC : 0x3);  // -2: -Inf
  c.f2s[static_cast<size_t>((0 * k + 34) * (n / 32))] = 254;  // 1.5 * 2^127 at most: finite, not listed
  for (int64_t el = 0; el < 32; ++el) set_e2m1(c.f2q, k, n, 0, 34, el, 0x3);
  auto plan = cpu::plan(c.p, {});
  ASSERT_TRUE(plan.is_ok());
  auto w = cpu::prepack(plan.value(), c.wv());
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  int64_t listed = 0;
  for (int m = 1; m <= 2; ++m) {
    for (int64_t e = 0; e < 2; ++e) {
      for (int64_t j = 0; j < (m == 1 ? n : k) / 32; ++j) listed += static_cast<int64_t>(w->inf_blocks(m, e, j).size());
    }
  }
  EXPECT_EQ(listed, 2);
  const auto a = w->inf_blocks(1, 1, 1);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(a[0].block, 0);
  EXPECT_EQ(a[0].column, 32 + 8);
  EXPECT_EQ(a[0].inf_mask, 0x3u);
  EXPECT_EQ(a[0].neg_mask, 0x2u);
  const auto b = w->inf_blocks(2, 0, 1);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(b[0].block, 2);
  EXPECT_EQ(b[0].column, 1);
  EXPECT_EQ(b[0].inf_mask, 1u << 9);
  EXPECT_EQ(b[0].neg_mask, 1u << 9);
}

TEST(CpuMoe, ExtremeButValidScalesAreExact) {
  // Weight scale codes far from 127 (exact FP32 factors), W4A8 activations with MXFP8 scale codes
  // below 10 (their BF16 dequantization would be subnormal), and W4A16 rows with BF16 subnormals:
  // every level must still agree with the oracle.
  for (Recipe rec : {Recipe::kW4A8, Recipe::kW4A16}) {
    auto c = test::random_moe_case(64, 96, 4, 2, 6, 1, 0, 13);
    c.p.recipe = rec;
    for (size_t i = 0; i < c.f1s.size(); i += 7) c.f1s[i] = static_cast<uint8_t>(c.f1s[i] + 40);
    for (size_t i = 3; i < c.f1s.size(); i += 7) c.f1s[i] = static_cast<uint8_t>(c.f1s[i] - 40);
    for (int64_t i = 0; i < 64; ++i) {  // token 1: magnitudes around 2^-124 (W4A16: some subnormal)
      c.x[64 + i] = bf16_from_f32(std::ldexp(bf16_to_f32(c.x[64 + i]), -124));
    }
    for (IsaLevel isa : supported_levels()) {
      cpu::MoeOptions o;
      o.isa = isa;
      auto got = run_fp32(c, o);
      ASSERT_FALSE(got.empty());
      auto cc = c;
      cc.p.out_dtype = OutDType::kFP32;
      expect_matches_oracle(cc, got, std::string(recipe_name(rec)) + " " + isa_level_name(isa));
    }
  }
}

TEST(CpuMoe, RowBeyondTheBf16RangeIsReportedOnTheBf16Level) {
  auto c = test::random_moe_case(64, 96, 4, 2, 3, 1, 0, 14);
  c.p.recipe = Recipe::kW4A16;
  c.x[2 * 64 + 0] = 0x0001;  // 2^-133 (BF16 subnormal)
  c.x[2 * 64 + 1] = 0x7E80;  // 2^126
  if (best_isa_level() == IsaLevel::kAvx512Bf16) {
    cpu::MoeOptions o;
    o.isa = IsaLevel::kAvx512Bf16;
    auto r = test::run_cpu(c, o);
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInexact);
    EXPECT_NE(r.status().message().find("x row of token 2"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("K3_ISA=avx512"), std::string::npos) << r.status().message();
  }
  cpu::MoeOptions o;
  o.isa = IsaLevel::kScalar;
  auto r = test::run_cpu(c, o);  // FP32 operands: fine
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
}

TEST(CpuMoe, EmptyBatchAndRunReuse) {
  auto c = test::random_moe_case(64, 96, 4, 2, 0, 1, 0, 15);
  auto r = test::run_cpu(c, {});
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_TRUE(r->empty());
}

TEST(CpuMoe, PlanErrorsNameTheLimit) {
  MoeProblem p;
  p.shape = {96, 160, 5, 3, 1, 0};
  auto bad = [&](MoeProblem q, cpu::MoeOptions o, const std::string& needle) {
    auto r = cpu::plan(q, o);
    ASSERT_FALSE(r.is_ok()) << needle;
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  MoeProblem q = p;
  q.shape.hidden = 100;
  bad(q, {}, "hidden (K) = 100 must be a positive multiple of 32");
  q = p;
  q.shape.intermediate = 40;
  bad(q, {}, "intermediate (N) = 40 must be a positive multiple of 32");
  q = p;
  q.shape.top_k = 6;
  bad(q, {}, "top_k = 6");
  q = p;
  q.activation.situ_beta = 0.f;
  bad(q, {}, "situ_beta = 0");
  cpu::MoeOptions o;
  o.threads = -1;
  bad(p, o, "threads = -1");
  o = {};
  o.max_tokens = 0;
  bad(p, o, "max_tokens = 0");
  o = {};
  o.chunk_tokens = 4;
  bad(p, o, "chunk_tokens = 4 must be in [8, 4096]");
  if (best_isa_level() != IsaLevel::kAvx512Bf16) {
    o = {};
    o.isa = IsaLevel::kAvx512Bf16;
    bad(p, o, "is not supported by this CPU");
  }
  auto ok = cpu::plan(p, {});
  ASSERT_TRUE(ok.is_ok());
  EXPECT_NE(ok->describe().find("K 96 N 160"), std::string::npos) << ok->describe();
  EXPECT_GT(ok->workspace_bytes, 0);
}

// The library reads no environment: K3_ISA and K3_NUM_THREADS are the `k3` tool's, passed in
// explicitly; plan()'s defaults are hardware facts.
TEST(CpuMoe, PlanDefaultsAreHardwareFactsNotTheEnvironment) {
  MoeProblem p;
  p.shape = {64, 64, 4, 2, 1, 0};
  test::ScopedEnv isa("K3_ISA", "scalar");
  test::ScopedEnv k3_threads("K3_NUM_THREADS", "3");
  test::ScopedEnv omp_threads("OMP_NUM_THREADS", "5");
  auto r = cpu::plan(p, {});
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->isa, best_isa_level());
  EXPECT_EQ(r->threads, std::min(hardware_thread_count(), cpu::kMaxThreads));
  EXPECT_EQ(default_thread_count(), 3);  // the tools' helper still reads it
  test::ScopedEnv bad("K3_ISA", "sse9");  // not even a level: still not read
  r = cpu::plan(p, {});
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  cpu::MoeOptions o;  // what the tool passes: the explicit values win
  o.isa = IsaLevel::kScalar;
  o.threads = 3;
  r = cpu::plan(p, o);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->isa, IsaLevel::kScalar);
  EXPECT_EQ(r->threads, 3);
}

TEST(CpuMoe, PrepackErrorsNameTheBlock) {
  auto c = test::random_moe_case(64, 96, 4, 2, 1, 1, 0, 16);
  auto plan = cpu::plan(c.p, {});
  ASSERT_TRUE(plan.is_ok());
  auto expect_err = [&](const test::MoeCase& cc, const std::string& needle) {
    auto r = cpu::prepack(plan.value(), cc.wv());
    ASSERT_FALSE(r.is_ok()) << needle;
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  auto cc = c;
  cc.f1q.pop_back();
  expect_err(cc, "fc1_q [E_local, 2N, K/2] has");
  cc = c;
  cc.f2s.push_back(0);
  expect_err(cc, "fc2_scale [E_local, K, N/32] has");
  cc = c;
  cc.f1s[(2 * 192 + 100) * 2 + 1] = 0xFF;  // expert 2, row 100, block 1
  expect_err(cc, "fc1 local expert 2 row 100 block 1: E8M0 scale code 255 (NaN)");
  cc = c;
  cc.f2s[(1 * 64 + 5) * 3 + 2] = 0;        // expert 1, row 5, block 2, nonzero codes (random)
  cc.f2q[(1 * 64 + 5) * 48 + 2 * 16] = 0x11;
  expect_err(cc, "fc2 local expert 1 row 5 block 2: E8M0 scale code 0 (2^-127) with nonzero elements");
  cc = c;
  cc.betas = {4.f, 4.f, -1.f, 4.f};
  expect_err(cc, "local expert 2: situ_beta = -1");
  cc = c;
  cc.lbetas = {1.f};
  expect_err(cc, "situ_linear_beta [E_local] has 1 elements, expected 4");
  // A zero block with scale code 0 is exact (zero) and accepted.
  cc = c;
  for (int i = 0; i < 16; ++i) cc.f1q[static_cast<size_t>(i)] = 0;
  cc.f1s[0] = 0;
  EXPECT_TRUE(cpu::prepack(plan.value(), cc.wv()).is_ok());
}

TEST(CpuMoe, RunErrorsNameTheArgument) {
  auto c = test::random_moe_case(64, 96, 4, 2, 5, 1, 0, 17);
  cpu::MoeOptions o;
  o.max_tokens = 4;
  auto plan = cpu::plan(c.p, o);
  ASSERT_TRUE(plan.is_ok());
  auto packed = cpu::prepack(plan.value(), c.wv());
  ASSERT_TRUE(packed.is_ok());
  std::vector<uint8_t> ws(static_cast<size_t>(plan->workspace_bytes)), out(5 * 64 * 2);
  auto expect_err = [&](const MoeInputsView& in, std::span<uint8_t> w, std::span<uint8_t> o2, const std::string& needle) {
    const Status st = cpu::run(plan.value(), packed.value(), in, w, o2);
    ASSERT_FALSE(st.is_ok()) << needle;
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
  };
  expect_err(c.iv(), ws, out, "m = 5 must be in [0, plan.max_tokens = 4]");
  auto c4 = c;
  c4.m = 4;
  c4.x.resize(4 * 64);
  c4.ids.resize(8);
  c4.wts.resize(8);
  expect_err(c4.iv(), ws, out, "out has 640 bytes, expected M*K*2 = 512");
  std::span<uint8_t> out4(out.data(), 512);
  expect_err(c4.iv(), std::span<uint8_t>(ws.data(), ws.size() - 1), out4, "workspace has");
  auto bad_ids = c4;
  bad_ids.ids[5] = 4;
  expect_err(bad_ids.iv(), ws, out4, "topk_ids[2, 1] = 4 must be -1 (masked) or a global expert id in [0, 4)");
  auto short_x = c4;
  short_x.x.pop_back();
  expect_err(short_x.iv(), ws, out4, "x has 255 elements (expected M*K = 256)");
  auto other = test::random_moe_case(96, 96, 4, 2, 1, 1, 0, 18);
  auto other_plan = cpu::plan(other.p, {});
  ASSERT_TRUE(other_plan.is_ok());
  auto other_packed = cpu::prepack(other_plan.value(), other.wv());
  ASSERT_TRUE(other_packed.is_ok());
  const Status st = cpu::run(plan.value(), other_packed.value(), c4.iv(), ws, out4);
  EXPECT_NE(st.message().find("weights were prepacked for a different shape"), std::string::npos) << st.message();
  EXPECT_TRUE(cpu::run(plan.value(), packed.value(), c4.iv(), ws, out4).is_ok());
}

}  // namespace
}  // namespace k3
