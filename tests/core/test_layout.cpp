// Gated FC1 layout conversions: exact row moves of codes and scales, round trips, composition,
// agreement with the definitions of the three layouts, and argument errors.
#include <gtest/gtest.h>
#include <omp.h>

#include <random>

#include "k3/layout.hpp"
#include "k3/mx.hpp"

namespace k3 {
namespace {

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg)

constexpr GatedLayout kAll[] = {GatedLayout::kGateUp, GatedLayout::kUpGate, GatedLayout::kInterleaved};

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

struct Fc1 {
  int64_t e, n, k;
  std::vector<uint8_t> q, s;
  Fc1(int64_t e_, int64_t n_, int64_t k_, uint32_t seed)
      : e(e_), n(n_), k(k_), q(random_bytes(static_cast<size_t>(e_ * 2 * n_ * k_ / 2), seed)),
        s(random_bytes(static_cast<size_t>(e_ * 2 * n_ * k_ / 32), seed + 1)) {}
  Fc1 convert(GatedLayout from, GatedLayout to) const {
    Fc1 out = *this;
    EXPECT_TRUE(convert_fc1_layout(q, s, e, n, k, from, to, out.q, out.s).is_ok());
    return out;
  }
};

TEST(GatedLayout, MatchesTheLayoutDefinitions) {
  // Explicit row maps for N = 3: gate rows g0 g1 g2, up rows u0 u1 u2.
  const int64_t n = 3;
  const int64_t gate_up[] = {0, 1, 2, 3, 4, 5};      // g0 g1 g2 u0 u1 u2
  const int64_t up_gate[] = {3, 4, 5, 0, 1, 2};      // position of g0.. then u0.. in [up; gate]
  const int64_t interleaved[] = {0, 2, 4, 1, 3, 5};  // g0 u0 g1 u1 g2 u2
  for (int half = 0; half < 2; ++half) {
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(gated_row(GatedLayout::kGateUp, half, i, n), gate_up[half * n + i]);
      EXPECT_EQ(gated_row(GatedLayout::kUpGate, half, i, n), up_gate[half * n + i]);
      EXPECT_EQ(gated_row(GatedLayout::kInterleaved, half, i, n), interleaved[half * n + i]);
    }
  }
  // Bytes: a [gate; up] matrix with one byte per row reads g0 u0 g1 u1 ... once interleaved.
  const std::vector<uint8_t> src = {10, 11, 12, 20, 21, 22};  // g0 g1 g2 u0 u1 u2
  std::vector<uint8_t> dst(6);
  ASSERT_TRUE(convert_gated_rows(src, dst, 1, 3, 1, GatedLayout::kGateUp, GatedLayout::kInterleaved).is_ok());
  EXPECT_EQ(dst, (std::vector<uint8_t>{10, 20, 11, 21, 12, 22}));
  ASSERT_TRUE(convert_gated_rows(src, dst, 1, 3, 1, GatedLayout::kGateUp, GatedLayout::kUpGate).is_ok());
  EXPECT_EQ(dst, (std::vector<uint8_t>{20, 21, 22, 10, 11, 12}));
}

TEST(GatedLayout, RoundTripsAndComposesBitExactly) {
  for (const auto& [e, n, k] : {std::tuple<int64_t, int64_t, int64_t>{5, 160, 96}, {2, 32, 64}, {1, 1, 32}}) {
    const Fc1 a(e, n, k, static_cast<uint32_t>(e * 1000 + n));
    for (const auto from : kAll) {
      for (const auto to : kAll) {
        const Fc1 b = a.convert(from, to);
        const Fc1 back = b.convert(to, from);
        EXPECT_EQ(back.q, a.q) << gated_layout_name(from) << " -> " << gated_layout_name(to);
        EXPECT_EQ(back.s, a.s);
        if (from == to) {
          EXPECT_EQ(b.q, a.q);
        }
        for (const auto via : kAll) {
          const Fc1 c = a.convert(from, via).convert(via, to);
          EXPECT_EQ(c.q, b.q) << "via " << gated_layout_name(via);
          EXPECT_EQ(c.s, b.s);
        }
      }
    }
  }
}

