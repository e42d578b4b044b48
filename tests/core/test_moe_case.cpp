// Seeded MoE problems (k3/harness/moe_case.hpp): the routing patterns do what they say, EP ranks slice the
// EP1 problem, and the generator is deterministic across thread counts.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "k3/harness/moe_case.hpp"

namespace k3 {
namespace {

MoeCaseSpec spec(RoutingPattern r, int ep_size = 1, int ep_rank = 0) {
  MoeCaseSpec s;
  s.problem.shape = {96, 64, 12, 4, ep_size, ep_rank};
  s.m = 40;
  s.routing = r;
  s.seed = 9;
  return s;
}

TEST(MoeCase, BuffersMatchTheProblemAndRowsAreDistinctAndNormalized) {
  for (RoutingPattern r : {RoutingPattern::kUniform, RoutingPattern::kSkewed, RoutingPattern::kEmptyExpert}) {
    auto c = make_moe_case(spec(r));
    ASSERT_TRUE(c.is_ok()) << c.status().to_string();
    EXPECT_TRUE(validate_moe_buffers(c->problem, c->weights(), c->inputs()).is_ok());
    for (int64_t t = 0; t < 40; ++t) {
      std::vector<int32_t> row(c->topk_ids.begin() + t * 4, c->topk_ids.begin() + t * 4 + 4);
      std::sort(row.begin(), row.end());
      EXPECT_EQ(std::adjacent_find(row.begin(), row.end()), row.end()) << routing_pattern_name(r);
      double sum = 0;
      for (int s = 0; s < 4; ++s) sum += c->topk_weights[t * 4 + s];
      EXPECT_NEAR(sum, 1.0, 1e-6);
    }
  }
}

TEST(MoeCase, RoutingPatterns) {
  // ep_mixed: exactly 3 local slots (EP3 rank 1: experts 4..7) per token.
  MoeCaseSpec s = spec(RoutingPattern::kEpMixed, 3, 1);
  s.local_slots = 3;
  auto c = make_moe_case(s);
  ASSERT_TRUE(c.is_ok());
  for (int64_t t = 0; t < 40; ++t) {
    int local = 0;
    for (int k = 0; k < 4; ++k) local += c->topk_ids[t * 4 + k] >= 4 && c->topk_ids[t * 4 + k] < 8;
    EXPECT_EQ(local, 3);
  }
  // empty_expert: the middle local expert never appears.
  c = make_moe_case(spec(RoutingPattern::kEmptyExpert, 3, 1));
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(std::count(c->topk_ids.begin(), c->topk_ids.end(), 4 + 2), 0);
  // masked: token 0 fully masked, some others masked, weights of masked slots nonzero.
  c = make_moe_case(spec(RoutingPattern::kMasked));
  ASSERT_TRUE(c.is_ok());
  for (int k = 0; k < 4; ++k) {
    EXPECT_EQ(c->topk_ids[k], -1);
    EXPECT_GT(c->topk_weights[k], 0.f);
  }
  const auto masked = std::count(c->topk_ids.begin() + 4, c->topk_ids.end(), -1);
  EXPECT_GT(masked, 10);
  EXPECT_LT(masked, 80);
  // skewed: this rank's first expert is the most popular.
  c = make_moe_case(spec(RoutingPattern::kSkewed, 3, 1));
  ASSERT_TRUE(c.is_ok());
  std::map<int32_t, int> hits;
  for (int32_t id : c->topk_ids) ++hits[id];
  for (const auto& [id, n] : hits) EXPECT_LE(n, hits[4]) << id;
}

TEST(MoeCase, RanksSliceTheEp1ProblemAndThreadsChangeNothing) {
  MoeCaseSpec s1;
  s1.problem.shape = {512, 256, 8, 2, 1, 0};  // big enough for the parallel weight fill
  s1.m = 3;
  s1.seed = 4;
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  auto one = make_moe_case(s1);
  omp_set_num_threads(3);
  auto three = make_moe_case(s1);
  omp_set_num_threads(saved);
  ASSERT_TRUE(one.is_ok() && three.is_ok());
  EXPECT_EQ(one->fc1_q, three->fc1_q);
  EXPECT_EQ(one->fc2_scale, three->fc2_scale);
  EXPECT_EQ(one->x, three->x);
  MoeCaseSpec s2 = s1;
  s2.problem.shape.ep_size = 4;
  s2.problem.shape.ep_rank = 2;  // experts 4, 5
  auto r2 = make_moe_case(s2);
  ASSERT_TRUE(r2.is_ok());
  const size_t per = r2->fc1_q.size() / 2;
  EXPECT_TRUE(std::equal(r2->fc1_q.begin(), r2->fc1_q.end(), one->fc1_q.begin() + 4 * per));
  const size_t per2 = r2->fc2_scale.size() / 2;
  EXPECT_TRUE(std::equal(r2->fc2_scale.begin(), r2->fc2_scale.end(), one->fc2_scale.begin() + 4 * per2));
  // Weight codes look like a bell curve: zero and +-0.5 common, +-6 rare but present.
  std::vector<int> hist(16, 0);
  for (uint8_t b : one->fc1_q) {
    ++hist[b & 0xF];
    ++hist[b >> 4];
  }
  EXPECT_GT(hist[1] + hist[9], hist[7] + hist[15]);
  EXPECT_GT(hist[7] + hist[15], 0);
}

TEST(MoeCase, RegenerateInputsKeepsWeights) {
  auto c = make_moe_case(spec(RoutingPattern::kUniform));
  ASSERT_TRUE(c.is_ok());
  const auto w = c->fc1_q;
  MoeCaseSpec s = spec(RoutingPattern::kSkewed);
  s.m = 7;
  ASSERT_TRUE(regenerate_inputs(s, c.value()).is_ok());
  EXPECT_EQ(c->m, 7);
  EXPECT_EQ(c->x.size(), 7u * 96);
  EXPECT_EQ(c->fc1_q, w);
  s.problem.shape.intermediate = 32;
  EXPECT_NE(regenerate_inputs(s, c.value()).message().find("shape differs"), std::string::npos);
}

TEST(MoeCase, ErrorsNameTheField) {
  MoeCaseSpec s = spec(RoutingPattern::kEpMixed, 3, 1);
  s.local_slots = 5;
  EXPECT_NE(make_moe_case(s).status().message().find("local_slots = 5"), std::string::npos);
  s = spec(RoutingPattern::kSkewed);
  s.zipf_s = 0;
  EXPECT_NE(make_moe_case(s).status().message().find("zipf_s"), std::string::npos);
  s = spec(RoutingPattern::kEmptyExpert);
  s.problem.shape.num_experts = 4;
  EXPECT_NE(make_moe_case(s).status().message().find("empty_expert routing needs"), std::string::npos);
  s = spec(RoutingPattern::kUniform);
  s.m = -1;
  EXPECT_NE(make_moe_case(s).status().message().find("m = -1"), std::string::npos);
  s.m = 1;
  s.problem.shape.hidden = 100;
  EXPECT_NE(make_moe_case(s).status().message().find("hidden (K) = 100"), std::string::npos);
}

}  // namespace
}  // namespace k3
