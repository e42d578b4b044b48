// The router (k3/routing.hpp) against a naive full-sort implementation written here, with exact
// ties, 1-ulp near-ties, grouped top-k, the NaN / Inf policy and every error path.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "k3/routing.hpp"

namespace k3 {
namespace {

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> w;
};

Routed run_route(const RoutingConfig& cfg, int64_t m, const std::vector<float>& logits, const std::vector<float>& bias) {
  Routed r{std::vector<int32_t>(m * cfg.top_k, -7), std::vector<float>(m * cfg.top_k, -7.f)};
  const Status st = route(cfg, m, logits, bias, r.ids, r.w);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return r;
}

// Naive: full sort of (choice, index) over the non-NaN experts of the kept groups.
Routed naive_route(const RoutingConfig& cfg, int64_t m, const std::vector<float>& logits, const std::vector<float>& bias) {
  const int e_n = cfg.num_experts, k = cfg.top_k, gsize = e_n / cfg.n_group;
  Routed r{std::vector<int32_t>(m * k), std::vector<float>(m * k)};
  auto before = [](const std::pair<float, int>& a, const std::pair<float, int>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  for (int64_t t = 0; t < m; ++t) {
    std::vector<float> s(e_n), c(e_n);
    for (int e = 0; e < e_n; ++e) {
      s[e] = router_sigmoid(logits[t * e_n + e]);
      c[e] = s[e] + (bias.empty() ? 0.0f : bias[e]);
    }
    std::vector<bool> kept(e_n, true);
    if (cfg.n_group > 1) {
      std::vector<std::pair<float, int>> groups;
      for (int g = 0; g < cfg.n_group; ++g) {
        std::vector<float> v;
        for (int e = g * gsize; e < (g + 1) * gsize; ++e) {
          if (!std::isnan(c[e])) v.push_back(c[e]);
        }
        std::sort(v.rbegin(), v.rend());
        if (!v.empty()) groups.push_back({v.size() > 1 ? v[0] + v[1] : v[0], g});
      }
      std::sort(groups.begin(), groups.end(), before);
      std::fill(kept.begin(), kept.end(), false);
      for (int i = 0; i < cfg.topk_group && i < static_cast<int>(groups.size()); ++i) {
        for (int e = groups[i].second * gsize; e < (groups[i].second + 1) * gsize; ++e) kept[e] = true;
      }
    }
    std::vector<std::pair<float, int>> all;
    for (int e = 0; e < e_n; ++e) {
      if (kept[e] && !std::isnan(c[e])) all.push_back({c[e], e});
    }
    std::sort(all.begin(), all.end(), before);
    float sum = 0;
    const int take = std::min<int>(k, static_cast<int>(all.size()));
    for (int i = 0; i < take; ++i) sum += s[all[i].second];
    for (int i = 0; i < k; ++i) {
      r.ids[t * k + i] = i < take ? all[i].second : -1;
      const float w = i < take ? (cfg.renormalize ? s[all[i].second] / (sum + 1e-20f) : s[all[i].second]) : 0.f;
      r.w[t * k + i] = i < take ? w * cfg.routed_scaling_factor : 0.f;
    }
  }
  return r;
}

void expect_same(const Routed& a, const Routed& b) {
  ASSERT_EQ(a.ids, b.ids);
  ASSERT_EQ(std::memcmp(a.w.data(), b.w.data(), a.w.size() * 4), 0);
}

std::vector<float> random_logits(int64_t m, int e, uint64_t seed, float sd = 2.f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, sd);
  std::vector<float> v(m * e);
  for (auto& x : v) x = nd(rng);
  return v;
}

TEST(Router, Kimi896Top16MatchesNaiveWithAndWithoutBias) {
  RoutingConfig cfg;  // 896 / 16, groups 1 / 1
  const int64_t m = 33;
  const auto logits = random_logits(m, 896, 1);
  std::vector<float> bias(896);
  std::mt19937_64 rng(2);
  for (auto& b : bias) b = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) * 1e-4f;
  expect_same(run_route(cfg, m, logits, bias), naive_route(cfg, m, logits, bias));
  expect_same(run_route(cfg, m, logits, {}), naive_route(cfg, m, logits, {}));
  const auto r = run_route(cfg, m, logits, bias);
  for (int64_t t = 0; t < m; ++t) {
    float sum = 0;
    std::vector<int32_t> row(r.ids.begin() + t * 16, r.ids.begin() + (t + 1) * 16);
    for (int i = 0; i < 16; ++i) sum += r.w[t * 16 + i];
    EXPECT_NEAR(sum, 1.0f, 1e-5f);
    std::sort(row.begin(), row.end());
    EXPECT_EQ(std::adjacent_find(row.begin(), row.end()), row.end()) << "duplicate expert in token " << t;
  }
  // The bias changes the selection but never the weights' source (the unbiased scores).
  const auto nob = run_route(cfg, m, logits, {});
  EXPECT_NE(r.ids, nob.ids);
  for (int64_t i = 0; i < m * 16; ++i) {
    const float s = router_sigmoid(logits[(i / 16) * 896 + r.ids[i]]);
    EXPECT_GT(r.w[i], 0.f);
    EXPECT_LE(r.w[i], s / 0.5f);  // renormalized by a sum >= 0.5 (16 sigmoids, the best ones)
  }
}

