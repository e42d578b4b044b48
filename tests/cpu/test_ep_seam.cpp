// The expert-parallel seam of the CPU backend: run() == run_experts() + finalize(), bit for bit,
// on every EP rank of a layer; and the one-process expert-parallel run (self communicator).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "ep_test_util.hpp"
#include "k3/ep.hpp"
#include "k3/formats.hpp"
#include "k3/mx.hpp"
#include "k3/system.hpp"

namespace {

using k3test::EpRouting;
using k3test::EpTokens;

// The slot pointers of run_experts' y for the given ids (nullptr for slots of other ranks).
std::vector<const float*> slot_pointers(const k3::MoeShape& s, std::span<const int32_t> ids, const std::vector<float>& y) {
  std::vector<const float*> p(ids.size(), nullptr);
  const int lo = s.first_local_expert(), hi = lo + s.local_experts();
  const float* at = y.data();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= lo && ids[i] < hi) {
      p[i] = at;
      at += s.hidden;
    }
  }
  return p;
}

TEST(EpSeam, RunExpertsPlusFinalizeGivesRunsBitsOnEveryRank) {
  for (const auto recipe : {k3::Recipe::kW4A8, k3::Recipe::kW4A16}) {
    for (const auto isa : {k3::IsaLevel::kScalar, k3::best_isa_level()}) {
      const auto full = k3test::make_ep_full_case(recipe, k3::OutDType::kBF16, k3::RoutingPattern::kMasked, 21, 1,
                                                  EpTokens::kUneven, EpRouting::kFromCase, 11);
      for (const int world : {1, 4}) {
        for (int rank = 0; rank < world; ++rank) {
          k3::MoeProblem prob = full.c.problem;
          prob.shape.ep_size = world;
          prob.shape.ep_rank = rank;
          auto plan = k3::cpu::plan(prob, {.threads = 2, .isa = isa, .max_tokens = 64, .chunk_tokens = 8});
          ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
          auto packed = k3::cpu::prepack(*plan, k3test::slice_experts(full.c, world, rank));
          ASSERT_TRUE(packed.is_ok());
          std::vector<uint8_t> ws(static_cast<size_t>(plan->workspace_bytes));
          const auto in = full.c.inputs();
          std::vector<uint8_t> want(static_cast<size_t>(in.m * 64 * 2)), got(want.size(), 0xCD);
          ASSERT_TRUE(k3::cpu::run(*plan, *packed, in, ws, want).is_ok());
          const int64_t slots = k3::cpu::local_slot_count(prob.shape, in.topk_ids);
          std::vector<float> y(static_cast<size_t>(slots * 64));
          ASSERT_TRUE(k3::cpu::run_experts(*plan, *packed, {in.m, in.x, in.topk_ids, {}}, ws, y).is_ok());
          const auto ptrs = slot_pointers(prob.shape, in.topk_ids, y);
          std::vector<float> scratch(64);
          ASSERT_TRUE(k3::cpu::finalize(*plan, in.m, in.topk_weights, ptrs, scratch, got).is_ok());
          EXPECT_EQ(want, got) << k3::recipe_name(recipe) << " " << k3::isa_level_name(isa) << " rank " << rank << "/" << world;
        }
      }
    }
  }
}

TEST(EpSeam, SelfCommunicatorRunEqualsTheFusedRun) {
  const auto full = k3test::make_ep_full_case(k3::Recipe::kW4A8, k3::OutDType::kFP32, k3::RoutingPattern::kUniform, 13, 1,
                                              EpTokens::kUneven, EpRouting::kFromCase, 5);
  auto want = k3test::run_full_layer(full.c, {.threads = 1, .isa = {}});
  ASSERT_TRUE(want.is_ok());
  auto layer = k3test::prepare_cpu(full.c.problem, full.c.weights(), 1);
  ASSERT_TRUE(layer.is_ok()) << layer.status().to_string();
  std::vector<uint8_t> ws(static_cast<size_t>((*layer)->workspace_bytes())), got(want->size());
  auto self = k3::comm::make_self_communicator();
  k3::comm::EpRunStats st;
  ASSERT_TRUE(k3::comm::ep_moe_run(*self, **layer, full.c.inputs(), ws, got, &st).is_ok());
  EXPECT_EQ(*want, got);
  EXPECT_EQ(st.rows_received, 13);
  EXPECT_EQ(st.slots_computed, 13 * 4);
}

