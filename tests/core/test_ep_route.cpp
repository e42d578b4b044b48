// The host bookkeeping of expert-parallel dispatch / combine (k3/ep_route.hpp): hand-worked
// examples, an emulated exchange over W ranks in which every slot's y must land where the source
// expects it, and the argument errors.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "k3/ep_route.hpp"

namespace k3::comm {
namespace {

TEST(EpRoute, HandWorkedTwoRanks) {
  // E = 4, W = 2 (rank 0: experts 0, 1; rank 1: experts 2, 3), top_k = 2, M = 4.
  const MoeShape shape{64, 64, 4, 2, 2, 0};
  const std::vector<int32_t> ids = {3, 0,    // token 0: both ranks
                                    -1, -1,  // token 1: masked, sent nowhere
                                    2, 3,    // token 2: rank 1 only, two slots
                                    1, -1};  // token 3: rank 0 only
  auto r = ep_route(shape, 4, ids);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->sent_tokens, (std::vector<int32_t>{0, 3, 0, 2}));
  EXPECT_EQ(r->sent_offsets, (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(r->sent_ids, (std::vector<int32_t>{-1, 0, 1, -1, 3, -1, 2, 3}));
  EXPECT_EQ(r->slots_to, (std::vector<int64_t>{2, 3}));
  // Receive buffer: rank 0's rows (t0 s1, t3 s0), then rank 1's (t0 s0, t2 s0, t2 s1).
  EXPECT_EQ(r->slot_row, (std::vector<int32_t>{2, 0, -1, -1, 3, 4, 1, -1}));
}

TEST(EpExpertSlots, PiecesAndSlotIndices) {
  const MoeShape shape{64, 64, 4, 2, 2, 1};  // rank 1 holds experts 2, 3
  // 3 rows from rank 0, 1 from rank 1; pieces of 2 rows.
  const std::vector<int32_t> ids = {3, -1, 2, 3, -1, 2, 2, -1};
  auto e = ep_expert_slots(shape, std::vector<int64_t>{3, 1}, ids, 2);
  ASSERT_TRUE(e.is_ok()) << e.status().to_string();
  EXPECT_EQ(e->slots_from, (std::vector<int64_t>{4, 1}));
  EXPECT_EQ(e->piece_slot_offsets, (std::vector<int64_t>{0, 3, 5}));
  EXPECT_EQ(e->piece_slot, (std::vector<int32_t>{0, 2, 3, 1, 2}));
  auto empty = ep_expert_slots(shape, std::vector<int64_t>{0, 0}, {}, 8);
  ASSERT_TRUE(empty.is_ok());
  EXPECT_EQ(empty->piece_slot_offsets, (std::vector<int64_t>{0}));
}

// W ranks with random routing: route on every source, "send" the rows, compute the destination
// slots, give each y row the identity of its (source, token, slot), "return" them, and check that
// the source's slot_row finds its own (token, slot) everywhere.
TEST(EpRoute, EmulatedExchangeDeliversEverySlotWhereTheSourceLooksForIt) {
  for (const int w : {1, 2, 3, 4}) {
    const int experts = 12, topk = 3;
    const int64_t piece = 5;
    std::mt19937 rng(static_cast<unsigned>(w));
    std::vector<int64_t> m(static_cast<size_t>(w));
    std::vector<std::vector<int32_t>> ids(static_cast<size_t>(w));
    std::vector<EpRoute> routes;
    for (int r = 0; r < w; ++r) {
      m[static_cast<size_t>(r)] = static_cast<int64_t>(rng() % 9);  // 0 included
      for (int64_t i = 0; i < m[static_cast<size_t>(r)] * topk; ++i) {
        ids[static_cast<size_t>(r)].push_back(rng() % 4 == 0 ? -1 : static_cast<int32_t>(rng() % experts));
      }
      auto rt = ep_route(MoeShape{64, 64, experts, topk, w, r}, m[static_cast<size_t>(r)], ids[static_cast<size_t>(r)]);
      ASSERT_TRUE(rt.is_ok()) << rt.status().to_string();
      routes.push_back(std::move(rt).value());
    }
    // y identity: source * 1e6 + token * 100 + slot.
    std::vector<std::vector<int64_t>> back(static_cast<size_t>(w));  // back[src]: rows received, rank order
    for (int p = 0; p < w; ++p) {
      std::vector<int64_t> rows_from;
      std::vector<int32_t> recv_ids, recv_src, recv_tok;
      for (int q = 0; q < w; ++q) {
        const EpRoute& rq = routes[static_cast<size_t>(q)];
        rows_from.push_back(rq.sent_offsets[static_cast<size_t>(p) + 1] - rq.sent_offsets[static_cast<size_t>(p)]);
        for (int64_t i = rq.sent_offsets[static_cast<size_t>(p)]; i < rq.sent_offsets[static_cast<size_t>(p) + 1]; ++i) {
          recv_ids.insert(recv_ids.end(), rq.sent_ids.begin() + i * topk, rq.sent_ids.begin() + (i + 1) * topk);
          recv_src.push_back(q);
          recv_tok.push_back(rq.sent_tokens[static_cast<size_t>(i)]);
        }
      }
      auto e = ep_expert_slots(MoeShape{64, 64, experts, topk, w, p}, rows_from, recv_ids, piece);
      ASSERT_TRUE(e.is_ok()) << e.status().to_string();
      ASSERT_EQ(e->piece_slot_offsets.back(), static_cast<int64_t>(e->piece_slot.size()));
      // Walk the slots in (row, slot) order, piece by piece, and return them grouped by source.
      int64_t j = 0;
      for (size_t pc = 0; pc + 1 < e->piece_slot_offsets.size(); ++pc) {
        for (; j < e->piece_slot_offsets[pc + 1]; ++j) {
          const int64_t row = static_cast<int64_t>(pc) * piece + e->piece_slot[static_cast<size_t>(j)] / topk;
          const int64_t s = e->piece_slot[static_cast<size_t>(j)] % topk;
          ASSERT_NE(recv_ids[static_cast<size_t>(row * topk + s)], -1);
          const int32_t src = recv_src[static_cast<size_t>(row)];
          back[static_cast<size_t>(src)].push_back(src * 1000000 + recv_tok[static_cast<size_t>(row)] * 100 + s);
        }
      }
      for (int q = 0; q < w; ++q) {
        EXPECT_EQ(e->slots_from[static_cast<size_t>(q)], routes[static_cast<size_t>(q)].slots_to[static_cast<size_t>(p)])
            << "W " << w << " dest " << p << " src " << q;
      }
    }
    for (int r = 0; r < w; ++r) {
      const EpRoute& rt = routes[static_cast<size_t>(r)];
      for (int64_t t = 0; t < m[static_cast<size_t>(r)]; ++t) {
        for (int s = 0; s < topk; ++s) {
          const int32_t row = rt.slot_row[static_cast<size_t>(t * topk + s)];
          if (ids[static_cast<size_t>(r)][static_cast<size_t>(t * topk + s)] < 0) {
            EXPECT_EQ(row, -1);
            continue;
          }
          ASSERT_GE(row, 0);
          ASSERT_LT(row, static_cast<int32_t>(back[static_cast<size_t>(r)].size()));
          EXPECT_EQ(back[static_cast<size_t>(r)][static_cast<size_t>(row)], r * 1000000 + t * 100 + s)
              << "W " << w << " rank " << r << " token " << t << " slot " << s;
        }
      }
    }
  }
}

TEST(EpRoute, ArgumentErrorsNameTheValue) {
  const MoeShape shape{64, 64, 4, 2, 2, 0};
  auto bad_id = ep_route(shape, 1, std::vector<int32_t>{0, 4});
  ASSERT_FALSE(bad_id.is_ok());
  EXPECT_NE(bad_id.status().message().find("topk_ids[0, 1] = 4"), std::string::npos) << bad_id.status().message();
  auto bad_size = ep_route(shape, 2, std::vector<int32_t>{0, 1});
  ASSERT_FALSE(bad_size.is_ok());
  EXPECT_NE(bad_size.status().message().find("expected M*top_k = 4"), std::string::npos);
  auto bad_m = ep_route(shape, -1, {});
  EXPECT_NE(bad_m.status().message().find("m = -1"), std::string::npos);
  // A destination receiving an id it does not hold.
  auto foreign = ep_expert_slots(MoeShape{64, 64, 4, 2, 2, 1}, std::vector<int64_t>{1, 0}, std::vector<int32_t>{2, 1}, 4);
  ASSERT_FALSE(foreign.is_ok());
  EXPECT_EQ(foreign.status().code(), StatusCode::kInternal);
  EXPECT_NE(foreign.status().message().find("expert id 1, which rank 1 does not hold"), std::string::npos)
      << foreign.status().message();
  auto bad_rows = ep_expert_slots(shape, std::vector<int64_t>{1}, {}, 4);
  EXPECT_NE(bad_rows.status().message().find("rows_from has 1 entries, expected ep_size = 2"), std::string::npos);
  auto bad_piece = ep_expert_slots(shape, std::vector<int64_t>{0, 0}, {}, 0);
  EXPECT_NE(bad_piece.status().message().find("piece_rows = 0"), std::string::npos);
}

}  // namespace
}  // namespace k3::comm