TEST(Router, ExactTiesGoToTheLowerIndexInOrder) {
  RoutingConfig cfg;
  const std::vector<float> logits(896, 0.0f);  // every score 0.5, every choice equal
  const auto r = run_route(cfg, 1, logits, {});
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(r.ids[i], i);
    EXPECT_EQ(r.w[i], 0.0625f);  // 0.5 / (8 + 1e-20), and 8 + 1e-20 == 8 in FP32
  }
  // Ties among 64 experts far apart (choice 0.5 + 0.25 = 0.75 exactly for 100..131 and 800..831,
  // about 2e-9 for everyone else): the 16 lowest indices win, in index order.
  std::vector<float> lg(896, -20.f), bias(896, 0.f);
  for (int e = 800; e < 832; ++e) {
    lg[e] = 0.f;
    bias[e] = 0.25f;
  }
  for (int e = 100; e < 132; ++e) {
    lg[e] = 0.f;
    bias[e] = 0.25f;
  }
  const auto r2 = run_route(cfg, 1, lg, bias);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(r2.ids[i], 100 + i);
}

TEST(Router, OneUlpNearTiesAreResolvedByValueNotIndex) {
  RoutingConfig cfg;
  const std::vector<float> logits(896, 0.0f);  // s = 0.5 exactly for everyone
  std::vector<float> bias(896, 0.5f);          // choice 1.0
  const float up = 0.5f + std::ldexp(1.f, -23);  // choice 1 + 2^-23: one ulp above 1
  ASSERT_EQ(0.5f + up, std::nextafter(1.0f, 2.f));
  const std::vector<int> winners = {895, 17, 640, 3, 801, 402, 777, 64, 128, 256, 512, 700, 701, 702, 650, 889};
  for (int e : winners) bias[e] = up;
  bias[0] = 0.5f - std::ldexp(1.f, -24);  // choice 1 - 2^-24: one ulp below 1
  ASSERT_EQ(0.5f + bias[0], std::nextafter(1.0f, 0.f));
  auto r = run_route(cfg, 1, logits, bias);
  std::vector<int> want = winners;
  std::sort(want.begin(), want.end());  // equal among themselves -> index order
  for (int i = 0; i < 16; ++i) EXPECT_EQ(r.ids[i], want[i]);
  // Fifteen winners: the sixteenth slot goes to expert 1 (the lowest index at choice 1.0); expert 0
  // sits one ulp below and loses.
  bias[889] = 0.5f;
  r = run_route(cfg, 1, logits, bias);
  EXPECT_EQ(r.ids[15], 1);
  expect_same(r, naive_route(cfg, 1, logits, bias));
}

