// The benchmark workload (k3/harness/moe_workload.hpp): routing distributions and their replay files,
// synthetic weights, and the traffic count every backend's benchmark divides by.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>

#include "core/st_test_util.hpp"
#include "k3/cpu_moe.hpp"
#include "k3/harness/moe_workload.hpp"

namespace k3 {
namespace {

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg)

// K 64, N 32, 32 experts over 4 ranks (E_local 8, rank 1 holds 8..15), top-4.
MoeShape small_shape() { return MoeShape{64, 32, 32, 4, 4, 1}; }

// Files in a directory of this process's own (ctest runs tests as parallel processes).
std::string temp_path(const char* name) {
  static const test::TempDir dir("moe_workload");
  return dir.file(name);
}

TEST(MoeWorkload, RoutingSpecsParseAndName) {
  for (const char* s : {"uniform", "ep_mixed", "zipf:1.5", "replay:/tmp/x.ids"}) {
    auto r = parse_bench_routing(s);
    ASSERT_TRUE(r) << r.status().to_string();
    EXPECT_EQ(r->name(), s);
  }
  for (const char* s : {"zipf:0", "zipf:-1", "zipf:abc", "zipf:inf", "zipf:"}) {
    auto r = parse_bench_routing(s);
    ASSERT_FALSE(r) << s;
    EXPECT_HAS(r.status().message(), std::string("routing '") + s + "': zipf:S needs a finite S > 0");
  }
  for (const char* s : {"", "Uniform", "replay:", "skewed"}) {
    auto r = parse_bench_routing(s);
    ASSERT_FALSE(r) << s;
    EXPECT_HAS(r.status().message(), "is unknown (expected uniform, zipf:S, ep_mixed or replay:FILE)");
  }
}

TEST(MoeWorkload, SyntheticRoutingKeepsItsPromises) {
  const MoeShape sh = small_shape();
  const int first = sh.first_local_expert(), el = sh.local_experts(), k = sh.top_k;
  const int64_t m = 300;
  for (const char* spec_text : {"uniform", "zipf:1.2", "ep_mixed"}) {
    SCOPED_TRACE(spec_text);
    const BenchRouting spec = parse_bench_routing(spec_text).value();
    auto r = make_bench_routing(spec, sh, m, 7);
    ASSERT_TRUE(r) << r.status().to_string();
    ASSERT_EQ(r->ids.size(), static_cast<size_t>(m * k));
    for (int64_t t = 0; t < m; ++t) {
      std::set<int32_t> distinct;
      int local = 0;
      float sum = 0;
      for (int s = 0; s < k; ++s) {
        const int32_t id = r->ids[static_cast<size_t>(t * k + s)];
        ASSERT_GE(id, 0);
        ASSERT_LT(id, sh.num_experts);
        distinct.insert(id);
        local += id >= first && id < first + el;
        const float w = r->weights[static_cast<size_t>(t * k + s)];
        EXPECT_GT(w, 0.0f);
        sum += w;
      }
      EXPECT_EQ(distinct.size(), static_cast<size_t>(k)) << "token " << t;
      EXPECT_EQ(local, spec.kind == BenchRouting::Kind::kEpMixed ? k / 2 : k) << "token " << t;
      EXPECT_NEAR(sum, 1.0f, 1e-5f);
    }
    // A pure function of the seed.
    EXPECT_EQ(make_bench_routing(spec, sh, m, 7)->ids, r->ids);
    EXPECT_NE(make_bench_routing(spec, sh, m, 8)->ids, r->ids);
  }
  // Zipf: the most popular expert receives far more than the mean.
  const auto z = make_bench_routing(parse_bench_routing("zipf:1.5").value(), sh, 2000, 3).value();
  std::vector<int> count(static_cast<size_t>(sh.num_experts));
  for (int32_t id : z.ids) ++count[static_cast<size_t>(id)];
  const double mean = 2000.0 * k / el;
  EXPECT_GT(*std::max_element(count.begin(), count.end()), 1.3 * mean);
}

TEST(MoeWorkload, SyntheticRoutingThatCannotBeDrawnIsNamed) {
  MoeShape sh = small_shape();
  sh.top_k = 12;  // 12 local slots per token, E_local = 8
  auto r = make_bench_routing(parse_bench_routing("uniform").value(), sh, 4, 1);
  ASSERT_FALSE(r);
  EXPECT_HAS(r.status().message(),
             "routing uniform: 12 local slots per token need at least that many local experts (E_local = 8)");
  MoeShape one{64, 32, 8, 4, 1, 0};  // ep_size 1: no remote expert for ep_mixed's 2 remote slots
  auto e = make_bench_routing(parse_bench_routing("ep_mixed").value(), one, 4, 1);
  ASSERT_FALSE(e);
  EXPECT_HAS(e.status().message(), "remote slots per token need that many remote experts (E - E_local = 0)");
  MoeShape bad = small_shape();
  bad.hidden = 70;
  EXPECT_FALSE(make_bench_routing(parse_bench_routing("uniform").value(), bad, 4, 1));
  auto neg = make_bench_routing(parse_bench_routing("uniform").value(), small_shape(), -1, 1);
  ASSERT_FALSE(neg);
  EXPECT_HAS(neg.status().message(), "routing: m = -1 must be >= 0");
  auto none = make_bench_routing(parse_bench_routing("uniform").value(), small_shape(), 0, 1);
  ASSERT_TRUE(none) << none.status().to_string();
  EXPECT_TRUE(none->ids.empty());
}

TEST(MoeWorkload, ReplayFilesRoundTripAndRepeatCyclically) {
  const MoeShape sh = small_shape();
  const std::string path = temp_path("k3_workload.ids");
  std::remove(path.c_str());
  std::vector<int32_t> ids = {0, 9, 10, -1, 31, 8, 12, 13, 14, 15, 1, 2};  // 3 tokens, top-4
  ASSERT_TRUE(save_routing_replay(path, 3, 4, ids).is_ok());
  int64_t tokens = 0;
  auto back = load_routing_replay(path, 4, &tokens);
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_EQ(tokens, 3);
  EXPECT_EQ(back.value(), ids);
  auto r = make_bench_routing(parse_bench_routing("replay:" + path).value(), sh, 7, 1);
  ASSERT_TRUE(r) << r.status().to_string();
  for (int64_t t = 0; t < 7; ++t) {
    for (int s = 0; s < 4; ++s) EXPECT_EQ(r->ids[static_cast<size_t>(t * 4 + s)], ids[static_cast<size_t>((t % 3) * 4 + s)]);
  }
  // An existing replay file is never overwritten by accident: the writer is atomic, and the
  // top_k of the reader must match.
  auto wrong_k = load_routing_replay(path, 8, &tokens);
  ASSERT_FALSE(wrong_k);
  EXPECT_HAS(wrong_k.status().message(), "top_k = 4 in the file, the shape has top_k = 8");
  std::remove(path.c_str());
}

TEST(MoeWorkload, BadReplayFilesAreRefusedWithTheReason) {
  const MoeShape sh = small_shape();
  int64_t tokens = 0;
  const std::string missing = temp_path("k3_workload_missing.ids");
  std::remove(missing.c_str());
  EXPECT_FALSE(load_routing_replay(missing, 4, &tokens));

  const std::string junk = temp_path("k3_workload_junk.ids");
  std::ofstream(junk) << "not a routing file at all, long enough for a header";
  auto j = load_routing_replay(junk, 4, &tokens);
  ASSERT_FALSE(j);
  EXPECT_HAS(j.status().message(), "not a routing replay file (expected the 8-byte magic K3IDS001");

  // A header promising more ids than the file holds.
  const std::string shortf = temp_path("k3_workload_short.ids");
  std::remove(shortf.c_str());
  ASSERT_TRUE(save_routing_replay(shortf, 2, 4, std::vector<int32_t>(8, 1)).is_ok());
  std::filesystem::resize_file(shortf, 24 + 4 * 4);
  auto s = load_routing_replay(shortf, 4, &tokens);
  ASSERT_FALSE(s);
  EXPECT_HAS(s.status().message(), "header says 2 tokens x 4 ids but the file has 40 bytes");

  // Ids outside [-1, E) are named with their position; an empty file has no token to repeat.
  const std::string far = temp_path("k3_workload_far.ids");
  std::remove(far.c_str());
  ASSERT_TRUE(save_routing_replay(far, 1, 4, std::vector<int32_t>{1, 2, 32, 3}).is_ok());
  auto f = make_bench_routing(parse_bench_routing("replay:" + far).value(), sh, 2, 1);
  ASSERT_FALSE(f);
  EXPECT_HAS(f.status().message(), "id 32 at position 2 is outside [-1, 32)");
  const std::string empty = temp_path("k3_workload_empty.ids");
  std::remove(empty.c_str());
  ASSERT_TRUE(save_routing_replay(empty, 0, 4, {}).is_ok());
  auto e = make_bench_routing(parse_bench_routing("replay:" + empty).value(), sh, 2, 1);
  ASSERT_FALSE(e);
  EXPECT_HAS(e.status().message(), "holds no token");

  // The writer checks its own arguments.
  auto w = save_routing_replay(temp_path("k3_workload_never.ids"), 2, 4, std::vector<int32_t>(7, 0), "--save-routing");
  ASSERT_FALSE(w.is_ok());
  EXPECT_HAS(w.message(), "--save-routing: ids has 7 elements, expected tokens (2) x top_k (4)");
  for (const auto& p : {junk, shortf, far, empty}) std::remove(p.c_str());
}

TEST(MoeWorkload, SyntheticWeightsAreSeededFiniteMxfp4) {
  const MoeShape sh = small_shape();
  const SyntheticMoeWeights a = synthetic_moe_weights(sh, 5), b = synthetic_moe_weights(sh, 5),
                            c = synthetic_moe_weights(sh, 6);
  const int64_t el = sh.local_experts(), k = sh.hidden, n = sh.intermediate;
  EXPECT_EQ(a.fc1_q.size(), static_cast<size_t>(el * 2 * n * k / 2));
  EXPECT_EQ(a.fc1_scale.size(), static_cast<size_t>(el * 2 * n * k / 32));
  EXPECT_EQ(a.fc2_q.size(), static_cast<size_t>(el * k * n / 2));
  EXPECT_EQ(a.fc2_scale.size(), static_cast<size_t>(el * k * n / 32));
  EXPECT_EQ(a.fc1_q, b.fc1_q);
  EXPECT_EQ(a.fc2_scale, b.fc2_scale);
  EXPECT_NE(a.fc1_q, c.fc1_q);
  for (uint8_t s : a.fc1_scale) ASSERT_TRUE(s >= 119 && s <= 121);
  for (uint8_t s : a.fc2_scale) ASSERT_TRUE(s >= 119 && s <= 121);
}

// The traffic count against a direct count: per chunk, the distinct local experts it touches.
TEST(MoeWorkload, TrafficCountsEachActiveExpertOncePerChunk) {
  const MoeShape sh = small_shape();
  const int64_t m = 37;
  const auto r = make_bench_routing(parse_bench_routing("ep_mixed").value(), sh, m, 11).value();
  const double eb = static_cast<double>(mxfp4_expert_bytes(sh));
  EXPECT_EQ(mxfp4_expert_bytes(sh), 3 * 64 * 32 / 2 + 3 * 64 * 32 / 32);
  for (int64_t chunk : {int64_t{1}, int64_t{5}, int64_t{16}, m, int64_t{1000}}) {
    SCOPED_TRACE(chunk);
    auto t = moe_call_traffic(sh, m, r.ids, chunk);
    ASSERT_TRUE(t) << t.status().to_string();
    double want = 0;
    int64_t slots = 0;
    std::set<int32_t> all;
    for (int64_t t0 = 0; t0 < m; t0 += chunk) {
      std::set<int32_t> in_chunk;
      for (int64_t i = t0 * sh.top_k; i < std::min(m, t0 + chunk) * sh.top_k; ++i) {
        const int32_t id = r.ids[static_cast<size_t>(i)];
        if (id >= sh.first_local_expert() && id < sh.first_local_expert() + sh.local_experts()) {
          in_chunk.insert(id);
          all.insert(id);
          ++slots;
        }
      }
      want += eb * static_cast<double>(in_chunk.size());
    }
    EXPECT_EQ(t->weight_bytes, want);
    EXPECT_EQ(t->local_slots, slots);
    EXPECT_EQ(t->active_experts, static_cast<int64_t>(all.size()));
    EXPECT_EQ(t->flops, 2.0 * 3.0 * 64 * 32 * static_cast<double>(slots));
  }
  auto z = moe_call_traffic(sh, m, r.ids, 0);
  ASSERT_FALSE(z);
  EXPECT_HAS(z.status().message(), "chunk_tokens = 0 must be >= 1");
  EXPECT_FALSE(moe_call_traffic(sh, m + 1, r.ids, 4));  // ids shorter than (m + 1) * top_k
}

// The CPU benchmark divides by mxfp4_expert_bytes: the prepacked layout streams exactly that.
TEST(MoeWorkload, CpuPrepackedExpertsStreamTheMxfp4Bytes) {
  MoeProblem p;
  p.shape = small_shape();
  auto plan = cpu::plan(p);
  ASSERT_TRUE(plan) << plan.status().to_string();
  const SyntheticMoeWeights w = synthetic_moe_weights(p.shape, 2);
  auto packed = cpu::prepack(plan.value(), w.view());
  ASSERT_TRUE(packed) << packed.status().to_string();
  EXPECT_EQ(packed->fc1_expert_bytes() + packed->fc2_expert_bytes(), mxfp4_expert_bytes(p.shape));
}

}  // namespace
}  // namespace k3