TEST(EpSeam, QuantizeXIsTheHostMxCodecBitForBit) {
  // cpu::quantize_x_mxfp8 decides the scale on FP32 bits (so it vectorizes); it must agree with
  // mx_quantize_block (k3/mx.hpp) on every block: normals, huge, E4M3-subnormal, Inf, NaN, zero.
  k3::MoeProblem p;
  p.shape = {64, 32, 4, 2, 1, 0};
  p.recipe = k3::Recipe::kW4A8;
  const int64_t m = 24, k = 64;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> x(static_cast<size_t>(m * k));
  for (int64_t r = 0; r < m; ++r) {
    const int exp_shift = static_cast<int>(r % 8) * 20 - 70;  // 2^-70 .. 2^70
    for (int64_t c = 0; c < k; ++c) x[r * k + c] = k3::bf16_from_f32(std::ldexp(nd(rng), exp_shift));
  }
  x[3 * k + 5] = 0x7FC0;        // NaN
  x[5 * k + 40] = 0xFF80;       // -Inf
  x[7 * k + 1] = 0x7F80;        // +Inf
  for (int64_t c = 0; c < 32; ++c) x[9 * k + c] = 0;  // a zero block
  std::vector<uint8_t> want_codes(x.size()), want_scales(x.size() / 32);
  for (size_t b = 0; b < want_scales.size(); ++b) {
    float v[32];
    for (int i = 0; i < 32; ++i) v[i] = k3::bf16_to_f32(x[b * 32 + i]);
    want_scales[b] = k3::mx_quantize_block(v, k3::MxElement::kE4M3, k3::ScaleRule::kRceil, &want_codes[b * 32]);
  }
  for (int l = 0; l <= static_cast<int>(k3::best_isa_level()); ++l) {
    const auto isa = static_cast<k3::IsaLevel>(l);
    auto plan = k3::cpu::plan(p, {.threads = 1, .isa = isa});
    ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
    std::vector<uint8_t> codes(x.size(), 0xAB), scales(x.size() / 32, 0xAB);
    ASSERT_TRUE(k3::cpu::quantize_x_mxfp8(*plan, x, codes, scales).is_ok());
    EXPECT_EQ(scales, want_scales) << k3::isa_level_name(isa);
    EXPECT_EQ(codes, want_codes) << k3::isa_level_name(isa);
  }
}

TEST(EpSeam, PreQuantizedW4A8RowsGiveTheSameBitsAsQuantizingInside) {
  const auto full = k3test::make_ep_full_case(k3::Recipe::kW4A8, k3::OutDType::kBF16, k3::RoutingPattern::kUniform, 9, 1,
                                              EpTokens::kUneven, EpRouting::kFromCase, 8);
  for (const auto isa : {k3::IsaLevel::kScalar, k3::best_isa_level()}) {
    auto plan = k3::cpu::plan(full.c.problem, {.threads = 1, .isa = isa});
    auto packed = k3::cpu::prepack(*plan, full.c.weights());
    std::vector<uint8_t> ws(static_cast<size_t>(plan->workspace_bytes));
    const auto in = full.c.inputs();
    std::vector<float> want(static_cast<size_t>(9 * 4 * 64)), got(want.size(), -1.f);
    ASSERT_TRUE(k3::cpu::run_experts(*plan, *packed, in, ws, want).is_ok());
    std::vector<uint8_t> codes(9 * 64), scales(9 * 2);
    ASSERT_TRUE(k3::cpu::quantize_x_mxfp8(*plan, in.x, codes, scales).is_ok());
    ASSERT_TRUE(k3::cpu::run_experts(*plan, *packed, {in.m, {}, in.topk_ids, {}}, ws, got, {codes, scales}).is_ok());
    EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * 4)) << k3::isa_level_name(isa);
    // Misuse is refused: both x and codes, wrong sizes, a W4A16 plan.
    auto st = k3::cpu::run_experts(*plan, *packed, in, ws, got, {codes, scales});
    EXPECT_NE(st.message().find("inputs.x must be empty"), std::string::npos) << st.message();
    st = k3::cpu::run_experts(*plan, *packed, {in.m, {}, in.topk_ids, {}}, ws, got,
                              {std::span<const uint8_t>(codes.data(), 10), scales});
    EXPECT_NE(st.message().find("codes has 10 bytes and scales 18, expected M*K = 576 and M*K/32 = 18"), std::string::npos)
        << st.message();
  }
  k3::MoeProblem a16 = full.c.problem;
  a16.recipe = k3::Recipe::kW4A16;
  auto plan16 = k3::cpu::plan(a16, {.threads = 1, .isa = {}});
  auto packed16 = k3::cpu::prepack(*plan16, full.c.weights());
  std::vector<uint8_t> ws(static_cast<size_t>(plan16->workspace_bytes)), codes(9 * 64), scales(18);
  std::vector<float> y(static_cast<size_t>(9 * 4 * 64));
  const auto st = k3::cpu::run_experts(*plan16, *packed16, {9, {}, full.c.topk_ids, {}}, ws, y, {codes, scales});
  EXPECT_NE(st.message().find("the plan's recipe is w4a16"), std::string::npos) << st.message();
}