TEST(Router, GroupedTopKMatchesNaive) {
  // DeepSeek-V3 style: 256 experts, 8 groups, 4 kept, top-8, scaling 2.5; plus an odd small config.
  RoutingConfig ds{256, 8, 8, 4, true, 2.5f};
  const auto logits = random_logits(17, 256, 3);
  std::vector<float> bias(256);
  std::mt19937_64 rng(4);
  for (auto& b : bias) b = static_cast<float>(rng() % 100) * 1e-3f;
  expect_same(run_route(ds, 17, logits, bias), naive_route(ds, 17, logits, bias));
  const auto r = run_route(ds, 17, logits, bias);
  for (int64_t t = 0; t < 17; ++t) {  // at most 4 distinct groups
    std::vector<int> groups;
    for (int i = 0; i < 8; ++i) groups.push_back(r.ids[t * 8 + i] / 32);
    std::sort(groups.begin(), groups.end());
    EXPECT_LE(std::unique(groups.begin(), groups.end()) - groups.begin(), 4);
  }
  RoutingConfig odd{45, 3, 9, 2, false, 1.0f};  // groups of 5, no renormalization
  const auto lo = random_logits(11, 45, 5);
  expect_same(run_route(odd, 11, lo, {}), naive_route(odd, 11, lo, {}));
  RoutingConfig single{12, 2, 12, 3, true, 1.0f};  // groups of one expert: the group score is its choice
  const auto ls = random_logits(5, 12, 6);
  expect_same(run_route(single, 5, ls, {}), naive_route(single, 5, ls, {}));
}

TEST(Router, GroupScoreIsTheSumOfTheTopTwo) {
  // Group 0 holds one very strong expert, group 1 two good ones: the top-2 sum prefers group 1.
  RoutingConfig cfg{8, 2, 2, 1, true, 1.0f};
  std::vector<float> lg(8, -10.f);
  lg[0] = 10.f;              // s ~ 1
  lg[4] = lg[5] = 2.f;       // s ~ 0.88 each: sum 1.76 > 1 + 0.00005
  const auto r = run_route(cfg, 1, lg, {});
  EXPECT_EQ(r.ids[0], 4);
  EXPECT_EQ(r.ids[1], 5);
}

TEST(Router, NonFiniteLogitsFollowTheDocumentedPolicy) {
  RoutingConfig cfg;
  auto logits = random_logits(4, 896, 7, 0.5f);
  // Token 0: NaN on would-be winners (NaN never selected), +Inf selected first with s = 1,
  // -Inf behaves as s = 0.
  for (int e = 0; e < 40; ++e) logits[e] = NAN;
  logits[300] = INFINITY;
  logits[301] = -INFINITY;
  // Token 1: all NaN -> every slot masked.
  for (int e = 0; e < 896; ++e) logits[896 + e] = NAN;
  // Token 2: only 10 non-NaN logits -> 10 experts, then 6 masked slots at the end.
  for (int e = 0; e < 896; ++e) logits[2 * 896 + e] = e % 89 == 0 && e < 890 ? static_cast<float>(e) * 0.01f : NAN;
  // Token 3: every logit -Inf -> all scores 0: a valid selection by index, weights 0 / 1e-20 = 0.
  for (int e = 0; e < 896; ++e) logits[3 * 896 + e] = -INFINITY;
  const auto r = run_route(cfg, 4, logits, {});
  expect_same(r, naive_route(cfg, 4, logits, {}));
  EXPECT_EQ(r.ids[0], 300);
  for (int i = 0; i < 16; ++i) {
    EXPECT_GE(r.ids[i], 40);
    EXPECT_EQ(r.ids[16 + i], -1);
    EXPECT_EQ(r.w[16 + i], 0.f);
    EXPECT_EQ(r.ids[3 * 16 + i], i);
    EXPECT_EQ(r.w[3 * 16 + i], 0.f);
  }
  for (int i = 0; i < 10; ++i) EXPECT_EQ(r.ids[2 * 16 + i], 89 * (9 - i)) << i;  // larger logit first
  for (int i = 10; i < 16; ++i) EXPECT_EQ(r.ids[2 * 16 + i], -1);
  float sum = 0;
  for (int i = 0; i < 10; ++i) sum += r.w[2 * 16 + i];
  EXPECT_NEAR(sum, 1.f, 1e-6f);
  // A NaN bias removes its expert; an Inf bias puts it first.
  std::vector<float> bias(896, 0.f);
  bias[5] = NAN;
  bias[6] = INFINITY;
  const std::vector<float> zeros(896, 0.f);
  const auto rb = run_route(cfg, 1, zeros, bias);
  EXPECT_EQ(rb.ids[0], 6);
  for (int i = 0; i < 16; ++i) EXPECT_NE(rb.ids[i], 5);
}

