// Expert-parallel dispatch / combine across the ranks of mpirun against the single-process layer:
// every rank's output rows must equal, bit for bit, the rows cpu::run gives when one process
// holds all experts and all tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "ep_test_util.hpp"
#include "k3/ep.hpp"
#include "mpi/mpi_world.hpp"

namespace {

using k3test::EpRouting;
using k3test::EpTokens;

struct EpParam {
  k3::Recipe recipe;
  k3::OutDType out;
  k3::RoutingPattern routing;
  EpTokens tokens;
  EpRouting ids;
  int64_t m;
  const char* name;
};

class EpMpi : public ::testing::TestWithParam<EpParam> {};

TEST_P(EpMpi, DistributedLayerIsBitIdenticalToTheSingleProcessLayer) {
  const EpParam& p = GetParam();
  k3::comm::Communicator& w = k3test::world();
  const int world = w.size(), rank = w.rank();
  const auto full = k3test::make_ep_full_case(p.recipe, p.out, p.routing, p.m, world, p.tokens, p.ids, 7);
  auto oracle_r = k3test::run_full_layer(full.c, {.threads = 1, .isa = {}});
  ASSERT_TRUE(oracle_r.is_ok()) << oracle_r.status().to_string();
  const std::vector<uint8_t>& oracle = *oracle_r;

  k3::MoeProblem prob = full.c.problem;
  prob.shape.ep_size = world;
  prob.shape.ep_rank = rank;
  auto layer = k3test::prepare_cpu(prob, k3test::slice_experts(full.c, world, rank), 1, {}, 8);  // several pieces
  ASSERT_TRUE(layer.is_ok()) << layer.status().to_string();
  std::vector<uint8_t> ws(static_cast<size_t>((*layer)->workspace_bytes()));
  const k3::MoeInputsView mine = k3test::rank_tokens(full, rank);
  const int64_t row_bytes = prob.shape.hidden * k3::out_dtype_size(p.out);
  std::vector<uint8_t> out(static_cast<size_t>(mine.m * row_bytes), 0xAB);
  k3::comm::EpRunStats stats;
  int64_t bytes[2] = {0, 0};
  for (const bool mxfp8 : {true, false}) {  // W4A8 rows as MXFP8 codes + scales, or as BF16
    std::fill(out.begin(), out.end(), 0xAB);
    const k3::Status st = k3::comm::ep_moe_run(w, **layer, mine, ws, out, &stats, {.mxfp8_wire = mxfp8});
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    bytes[mxfp8 ? 0 : 1] = stats.dispatch_bytes_sent;
    const int64_t t0 = full.token_off[static_cast<size_t>(rank)];
    for (int64_t t = 0; t < mine.m; ++t) {
      ASSERT_EQ(0, std::memcmp(out.data() + t * row_bytes, oracle.data() + (t0 + t) * row_bytes, static_cast<size_t>(row_bytes)))
          << "rank " << rank << " of " << world << ", its token " << t << " (global " << t0 + t << "), mxfp8 wire " << mxfp8;
    }
  }
  // Records: 4 top_k id bytes + K + K/32 (MXFP8) or 2K (BF16) per (token, destination).
  const int64_t records = bytes[1] / (16 + 128);
  EXPECT_EQ(bytes[0], p.recipe == k3::Recipe::kW4A8 ? records * (16 + 64 + 2) : bytes[1]);
  // The data each rank computed is exactly its experts' slots of all tokens.
  int64_t expect_slots = 0;
  for (const int32_t id : full.c.topk_ids) expect_slots += id >= prob.shape.first_local_expert() && id < prob.shape.first_local_expert() + prob.shape.local_experts();
  EXPECT_EQ(stats.slots_computed, expect_slots);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, EpMpi,
    ::testing::Values(
        EpParam{k3::Recipe::kW4A8, k3::OutDType::kBF16, k3::RoutingPattern::kUniform, EpTokens::kUneven, EpRouting::kFromCase, 29, "w4a8_uniform_uneven"},
        EpParam{k3::Recipe::kW4A16, k3::OutDType::kFP32, k3::RoutingPattern::kMasked, EpTokens::kUneven, EpRouting::kFromCase, 23, "w4a16_masked_fp32"},
        EpParam{k3::Recipe::kW4A8, k3::OutDType::kFP16, k3::RoutingPattern::kSkewed, EpTokens::kAllOnRankZero, EpRouting::kFromCase, 17, "w4a8_skewed_rank0_tokens"},
        EpParam{k3::Recipe::kW4A16, k3::OutDType::kBF16, k3::RoutingPattern::kUniform, EpTokens::kUneven, EpRouting::kFirstExpertsOnly, 19, "w4a16_first_experts_only"},
        EpParam{k3::Recipe::kW4A8, k3::OutDType::kBF16, k3::RoutingPattern::kUniform, EpTokens::kUneven, EpRouting::kFromCase, 0, "no_tokens_anywhere"}),
    [](const ::testing::TestParamInfo<EpParam>& i) { return std::string(i.param.name); });

TEST(EpMpiErrors, ABadArgumentOnOneRankFailsEveryRankWithItsMessage) {
  k3::comm::Communicator& w = k3test::world();
  const int world = w.size(), rank = w.rank();
  const auto full = k3test::make_ep_full_case(k3::Recipe::kW4A8, k3::OutDType::kBF16, k3::RoutingPattern::kUniform, 9,
                                              world, EpTokens::kUneven, EpRouting::kFromCase, 3);
  k3::MoeShape shape = full.c.problem.shape;
  shape.ep_size = world;
  shape.ep_rank = rank;
  k3::MoeInputsView mine = k3test::rank_tokens(full, rank);
  std::vector<int32_t> bad_ids(mine.topk_ids.begin(), mine.topk_ids.end());
  const int culprit = world - 1;
  if (rank == culprit) {
    bad_ids.assign(static_cast<size_t>(4), 99);  // one token, id 99 >= E = 32
    mine.m = 1;
    mine.x = std::span<const uint16_t>(full.c.x.data(), 64);
  }
  mine.topk_ids = bad_ids;
  k3::MoeProblem prob = full.c.problem;
  prob.shape = shape;
  auto d = k3::comm::ep_dispatch(w, prob, mine);
  ASSERT_FALSE(d.is_ok());
  EXPECT_NE(d.status().message().find("rank " + std::to_string(culprit) + " of " + std::to_string(world) + ": local.topk_ids[0, 0] = 99"),
            std::string::npos) << d.status().message();
}

// The ranks must agree on the layer and its partition: the last rank with one expert fewer (each
// shape valid on its own, partitions that disagree) fails every rank, naming the rank and values.
TEST(EpMpiErrors, APartitionTheRanksDisagreeOnFailsEveryRank) {
  k3::comm::Communicator& w = k3test::world();
  const int world = w.size(), rank = w.rank();
  if (world < 2) GTEST_SKIP() << "needs two ranks";
  k3::MoeProblem prob;
  prob.shape = {64, 64, rank == world - 1 ? 31 : 32, 4, world, rank};
  const k3::MoeInputsView none{};
  auto d = k3::comm::ep_dispatch(w, prob, none);
  ASSERT_FALSE(d.is_ok());
  EXPECT_EQ(d.status().code(), k3::StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("rank " + std::to_string(world - 1) + " of " + std::to_string(world) +
                                      ": num_experts = 31 differs from rank 0's 32"),
            std::string::npos) << d.status().message();
  // The recipe too.
  prob.shape.num_experts = 32;
  prob.recipe = rank == 0 ? k3::Recipe::kW4A8 : k3::Recipe::kW4A16;
  auto d2 = k3::comm::ep_dispatch(w, prob, none);
  ASSERT_FALSE(d2.is_ok());
  EXPECT_NE(d2.status().message().find("rank 1 of " + std::to_string(world) + ": recipe = w4a16 differs from rank 0's w4a8"),
            std::string::npos) << d2.status().message();
}

TEST(EpMpiErrors, ShapeThatDoesNotMatchTheCommunicatorIsRefused) {
  k3::comm::Communicator& w = k3test::world();
  k3::MoeProblem prob;
  prob.shape = {64, 64, 32, 4, w.size() == 1 ? 2 : 1, 0};
  const k3::MoeInputsView none{};
  auto d = k3::comm::ep_dispatch(w, prob, none);
  ASSERT_FALSE(d.is_ok());
  EXPECT_NE(d.status().message().find("must be the communicator's size " + std::to_string(w.size())), std::string::npos)
      << d.status().message();
}

}  // namespace