TEST(EpSeam, WrongSizesAreRefusedNamingTheArgument) {
  const auto full = k3test::make_ep_full_case(k3::Recipe::kW4A16, k3::OutDType::kBF16, k3::RoutingPattern::kUniform, 3, 1,
                                              EpTokens::kUneven, EpRouting::kFromCase, 2);
  auto plan = k3::cpu::plan(full.c.problem, {.threads = 1, .isa = {}});
  auto packed = k3::cpu::prepack(*plan, full.c.weights());
  std::vector<uint8_t> ws(static_cast<size_t>(plan->workspace_bytes));
  std::vector<float> y(5);
  auto st = k3::cpu::run_experts(*plan, *packed, full.c.inputs(), ws, y);
  EXPECT_NE(st.message().find("y has 5 floats, expected local slots * K = 12 * 64"), std::string::npos) << st.message();
  std::vector<const float*> ptrs(12, nullptr);
  std::vector<float> scratch(64);
  std::vector<uint8_t> out(3 * 64 * 2);
  st = k3::cpu::finalize(*plan, 3, full.c.topk_weights, std::span<const float* const>(ptrs.data(), 11), scratch, out);
  EXPECT_NE(st.message().find("slot_y 11 entries, expected M*top_k = 12"), std::string::npos) << st.message();
  st = k3::cpu::finalize(*plan, 3, full.c.topk_weights, ptrs, std::span<float>(scratch.data(), 10), out);
  EXPECT_NE(st.message().find("scratch has 10 floats, needs K = 64"), std::string::npos) << st.message();
  st = k3::cpu::finalize(*plan, 3, full.c.topk_weights, ptrs, scratch, std::span<uint8_t>(out.data(), 7));
  EXPECT_NE(st.message().find("out has 7 bytes, expected M*K*2 = 384"), std::string::npos) << st.message();
  // All slots absent: exact zeros.
  ASSERT_TRUE(k3::cpu::finalize(*plan, 3, full.c.topk_weights, ptrs, scratch, out).is_ok());
  EXPECT_EQ(out, std::vector<uint8_t>(out.size(), 0));

  auto self = k3::comm::make_self_communicator();
  k3::MoeProblem wrong = full.c.problem;
  wrong.shape.ep_size = 2;
  auto d = k3::comm::ep_dispatch(*self, wrong, full.c.inputs());
  ASSERT_FALSE(d.is_ok());
  EXPECT_NE(d.status().message().find("rank 0 of 1: shape.ep_size = 2, ep_rank = 0 must be the communicator's size 1"),
            std::string::npos) << d.status().message();
  std::vector<uint8_t> small(10);
  auto layer = k3test::prepare_cpu(full.c.problem, full.c.weights(), 1);
  ASSERT_TRUE(layer.is_ok()) << layer.status().to_string();
  st = k3::comm::ep_moe_run(*self, **layer, full.c.inputs(), ws, small);
  EXPECT_NE(st.message().find("ep_combine: out has 10 bytes"), std::string::npos) << st.message();
}

// The driver takes any backend's prepared layer; one without the seam is refused by name before
// any data moves (the reference computes in FP64 and has no FP32 expert outputs).
TEST(EpSeam, ABackendWithoutTheSeamIsRefusedByName) {
  const auto full = k3test::make_ep_full_case(k3::Recipe::kW4A16, k3::OutDType::kBF16, k3::RoutingPattern::kUniform, 3, 1,
                                              EpTokens::kUneven, EpRouting::kFromCase, 5);
  auto ref = k3::find_moe_backend("reference");
  ASSERT_TRUE(ref.is_ok());
  auto layer = k3::prepare_moe(**ref, full.c.problem, full.c.weights());
  ASSERT_TRUE(layer.is_ok()) << layer.status().to_string();
  EXPECT_EQ((*layer)->expert_parallel().code(), k3::StatusCode::kUnsupported);
  auto self = k3::comm::make_self_communicator();
  std::vector<uint8_t> out(static_cast<size_t>(3 * full.c.problem.shape.hidden * 2));
  const k3::Status st = k3::comm::ep_moe_run(*self, **layer, full.c.inputs(), {}, out);
  EXPECT_EQ(st.code(), k3::StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("the moe backend 'reference' has no expert-parallel entry points"), std::string::npos)
      << st.message();
  std::vector<float> y(static_cast<size_t>(3 * 4 * full.c.problem.shape.hidden));
  EXPECT_EQ((*layer)->run_experts(full.c.inputs(), {}, y).code(), k3::StatusCode::kUnsupported);
}

}  // namespace
