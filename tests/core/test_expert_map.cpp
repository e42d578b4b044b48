// Expert-parallel mapping, the stable permutation by local expert and block padding
// (k3/expert_map.hpp), checked against direct recounts written here.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "k3/expert_map.hpp"
#include "k3/routing.hpp"

namespace k3 {
namespace {

// EP32 rank 7 of Kimi-K3 with ids from the real router.
TEST(ExpertMap, KimiEp32Rank7FromRoutedIds) {
  MoeShape sh;  // 896 / 16
  sh.ep_size = 32;
  sh.ep_rank = 7;
  const int64_t m = 128;
  std::mt19937_64 rng(1);
  std::normal_distribution<float> nd(0.f, 2.f);
  std::vector<float> logits(m * 896);
  for (auto& v : logits) v = nd(rng);
  std::vector<int32_t> ids(m * 16);
  std::vector<float> w(m * 16);
  ASSERT_TRUE(route(RoutingConfig{}, m, logits, {}, ids, w).is_ok());
  ids[5] = -1;
  auto r = map_expert_parallel(sh, m, ids);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const EpMapping& mp = r.value();
  EXPECT_EQ(mp.local_experts, 28);
  EXPECT_EQ(mp.first_local, 196);
  int64_t local = 0, remote = 0, masked = 0;
  std::vector<int64_t> per(28, 0);
  for (int64_t i = 0; i < m * 16; ++i) {
    if (ids[i] < 0) {
      ++masked;
      EXPECT_EQ(mp.local_ids[i], -1);
    } else if (ids[i] >= 196 && ids[i] < 224) {
      ++local;
      ++per[ids[i] - 196];
      EXPECT_EQ(mp.local_ids[i], ids[i] - 196);
    } else {
      ++remote;
      EXPECT_EQ(mp.local_ids[i], -1);
    }
  }
  EXPECT_EQ(mp.local_slots, local);
  EXPECT_EQ(mp.remote_slots, remote);
  EXPECT_EQ(mp.masked_slots, 1);
  EXPECT_EQ(mp.rows_per_expert, per);
  EXPECT_GT(local, 0);
  // The permutation: sorted by local expert, slot order within an expert, inverse consistent.
  ASSERT_EQ(static_cast<int64_t>(mp.sorted_slots.size()), local);
  for (int64_t p = 0; p < local; ++p) {
    const int64_t slot = mp.sorted_slots[p];
    EXPECT_EQ(mp.slot_to_sorted[slot], p);
    const int e = mp.local_ids[slot];
    EXPECT_GE(p, mp.expert_offsets[e]);
    EXPECT_LT(p, mp.expert_offsets[e + 1]);
    if (p > 0) {
      const int64_t prev = mp.sorted_slots[p - 1];
      EXPECT_TRUE(mp.local_ids[prev] < e || (mp.local_ids[prev] == e && prev < slot));
    }
  }
  EXPECT_NE(mp.to_string().find("EP32 rank 7: experts [196, 224) of 896"), std::string::npos) << mp.to_string();
}

TEST(ExpertMap, Ep2FilteringMaskedAndEmptyExperts) {
  MoeShape sh{64, 32, 6, 3, 2, 1};  // rank 1: global 3, 4, 5
  const std::vector<int32_t> ids = {0, 3, 5, 1, 2, -1, -1, -1, -1, 5, 3, 0, 5, 2, 3};
  auto r = map_expert_parallel(sh, 5, ids);
  ASSERT_TRUE(r.is_ok());
  const auto& mp = r.value();
  EXPECT_EQ(mp.local_ids, (std::vector<int32_t>{-1, 0, 2, -1, -1, -1, -1, -1, -1, 2, 0, -1, 2, -1, 0}));
  EXPECT_EQ(mp.rows_per_expert, (std::vector<int64_t>{3, 0, 3}));  // global 4 gets no token
  EXPECT_EQ(mp.expert_offsets, (std::vector<int64_t>{0, 3, 3, 6}));
  EXPECT_EQ(mp.sorted_slots, (std::vector<int64_t>{1, 10, 14, 2, 9, 12}));
  EXPECT_EQ(mp.masked_slots, 4);
  EXPECT_EQ(mp.remote_slots, 5);
  const ExpertLoad l = mp.load();
  EXPECT_EQ(l.empty, 1);
  EXPECT_EQ(l.max, 3);
  EXPECT_EQ(l.p50, 3);
  EXPECT_DOUBLE_EQ(l.mean, 2.0);
  // Padding: 3 rows -> 8 each, the empty expert takes none.
  auto p = pad_to_block(mp, 8);
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(p->padded_offsets, (std::vector<int64_t>{0, 8, 8, 16}));
  EXPECT_EQ(p->sorted_to_padded, (std::vector<int64_t>{0, 1, 2, 8, 9, 10}));
  EXPECT_EQ(p->padded_rows, 16);
  EXPECT_DOUBLE_EQ(p->padding_fraction, 10.0 / 16.0);
  EXPECT_EQ(p->to_string(), "block 8: 16 padded rows for 6 real, padding 62.5 %");
}

TEST(ExpertMap, PaddingForEveryBlockSize) {
  MoeShape sh{64, 32, 40, 5, 1, 0};
  std::mt19937_64 rng(3);
  const int64_t m = 37;
  std::vector<int32_t> ids(m * 5);
  for (auto& v : ids) v = static_cast<int32_t>(rng() % 41) - 1;  // includes -1
  auto r = map_expert_parallel(sh, m, ids);
  ASSERT_TRUE(r.is_ok());
  for (int block : kRowBlocks) {
    auto p = pad_to_block(r.value(), block);
    ASSERT_TRUE(p.is_ok());
    int64_t want = 0;
    for (int64_t rows : r->rows_per_expert) want += (rows + block - 1) / block * block;
    EXPECT_EQ(p->padded_rows, want);
    for (int e = 0; e < 40; ++e) EXPECT_EQ(p->padded_offsets[e] % block, 0);
    std::vector<int64_t> seen = p->sorted_to_padded;  // distinct rows inside the buffer
    std::sort(seen.begin(), seen.end());
    EXPECT_EQ(std::adjacent_find(seen.begin(), seen.end()), seen.end());
    EXPECT_LT(seen.back(), p->padded_rows);
  }
}

// An uneven partition: 7 experts on 3 ranks are [0, 3), [3, 5) and [5, 7); every valid slot is
// local on exactly one rank, with its id less that rank's first expert.
TEST(ExpertMap, UnevenPartitionMapsEverySlotToExactlyOneRank) {
  const std::vector<int32_t> ids = {0, 2, 3, -1, 4, 5, 6, 1, 2, 6, 3, 0};  // M 4, top-3
  std::vector<int> seen(ids.size(), 0);
  const int first[] = {0, 3, 5}, count[] = {3, 2, 2};
  for (int r = 0; r < 3; ++r) {
    const MoeShape sh{64, 32, 7, 3, 3, r};
    auto m = map_expert_parallel(sh, 4, ids);
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    EXPECT_EQ(m->first_local, first[r]);
    EXPECT_EQ(m->local_experts, count[r]);
    ASSERT_EQ(m->rows_per_expert.size(), static_cast<size_t>(count[r]));
    for (size_t i = 0; i < ids.size(); ++i) {
      const int32_t id = ids[i];
      const bool mine = id >= first[r] && id < first[r] + count[r];
      EXPECT_EQ(m->local_ids[i], mine ? id - first[r] : -1) << "rank " << r << " slot " << i;
      seen[i] += mine;
      if (id >= 0) {
        EXPECT_EQ(sh.owner_of(id) == r, mine);
      }
    }
  }
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(seen[i], ids[i] >= 0 ? 1 : 0) << "slot " << i;
}

TEST(ExpertMap, ErrorsAndEmptyInput) {
  MoeShape sh{64, 32, 6, 3, 2, 0};
  std::vector<int32_t> ids = {0, 1, 6};
  EXPECT_NE(map_expert_parallel(sh, 1, ids).status().message().find("ids[0, 2] = 6 must be -1"), std::string::npos);
  ids[2] = -2;
  EXPECT_FALSE(map_expert_parallel(sh, 1, ids).is_ok());
  EXPECT_NE(map_expert_parallel(sh, 2, ids).status().message().find("ids [M, top_k] has 3 elements, expected 6"),
            std::string::npos);
  EXPECT_NE(map_expert_parallel(sh, -1, ids).status().message().find("m = -1"), std::string::npos);
  sh.ep_size = 7;
  EXPECT_NE(map_expert_parallel(sh, 1, ids).status().message().find("ep_size = 7 must be in [1, num_experts = 6]"),
            std::string::npos);
  sh.ep_size = 2;
  auto empty = map_expert_parallel(sh, 0, {});
  ASSERT_TRUE(empty.is_ok());
  auto p = pad_to_block(empty.value(), 64);
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(p->padded_rows, 0);
  EXPECT_EQ(p->padding_fraction, 0.0);
  EXPECT_NE(pad_to_block(empty.value(), 12).status().message().find("row block = 12 must be 8, 16, 32 or 64"),
            std::string::npos);
  EpMapping broken = empty.value();
  broken.rows_per_expert[1] = 5;
  EXPECT_FALSE(pad_to_block(broken, 8).is_ok());
}

// The shared permutation against a direct stable sort, on every split of the tokens into chunks
// (how the CPU backend runs it) and with remote, masked and invalid ids.
TEST(ExpertMap, SortLocalSlotsIsTheStableSortByExpert) {
  std::mt19937 rng(4);
  const int top_k = 5, first = 8, el = 6;
  for (int64_t tokens : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{40}}) {
    std::vector<int32_t> ids(static_cast<size_t>(tokens * top_k));
    for (auto& id : ids) id = static_cast<int32_t>(rng() % 24) - 2;  // -2 (invalid), -1 (masked), remote, local
    std::vector<int64_t> off(el + 1);
    std::vector<int32_t> slot_row(ids.size()), row_token(ids.size());
    ASSERT_TRUE(sort_local_slots(ids, top_k, first, el, off, slot_row, row_token).is_ok());
    // Direct: rows in (expert, slot) order.
    std::vector<std::pair<int, int64_t>> want;
    for (int64_t i = 0; i < static_cast<int64_t>(ids.size()); ++i) {
      if (ids[static_cast<size_t>(i)] >= first && ids[static_cast<size_t>(i)] < first + el) {
        want.push_back({ids[static_cast<size_t>(i)] - first, i});
      }
    }
    std::stable_sort(want.begin(), want.end(), [](auto a, auto b) { return a.first < b.first; });
    ASSERT_EQ(off[el], static_cast<int64_t>(want.size()));
    for (size_t r = 0; r < want.size(); ++r) {
      const auto [e, slot] = want[r];
      EXPECT_GE(static_cast<int64_t>(r), off[static_cast<size_t>(e)]);
      EXPECT_LT(static_cast<int64_t>(r), off[static_cast<size_t>(e) + 1]);
      EXPECT_EQ(slot_row[static_cast<size_t>(slot)], static_cast<int32_t>(r));
      EXPECT_EQ(row_token[r], static_cast<int32_t>(slot / top_k));
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < first || ids[i] >= first + el) {
        EXPECT_EQ(slot_row[i], -1);
      }
    }
    // map_expert_parallel is the same permutation (valid ids only).
    std::vector<int32_t> valid = ids;
    for (auto& id : valid) id = id < -1 ? -1 : id;
    const MoeShape sh{64, 32, 24, top_k, 4, 1};  // rank 1 of 4: experts 6..11
    auto map = map_expert_parallel(sh, tokens, valid);
    ASSERT_TRUE(map) << map.status().to_string();
    std::vector<int64_t> off2(sh.local_experts() + 1);
    std::vector<int32_t> rows2(valid.size());
    ASSERT_TRUE(sort_local_slots(valid, top_k, sh.first_local_expert(), sh.local_experts(), off2, rows2, {}).is_ok());
    EXPECT_EQ(off2, map->expert_offsets);
    for (size_t i = 0; i < valid.size(); ++i) EXPECT_EQ(rows2[i], map->slot_to_sorted[i]);
  }
  std::vector<int32_t> ids(10, 0);
  std::vector<int64_t> off(3);
  std::vector<int32_t> rows(10);
  EXPECT_FALSE(sort_local_slots(ids, 3, 0, 2, off, rows, {}).is_ok());            // 10 not a multiple of 3
  EXPECT_FALSE(sort_local_slots(ids, 5, 0, 3, off, rows, {}).is_ok());            // offsets too short
  EXPECT_FALSE(sort_local_slots(ids, 5, 0, 2, off, rows, std::span<int32_t>(rows).first(3)).is_ok());  // 10 local rows
}

}  // namespace
}  // namespace k3
