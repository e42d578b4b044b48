// Host tests of the sm_120a block-scaled GEMM's layout functions (src/cuda_cutlass/
// moe_sm120_blockscaled_layout.hpp): the very functions its device kernels call. The comparison
// with CUTLASS's own layout is tests/cuda/test_sm120_sf_layout.cu.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cuda_cutlass/moe_sm120_blockscaled_layout.hpp"
#include "k3/mx.hpp"

namespace {

using namespace k3::cuda::sm120_bs;

// Every (row, k-block) of a [rows, k] operand maps to a distinct offset inside the padded buffer,
// and with padding rows / columns included the map is onto: a bijection on the padded shape.
TEST(Sm120BlockScaledLayout, SfOffsetIsABijectionOntoThePaddedBuffer) {
  for (int64_t rows : {1, 31, 32, 127, 128, 129, 300, 512}) {
    for (int64_t k : {128, 256, 384, 1024, 7168}) {
      const int64_t kb = k / 32, bytes = sf_bytes(rows, k);
      ASSERT_EQ(bytes, padded_rows(rows) * ((kb + 3) / 4 * 4));
      std::vector<int> hits(static_cast<size_t>(bytes), 0);
      for (int64_t r = 0; r < padded_rows(rows); ++r) {
        for (int64_t b = 0; b < sf_cols_padded(k); ++b) {
          const int64_t off = sf_offset(r, b, k);
          ASSERT_GE(off, 0);
          ASSERT_LT(off, bytes) << "rows " << rows << " k " << k << " r " << r << " b " << b;
          ++hits[static_cast<size_t>(off)];
        }
      }
      for (int64_t i = 0; i < bytes; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)], 1) << "offset " << i;
    }
  }
}

// The atom: 128 rows x 4 scale columns in 512 bytes, row r at (r % 32) * 16 + (r / 32) * 4,
// atoms along k first, then along rows.
TEST(Sm120BlockScaledLayout, SfOffsetFollowsThe128x4Atom) {
  const int64_t k = 512;  // 16 scale columns = 4 atoms along k
  EXPECT_EQ(sf_offset(0, 0, k), 0);
  EXPECT_EQ(sf_offset(0, 1, k), 1);
  EXPECT_EQ(sf_offset(1, 0, k), 16);
  EXPECT_EQ(sf_offset(32, 0, k), 4);
  EXPECT_EQ(sf_offset(96, 3, k), 15);
  EXPECT_EQ(sf_offset(31, 0, k), 31 * 16);
  EXPECT_EQ(sf_offset(0, 4, k), 512);
  EXPECT_EQ(sf_offset(128, 0, k), 4 * 512);
}

// A group starting at a 128-multiple row sees, from its own base, the layout of its own rows:
// the one-buffer-for-all-groups scheme of the GEMM (group g's SFA pointer = base + offset).
TEST(Sm120BlockScaledLayout, GroupBaseMakesEachGroupSeeItsOwnLayout) {
  for (int64_t k : {128, 640}) {
    for (int64_t start : {0, 128, 384}) {
      for (int64_t r = 0; r < 200; ++r) {
        for (int64_t b = 0; b < k / 32; ++b) {
          EXPECT_EQ(sf_offset(start + r, b, k), group_sf_offset(start, k) + sf_offset(r, b, k));
        }
      }
    }
  }
}

TEST(Sm120BlockScaledLayout, PlaceGroupsPadsClampsAndReportsOverflow) {
  const std::vector<int32_t> counts = {5, 0, 128, 129, -3, 1};
  std::vector<int32_t> rows(counts.size());
  std::vector<int64_t> pad(counts.size() + 1), comp(counts.size() + 1);
  bool overflow = true;
  place_groups(counts.data(), static_cast<int>(counts.size()), row_capacity(263, 6), rows.data(), pad.data(),
               comp.data(), &overflow);
  EXPECT_FALSE(overflow);
  EXPECT_EQ(rows, (std::vector<int32_t>{5, 0, 128, 129, 0, 1}));
  EXPECT_EQ(pad, (std::vector<int64_t>{0, 128, 128, 256, 512, 512, 640}));
  EXPECT_EQ(comp, (std::vector<int64_t>{0, 5, 5, 133, 262, 262, 263}));
  for (int64_t s : pad) EXPECT_EQ(s % kRowAlign, 0);
  // Capacity for 4 x 128 rows: the fourth non-empty group no longer fits and gets 0 rows.
  place_groups(counts.data(), static_cast<int>(counts.size()), 512, rows.data(), pad.data(), comp.data(), &overflow);
  EXPECT_TRUE(overflow);
  EXPECT_EQ(rows, (std::vector<int32_t>{5, 0, 128, 129, 0, 0}));
  EXPECT_EQ(pad[6], 512);
  EXPECT_EQ(comp, (std::vector<int64_t>{0, 5, 5, 133, 262, 262, 263}));  // compact input layout unchanged
}