TEST(GatedLayout, CodesAndScalesMoveTogether) {
  // Dequantized rows after conversion are exactly the permuted dequantized rows.
  const int64_t e = 3, n = 40, k = 96;
  const Fc1 a(e, n, k, 99);
  std::vector<uint8_t> scales = a.s;
  for (auto& s : scales) s = static_cast<uint8_t>(110 + s % 30);  // finite scales, no NaN blocks
  Fc1 src = a;
  src.s = scales;
  const Fc1 dst = src.convert(GatedLayout::kGateUp, GatedLayout::kInterleaved);
  std::vector<float> before(static_cast<size_t>(e * 2 * n * k)), after(before.size());
  ASSERT_TRUE(mx_dequantize(src.q, src.s, e * 2 * n, k, MxElement::kE2M1, before).is_ok());
  ASSERT_TRUE(mx_dequantize(dst.q, dst.s, e * 2 * n, k, MxElement::kE2M1, after).is_ok());
  int mismatches = 0;
  for (int64_t x = 0; x < e; ++x) {
    for (int half = 0; half < 2; ++half) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t rs = x * 2 * n + gated_row(GatedLayout::kGateUp, half, i, n);
        const int64_t rd = x * 2 * n + gated_row(GatedLayout::kInterleaved, half, i, n);
        for (int64_t c = 0; c < k; ++c) {
          mismatches += before[static_cast<size_t>(rs * k + c)] != after[static_cast<size_t>(rd * k + c)];
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(GatedLayout, SameBitsForAnyThreadCount) {
  const Fc1 a(1, 1024, 4096, 5);  // 4 MB of codes: large enough for the threaded path
  const int saved = omp_get_max_threads();
  std::vector<uint8_t> ref;
  for (const int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    const Fc1 b = a.convert(GatedLayout::kInterleaved, GatedLayout::kUpGate);
    if (ref.empty()) ref = b.q;
    EXPECT_EQ(b.q, ref) << threads;
  }
  omp_set_num_threads(saved);
}

TEST(GatedLayout, NamesAndErrors) {
  for (const auto l : kAll) EXPECT_EQ(parse_gated_layout(gated_layout_name(l)).value(), l);
  EXPECT_EQ(parse_gated_layout("w31").value(), GatedLayout::kUpGate);
  EXPECT_EQ(parse_gated_layout("w13").value(), GatedLayout::kGateUp);
  EXPECT_EQ(parse_gated_layout("gpt_oss").value(), GatedLayout::kInterleaved);
  EXPECT_HAS(parse_gated_layout("gate-up").status().message(), "layout 'gate-up' is unknown");

  Fc1 a(2, 32, 64, 1);
  std::vector<uint8_t> q_out(a.q.size()), s_out(a.s.size());
  const auto gu = GatedLayout::kGateUp, ug = GatedLayout::kUpGate;
  EXPECT_HAS(convert_fc1_layout(a.q, a.s, 2, 32, 48, gu, ug, q_out, s_out).message(),
             "k = 48 must be a positive multiple of 32");
  EXPECT_HAS(convert_fc1_layout(a.q, a.s, 3, 32, 64, gu, ug, q_out, s_out).message(),
             "FC1 codes [E, 2N, K/2]: src has 4096 bytes, expected [experts 3, 2n 64, 32] = 6144");
  std::vector<uint8_t> short_s(a.s.size() - 1);
  EXPECT_HAS(convert_fc1_layout(a.q, a.s, 2, 32, 64, gu, ug, q_out, short_s).message(),
             "FC1 scales [E, 2N, K/32]: dst has 255 bytes, expected 256");
  EXPECT_HAS(convert_gated_rows(a.q, a.q, 2, 32, 32, gu, ug).message(), "src and dst overlap");
  EXPECT_HAS(convert_gated_rows(a.q, q_out, 2, 0, 32, gu, ug).message(), "n = 0 (rows per half) must be positive");
  EXPECT_HAS(convert_gated_rows(a.q, q_out, -1, 32, 32, gu, ug).message(), "experts = -1 must be >= 0");
  EXPECT_TRUE(convert_gated_rows({}, {}, 0, 4, 16, gu, ug).is_ok());  // no experts: nothing to do
}

}  // namespace
}  // namespace k3