TEST(Router, LargestAndSmallestConfigs) {
  RoutingConfig big{4096, 32, 1, 1, true, 1.0f};
  const auto lb = random_logits(3, 4096, 8);
  expect_same(run_route(big, 3, lb, {}), naive_route(big, 3, lb, {}));
  RoutingConfig one{1, 1, 1, 1, true, 1.0f};
  const auto r = run_route(one, 2, {0.3f, -1.f}, {});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(r.w[0], 1.f / (1.f + std::exp(-0.3f)) / (1.f / (1.f + std::exp(-0.3f)) + 1e-20f));
}

TEST(Router, BitIdenticalAcrossThreadCounts) {
  RoutingConfig cfg;
  const auto logits = random_logits(200, 896, 9);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto r1 = run_route(cfg, 200, logits, {});
  for (int th : {2, 3}) {
    omp_set_num_threads(th);
    expect_same(run_route(cfg, 200, logits, {}), r1);
  }
  omp_set_num_threads(saved);
}

TEST(Router, ErrorsNameTheFieldAndValue) {
  std::vector<float> lg(896), w(16);
  std::vector<int32_t> ids(16);
  auto msg = [&](RoutingConfig c) { return route(c, 1, lg, {}, ids, w).message(); };
  RoutingConfig c;
  c.num_experts = 4097;
  EXPECT_NE(msg(c).find("num_experts = 4097 must be in [1, 4096]"), std::string::npos);
  c = {};
  c.top_k = 33;
  EXPECT_NE(msg(c).find("top_k = 33"), std::string::npos);
  c = {};
  c.n_group = 5;
  EXPECT_NE(msg(c).find("n_group = 5 must be >= 1 and divide num_experts = 896"), std::string::npos);
  c = {};
  c.n_group = 8;
  c.topk_group = 9;
  EXPECT_NE(msg(c).find("topk_group = 9 must be in [1, n_group = 8]"), std::string::npos);
  c.n_group = 112;  // groups of 8
  c.topk_group = 1;
  EXPECT_NE(msg(c).find("hold 8 experts, fewer than top_k = 16"), std::string::npos);
  c = {};
  c.routed_scaling_factor = INFINITY;
  EXPECT_NE(msg(c).find("routed_scaling_factor"), std::string::npos);
  c = {};
  EXPECT_NE(route(c, 2, lg, {}, ids, w).message().find("logits [M, E] has 896 elements, expected 1792"),
            std::string::npos);
  EXPECT_NE(route(c, 1, lg, std::vector<float>(3), ids, w).message().find("bias [E] has 3 elements"),
            std::string::npos);
  EXPECT_NE(route(c, 1, lg, {}, std::span<int32_t>(ids).first(15), w).message().find("ids [M, top_k] has 15"),
            std::string::npos);
  EXPECT_NE(route(c, 1, lg, {}, ids, std::span<float>(w).first(1)).message().find("weights [M, top_k] has 1"),
            std::string::npos);
  EXPECT_NE(route(c, -1, lg, {}, ids, w).message().find("m = -1"), std::string::npos);
  EXPECT_TRUE(route(c, 0, {}, {}, {}, {}).is_ok());
}

}  // namespace
}  // namespace k3