// row_capacity() holds every split of max_rows_total rows over the groups.
TEST(Sm120BlockScaledLayout, RowCapacityHoldsEverySplit) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    const int groups = 1 + static_cast<int>(rng() % 40);
    const int64_t total = rng() % 3000;
    std::vector<int32_t> counts(static_cast<size_t>(groups), 0);
    for (int64_t i = 0; i < total; ++i) ++counts[rng() % static_cast<uint32_t>(groups)];
    std::vector<int32_t> rows(static_cast<size_t>(groups));
    std::vector<int64_t> pad(static_cast<size_t>(groups) + 1), comp(static_cast<size_t>(groups) + 1);
    bool overflow = true;
    place_groups(counts.data(), groups, row_capacity(total, groups), rows.data(), pad.data(), comp.data(), &overflow);
    ASSERT_FALSE(overflow) << "groups " << groups << " total " << total;
    ASSERT_EQ(comp[static_cast<size_t>(groups)], total);
  }
}

TEST(Sm120BlockScaledLayout, CheckShapeNamesTheArgument) {
  EXPECT_TRUE(check_shape(4, 256, 512).is_ok());
  EXPECT_NE(check_shape(0, 256, 512).message().find("groups = 0"), std::string::npos);
  EXPECT_NE(check_shape(4097, 256, 512).message().find("groups = 4097"), std::string::npos);
  EXPECT_NE(check_shape(4, 48, 512).message().find("n_out = 48"), std::string::npos);
  EXPECT_NE(check_shape(4, 256, 160).message().find("k = 160 must be a positive multiple of 128"), std::string::npos);
}

// The prepacked weights decode, element for element, to the checkpoint's values.
TEST(Sm120BlockScaledLayout, PrepackKeepsCodesAndMovesScalesToTheSfLayout) {
  const int64_t groups = 3, n = 160, k = 384, kb = k / 32;
  std::mt19937 rng(11);
  std::vector<uint8_t> q(static_cast<size_t>(groups * n * k / 2)), s(static_cast<size_t>(groups * n * kb));
  for (auto& v : q) v = static_cast<uint8_t>(rng());
  for (auto& v : s) v = static_cast<uint8_t>(100 + rng() % 50);
  auto w = prepack_weights(q, s, groups, n, k);
  ASSERT_TRUE(w.is_ok()) << w.status().message();
  ASSERT_EQ(w.value().codes.size(), static_cast<size_t>(groups * weight_code_bytes(n, k)));
  ASSERT_EQ(w.value().sf.size(), static_cast<size_t>(groups * weight_sf_bytes(n, k)));
  int64_t padding_nonzero = 0;
  std::vector<bool> used(w.value().sf.size(), false);
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t c = 0; c < k; ++c) {
        const size_t lin = static_cast<size_t>((g * n + r) * k / 2 + c / 2);
        const uint8_t code = c % 2 ? k3::fp4_high(q[lin]) : k3::fp4_low(q[lin]);
        const size_t pl = static_cast<size_t>(g * weight_code_bytes(n, k) + r * k / 2 + c / 2);
        const uint8_t pcode = c % 2 ? k3::fp4_high(w.value().codes[pl]) : k3::fp4_low(w.value().codes[pl]);
        const size_t so = static_cast<size_t>(g * weight_sf_bytes(n, k) + sf_offset(r, c / 32, k));
        used[so] = true;
        const float want = k3::mx_decode_element(code, s[static_cast<size_t>((g * n + r) * kb + c / 32)], k3::MxElement::kE2M1);
        const float got = k3::mx_decode_element(pcode, w.value().sf[so], k3::MxElement::kE2M1);
        ASSERT_EQ(want, got) << g << " " << r << " " << c;
      }
    }
  }
  for (size_t i = 0; i < used.size(); ++i) padding_nonzero += !used[i] && w.value().sf[i] != 0;
  EXPECT_EQ(padding_nonzero, 0);
  EXPECT_FALSE(prepack_weights(std::span<const uint8_t>(q).subspan(1), s, groups, n, k).is_ok());
  EXPECT_NE(prepack_weights(q, s, groups, n, 100).status().message().find("k = 100"), std::string::npos);
}

}  // namespace
