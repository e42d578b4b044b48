#include <gtest/gtest.h>

#include <vector>

#include "k3/moe.hpp"

namespace k3 {
namespace {

TEST(MoeShape, KimiDefaultsAreValidAndLimitsAreNamed) {
  MoeShape s;
  EXPECT_TRUE(validate_moe_shape(s).is_ok());
  s.ep_size = 32;
  s.ep_rank = 7;
  EXPECT_TRUE(validate_moe_shape(s).is_ok());
  EXPECT_EQ(s.local_experts(), 28);
  EXPECT_EQ(s.first_local_expert(), 196);

  auto expect_error = [](MoeShape bad, const std::string& needle) {
    const Status st = validate_moe_shape(bad);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
  };
  MoeShape b;
  b.hidden = 100;
  expect_error(b, "hidden (K) = 100");
  b = {};
  b.intermediate = 0;
  expect_error(b, "intermediate (N) = 0");
  b = {};
  b.num_experts = 5000;
  expect_error(b, "num_experts = 5000 must be in [1, 4096]");
  b = {};
  b.top_k = 33;
  expect_error(b, "top_k = 33");
  b = {};
  b.num_experts = 5;
  b.top_k = 6;
  expect_error(b, "top_k = 6");
  b = {};
  b.ep_size = 897;
  expect_error(b, "ep_size = 897 must be in [1, num_experts = 896]");
  b = {};
  b.ep_size = 0;
  expect_error(b, "ep_size = 0 must be in [1, num_experts = 896]");
  b = {};
  b.ep_size = 3;  // uneven partitions are valid
  b.ep_rank = 2;
  EXPECT_TRUE(validate_moe_shape(b).is_ok());
  b.ep_rank = 3;
  expect_error(b, "ep_rank = 3 must be in [0, ep_size = 3)");
  b = {};
  b.ep_rank = 1;
  expect_error(b, "ep_rank = 1 must be in [0, ep_size = 1)");
}

// The partition rule (docs/distributed.md, "Expert partition"), checked against its definition
// for every W of every E up to 260 and for Kimi-K3's 896: the ranges tile [0, E) in rank order,
// the first E mod W ranks hold E / W + 1 experts and the others E / W, and expert_owner inverts it.
TEST(ExpertPartition, BalancedContiguousRangesTileTheExpertsForEveryWorldSize) {
  std::vector<int> sizes;
  for (int e = 1; e <= 260; ++e) sizes.push_back(e);
  sizes.push_back(896);
  for (const int e : sizes) {
    for (int w = 1; w <= e; ++w) {
      int next = 0;
      for (int r = 0; r < w; ++r) {
        const ExpertRange g = expert_range(e, w, r);
        ASSERT_EQ(g.first, next) << "E " << e << " W " << w << " rank " << r;
        ASSERT_EQ(g.count, e / w + (r < e % w ? 1 : 0)) << "E " << e << " W " << w << " rank " << r;
        ASSERT_GE(g.count, 1);
        for (int x = g.first; x < g.first + g.count; ++x) ASSERT_EQ(expert_owner(e, w, x), r) << "E " << e << " W " << w;
        MoeShape s;
        s.num_experts = e;
        s.top_k = 1;
        s.ep_size = w;
        s.ep_rank = r;
        ASSERT_TRUE(validate_moe_shape(s).is_ok());
        ASSERT_EQ(s.local_experts(), g.count);
        ASSERT_EQ(s.first_local_expert(), g.first);
        next += g.count;
      }
      ASSERT_EQ(next, e) << "E " << e << " W " << w;
    }
  }
  // Kimi-K3 on nine ranks: 896 = 9 * 99 + 5, so ranks 0-4 hold 100 experts and ranks 5-8 hold 99.
  EXPECT_EQ(expert_range(896, 9, 4).count, 100);
  EXPECT_EQ(expert_range(896, 9, 4).first, 400);
  EXPECT_EQ(expert_range(896, 9, 5).count, 99);
  EXPECT_EQ(expert_range(896, 9, 5).first, 500);
  EXPECT_EQ(expert_range(896, 9, 8).first, 797);
  EXPECT_EQ(expert_owner(896, 9, 499), 4);
  EXPECT_EQ(expert_owner(896, 9, 500), 5);
  EXPECT_EQ(expert_owner(896, 9, 895), 8);
}

TEST(MoeBuffers, SizesAndIdsAreChecked) {
  MoeProblem p;
  p.shape.hidden = 64;
  p.shape.intermediate = 32;
  p.shape.num_experts = 4;
  p.shape.top_k = 2;
  const int64_t e = 4, k = 64, n = 32, m = 3;
  std::vector<uint8_t> f1(e * 2 * n * k / 2), s1(e * 2 * n * k / 32), f2(e * k * n / 2), s2(e * k * n / 32);
  std::vector<uint16_t> x(m * k);
  std::vector<int32_t> ids(m * 2, 0);
  std::vector<float> w(m * 2, 0.5f);
  MoeWeightsView wv{f1, s1, f2, s2, {}, {}};
  MoeInputsView in{m, x, ids, w};
  EXPECT_TRUE(validate_moe_buffers(p, wv, in).is_ok());
  ids[3] = 4;
  Status st = validate_moe_buffers(p, wv, in);
  EXPECT_NE(st.message().find("topk_ids[1, 1] = 4"), std::string::npos) << st.message();
  ids[3] = -1;
  EXPECT_TRUE(validate_moe_buffers(p, wv, in).is_ok());
  ids[3] = -2;
  EXPECT_FALSE(validate_moe_buffers(p, wv, in).is_ok());
  ids[3] = 0;
  wv.fc2_scale = std::span<const uint8_t>(s2).first(3);
  st = validate_moe_buffers(p, wv, in);
  EXPECT_NE(st.message().find("fc2_scale [E_local, K, N/32] has 3 elements, expected 256"), std::string::npos)
      << st.message();
}

TEST(MoeNames, ParseRoundTripsAndRejectsUnknown) {
  for (Recipe r : {Recipe::kW4A8, Recipe::kW4A16}) EXPECT_EQ(parse_recipe(recipe_name(r)).value(), r);
  for (auto a : {ActivationKind::kSiTU, ActivationKind::kSwiGLU, ActivationKind::kSiLU}) {
    EXPECT_EQ(parse_activation(activation_name(a)).value(), a);
  }
  for (auto d : {OutDType::kBF16, OutDType::kFP16, OutDType::kFP32}) EXPECT_EQ(parse_out_dtype(out_dtype_name(d)).value(), d);
  EXPECT_NE(parse_recipe("w4a4").status().message().find("'w4a4' is unknown"), std::string::npos);
  EXPECT_FALSE(parse_activation("gelu").is_ok());
  EXPECT_FALSE(parse_out_dtype("int8").is_ok());
}

}  // namespace
}  // namespace k3
