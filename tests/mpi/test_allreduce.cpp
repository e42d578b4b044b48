// The exact all-reduce (k3/allreduce.hpp) at 1, 2, 4 and 8 ranks: identical bits for every world
// size (contributions whose exact sum is the same tensor e at every W, compared with the
// one-process result for e), agreement with an FP64 reference, independence of which rank holds
// which contribution, ranks without rows, and one rank's bad argument failing every rank.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "k3/allreduce.hpp"
#include "k3/harness/comm_bench.hpp"
#include "k3/formats.hpp"
#include "mpi/mpi_world.hpp"

namespace {

using k3::bf16_from_f32;
using k3::bf16_to_f32;
using k3::comm::Communicator;

// Random finite BF16: the whole exponent range (wide) or 2^-17 ... 2^12 (narrow).
uint16_t random_finite(std::mt19937_64& rng, bool wide) {
  for (;;) {
    auto h = static_cast<uint16_t>(rng());
    if (!wide) h = static_cast<uint16_t>((h & 0x807Fu) | (static_cast<uint32_t>(110 + rng() % 30) << 7));
    if ((h & 0x7F80u) != 0x7F80u) return h;
  }
}

// +-2^k as BF16 bits, k in [-133, 127].
uint16_t pow2(int k, bool negative) {
  const uint32_t mag = k >= -126 ? static_cast<uint32_t>(k + 127) << 7 : 1u << (k + 133);
  return static_cast<uint16_t>(mag | (negative ? 0x8000u : 0u));
}

// contributions[q][k] for W ranks whose exact sum is e[k] for every k (see the file comment):
// the significand bits of e[k] are spread over the ranks as exact BF16 pieces, and for W >= 3 two
// ranks also hold +B and -B with B = 2^(exponent(e) + 40, 70 or 110) (at most 2^127), so that a
// rank-order FP32 sum loses the pieces added after +B.
std::vector<std::vector<uint16_t>> split_exactly(const std::vector<uint16_t>& e, int w) {
  std::vector<std::vector<uint16_t>> c(static_cast<size_t>(w), std::vector<uint16_t>(e.size(), 0));
  for (size_t k = 0; k < e.size(); ++k) {
    const uint16_t h = e[k];
    const uint32_t ex = (h >> 7) & 0xFFu, m = h & 0x7Fu;
    const bool neg = (h & 0x8000u) != 0;
    if (ex == 0xFF || (ex == 0 && m == 0)) {  // Inf, NaN, +-0: one holder; -0 on every rank
      for (int q = 0; q < w; ++q) c[static_cast<size_t>(q)][k] = h == 0x8000 ? h : 0;
      c[k % static_cast<size_t>(w)][k] = h;
      continue;
    }
    const uint32_t sig = ex != 0 ? (m | 0x80u) : m;
    const int base = (ex != 0 ? static_cast<int>(ex) : 1) - 134;  // e = sig * 2^base
    std::vector<int> holders;
    int a = -1, b = -1;
    if (w >= 3) {
      a = static_cast<int>(k % static_cast<size_t>(w));
      b = (a + 1 + static_cast<int>((k / static_cast<size_t>(w)) % static_cast<size_t>(w - 1))) % w;
      const int top = base + 7 - std::countl_zero(static_cast<uint8_t>(sig));  // exponent of e
      const int kb = std::min(127, top + (k % 3 == 0 ? 40 : k % 3 == 1 ? 70 : 110));
      const bool bneg = (k / 3) % 2 == 1;
      c[static_cast<size_t>(a)][k] = pow2(kb, bneg);
      c[static_cast<size_t>(b)][k] = pow2(kb, !bneg);
    }
    for (int q = 0; q < w; ++q) {
      if (q != a && q != b) holders.push_back(q);
    }
    std::vector<uint32_t> part(static_cast<size_t>(w), 0);
    for (uint32_t j = 0; j < 8; ++j) {
      if (sig & (1u << j)) part[static_cast<size_t>(holders[(j + k) % holders.size()])] |= 1u << j;
    }
    for (const int q : holders) {
      const float v = std::ldexp(static_cast<float>(part[static_cast<size_t>(q)]), base);  // exact
      c[static_cast<size_t>(q)][k] = static_cast<uint16_t>(bf16_from_f32(v) | (neg && v != 0 ? 0x8000u : 0u));
    }
  }
  return c;
}

std::vector<uint16_t> wide_tensor(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (auto& h : v) h = random_finite(rng, true);
  if (n > 40) {
    v[3] = 0x8000;  // -0
    v[7] = 0x0000;
    v[11] = 0x7F80;  // +Inf
    v[13] = 0xFFC1;  // NaN
    v[17] = 0x0001;  // smallest subnormal
    v[19] = 0x7F7F;  // largest finite
  }
  return v;
}

struct Outputs {
  std::vector<uint16_t> sum, norm, res;
};

Outputs run_ops(Communicator& c, const std::vector<uint16_t>& x, const std::vector<uint16_t>& residual,
                const std::vector<uint16_t>& gamma, int64_t rows, int64_t cols, k3::comm::AllreduceOptions opt = {}) {
  Outputs o{std::vector<uint16_t>(x.size()), std::vector<uint16_t>(x.size()), std::vector<uint16_t>(x.size())};
  const auto s1 = k3::comm::allreduce_bf16(c, x, rows, cols, o.sum, opt);
  EXPECT_TRUE(s1.is_ok()) << s1.to_string();
  const auto s2 = k3::comm::allreduce_add_rmsnorm_bf16(c, x, residual, gamma, rows, cols, 1e-6f, o.norm, o.res, opt);
  EXPECT_TRUE(s2.is_ok()) << s2.to_string();
  return o;
}

std::vector<uint16_t> gamma_of(int64_t cols) {
  std::vector<uint16_t> g(static_cast<size_t>(cols));
  for (int64_t j = 0; j < cols; ++j) g[static_cast<size_t>(j)] = bf16_from_f32(0.75f + 0.01f * static_cast<float>(j % 50));
  return g;
}

TEST(MpiAllreduce, BitwiseIdenticalAcrossWorldSizes) {
  Communicator& w = k3test::world();
  auto self = k3::comm::make_self_communicator();
  const int n = w.size();
  int naive_differs = 0;
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{9, 3584}, {5, 100}}) {
    const auto e = wide_tensor(rows * cols, 2024 + static_cast<uint64_t>(cols));
    std::mt19937_64 rng(77);
    std::vector<uint16_t> residual(e.size());
    for (auto& h : residual) h = random_finite(rng, false);
    const auto g = gamma_of(cols);
    const Outputs want = run_ops(*self, e, residual, g, rows, cols);
    const auto parts = split_exactly(e, n);
    const Outputs got = run_ops(w, parts[static_cast<size_t>(w.rank())], residual, g, rows, cols, {.threads = 2});
    EXPECT_EQ(got.sum, want.sum) << "rows " << rows << " cols " << cols;
    EXPECT_EQ(got.norm, want.norm) << "rows " << rows << " cols " << cols;
    EXPECT_EQ(got.res, want.res) << "rows " << rows << " cols " << cols;
    for (size_t k = 0; k < e.size(); ++k) {  // what a rank-order FP32 sum would give
      float acc = 0.0f;
      for (int q = 0; q < n; ++q) acc += bf16_to_f32(parts[static_cast<size_t>(q)][k]);
      naive_differs += bf16_from_f32(acc) != want.sum[k] ? 1 : 0;
    }
  }
  // An FP32 add of two values is correctly rounded, so W = 1 and 2 cannot show the difference;
  // from W = 3 on the naive sum must differ somewhere (else this test would prove nothing).
  if (n >= 3) {
    EXPECT_GT(naive_differs, 1000);
  }
}

// Rank q's contribution: pseudo-random from seed 100 + q (every rank can regenerate all of them).
std::vector<uint16_t> contribution(int q, int64_t n, bool wide) {
  std::mt19937_64 rng(100 + static_cast<uint64_t>(q));
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (auto& h : v) h = random_finite(rng, wide);
  return v;
}

// FP64 reference for narrow contributions (their FP64 sum is exact: < 53 bits of span).
void expect_matches_fp64(const Outputs& got, int w, int64_t rows, int64_t cols, const std::vector<uint16_t>& residual,
                         const std::vector<uint16_t>& g) {
  const int64_t n = rows * cols;
  std::vector<double> s(static_cast<size_t>(n), 0.0);
  for (int q = 0; q < w; ++q) {
    const auto c = contribution(q, n, false);
    for (size_t k = 0; k < s.size(); ++k) s[k] += bf16_to_f32(c[k]);
  }
  for (int64_t i = 0; i < rows; ++i) {
    double ss = 0;
    std::vector<double> r(static_cast<size_t>(cols));
    for (int64_t j = 0; j < cols; ++j) {
      const auto k = static_cast<size_t>(i * cols + j);
      const float sf = static_cast<float>(s[k]);
      ASSERT_EQ(got.sum[k], bf16_from_f32(sf)) << "element " << k;
      const uint16_t ro = bf16_from_f32(sf + bf16_to_f32(residual[k]));
      ASSERT_EQ(got.res[k], ro) << "element " << k;
      r[static_cast<size_t>(j)] = bf16_to_f32(ro);
      ss += r[static_cast<size_t>(j)] * r[static_cast<size_t>(j)];
    }
    const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(cols) + 1e-6);
    for (int64_t j = 0; j < cols; ++j) {
      const auto k = static_cast<size_t>(i * cols + j);
      const double y = r[static_cast<size_t>(j)] * rstd * bf16_to_f32(g[static_cast<size_t>(j)]);
      const double ulp = std::ldexp(1.0, std::max(std::ilogb(y == 0 ? 1e-30 : y), -126) - 7);
      ASSERT_LE(std::fabs(bf16_to_f32(got.norm[k]) - y), ulp) << "element " << k;
    }
  }
}

TEST(MpiAllreduce, RandomContributionsMatchFp64Reference) {
  Communicator& w = k3test::world();
  const int64_t rows = 7, cols = 300;
  const auto x = contribution(w.rank(), rows * cols, false);
  std::mt19937_64 rng(9);
  std::vector<uint16_t> residual(x.size());
  for (auto& h : residual) h = random_finite(rng, false);
  const auto g = gamma_of(cols);
  const Outputs got = run_ops(w, x, residual, g, rows, cols);
  expect_matches_fp64(got, w.size(), rows, cols, residual, g);
}

uint64_t fnv1a(const std::vector<uint16_t>& v) {
  uint64_t h = 1469598103934665603ull;
  for (const uint16_t x : v) {
    h = (h ^ (x & 0xFFu)) * 1099511628211ull;
    h = (h ^ (x >> 8)) * 1099511628211ull;
  }
  return h;
}

// The seed system's tensor-parallel payloads (docs/distributed.md): T x 7168 and T x 3584 BF16
// for T in {1, 2, 4, 8, 9, 16, 32}, and 1 x 1030 (a row that is not a whole number of 16-byte
// packs). At every world size — nine included, where no payload's row count divides evenly —
// the sum and the residual + RMSNorm epilogue are (1) the one-process result of the exact sum,
// (2) for narrow contributions, the FP64 reference rounded once, (3) the same on every rank and
// (4) the same on a second run with other threads and message rounds (rounds of one row, and
// rounds of W rows with a shorter last one). The shards are 16-byte packs, or rows for the
// epilogue when a round has at least W rows.
TEST(MpiAllreduce, SeedPayloadsAtAnyWorldSizeMatchTheReferenceOnEveryRank) {
  Communicator& w = k3test::world();
  auto self = k3::comm::make_self_communicator();
  const int n = w.size();
  std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1030}};
  for (const int64_t t : {1, 2, 4, 8, 9, 16, 32}) {
    shapes.push_back({t, 7168});
    shapes.push_back({t, 3584});
  }
  for (const auto& [rows, cols] : shapes) {
    SCOPED_TRACE("T " + std::to_string(rows) + " x " + std::to_string(cols) + " at W " + std::to_string(n));
    const auto e = wide_tensor(rows * cols, 31 * static_cast<uint64_t>(rows) + static_cast<uint64_t>(cols));
    std::mt19937_64 rng(static_cast<uint64_t>(rows * cols));
    std::vector<uint16_t> residual(e.size());
    for (auto& h : residual) h = random_finite(rng, false);
    const auto g = gamma_of(cols);
    const Outputs want = run_ops(*self, e, residual, g, rows, cols);
    const auto parts = split_exactly(e, n);
    const Outputs got = run_ops(w, parts[static_cast<size_t>(w.rank())], residual, g, rows, cols);
    EXPECT_EQ(got.sum, want.sum);
    EXPECT_EQ(got.norm, want.norm);
    EXPECT_EQ(got.res, want.res);
    const Outputs again = run_ops(w, parts[static_cast<size_t>(w.rank())], residual, g, rows, cols,
                                  {.threads = 3, .max_call_bytes = 2 * cols * 2});
    EXPECT_EQ(again.sum, got.sum);
    EXPECT_EQ(again.norm, got.norm);
    EXPECT_EQ(again.res, got.res);
    if (rows > n) {  // rounds of W rows (the epilogue shards them by rows), then a last one of fewer (by packs)
      const Outputs mixed = run_ops(w, parts[static_cast<size_t>(w.rank())], residual, g, rows, cols,
                                    {.threads = 2, .max_call_bytes = (2 * n - 1) * 2 * cols + 16 * n});
      EXPECT_EQ(mixed.sum, got.sum);
      EXPECT_EQ(mixed.norm, got.norm);
      EXPECT_EQ(mixed.res, got.res);
    }
    const uint64_t mine[3] = {fnv1a(got.sum), fnv1a(got.norm), fnv1a(got.res)};
    std::vector<uint64_t> all(static_cast<size_t>(3 * n));
    ASSERT_TRUE(w.allgather(mine, sizeof mine, all.data()).is_ok());
    for (int q = 1; q < n; ++q) {
      for (int i = 0; i < 3; ++i) EXPECT_EQ(all[static_cast<size_t>(3 * q + i)], all[static_cast<size_t>(i)]) << "rank " << q;
    }
    if (rows * cols <= 8 * 7168) {  // the independent FP64 reference on narrow contributions
      const auto x = contribution(w.rank(), rows * cols, false);
      expect_matches_fp64(run_ops(w, x, residual, g, rows, cols), n, rows, cols, residual, g);
    }
  }
}

TEST(MpiAllreduce, WhoHoldsWhichContributionDoesNotMatter) {
  Communicator& w = k3test::world();
  const int n = w.size();
  const int64_t rows = 6, cols = 257;
  const auto residual = contribution(999, rows * cols, true);
  const auto g = gamma_of(cols);
  const Outputs fwd = run_ops(w, contribution(w.rank(), rows * cols, true), residual, g, rows, cols);
  const Outputs rev = run_ops(w, contribution(n - 1 - w.rank(), rows * cols, true), residual, g, rows, cols,
                              {.threads = 3, .max_call_bytes = 1200});  // other threads and 1-row rounds too
  EXPECT_EQ(fwd.sum, rev.sum);
  EXPECT_EQ(fwd.norm, rev.norm);
  EXPECT_EQ(fwd.res, rev.res);
}

TEST(MpiAllreduce, FewerRowsThanRanksAndNoRows) {
  Communicator& w = k3test::world();
  const int64_t cols = 5;
  const auto g = gamma_of(cols);
  for (const int64_t rows : {int64_t{1}, static_cast<int64_t>(std::max(1, w.size() - 1)), static_cast<int64_t>(w.size() + 1)}) {
    const auto x = contribution(w.rank(), rows * cols, false);
    std::mt19937_64 rng(9);
    std::vector<uint16_t> residual(x.size());
    for (auto& h : residual) h = random_finite(rng, false);
    const Outputs got = run_ops(w, x, residual, g, rows, cols);
    expect_matches_fp64(got, w.size(), rows, cols, residual, g);
  }
  std::vector<uint16_t> none;
  EXPECT_TRUE(k3::comm::allreduce_bf16(w, none, 0, cols, none).is_ok());
  EXPECT_TRUE(k3::comm::allreduce_add_rmsnorm_bf16(w, none, none, g, 0, cols, 1e-6f, none, none).is_ok());
}

TEST(MpiAllreduce, OneRanksBadArgumentFailsEveryRankWithoutHanging) {
  Communicator& w = k3test::world();
  const int n = w.size(), last = n - 1;
  const int64_t rows = 4, cols = 6;
  std::vector<uint16_t> x(static_cast<size_t>(rows * cols), bf16_from_f32(1.0f)), out(x.size()), rout(x.size());
  const auto g = gamma_of(cols);
  // x one element short on the last rank only
  std::vector<uint16_t> mine = x;
  if (w.rank() == last) mine.pop_back();
  auto st = k3::comm::allreduce_bf16(w, mine, rows, cols, out);
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.code(), k3::StatusCode::kInvalidArgument);
  const std::string want = w.rank() == last ? "x has 23 elements" : "rank " + std::to_string(last) + " of " + std::to_string(n) + " rejected";
  EXPECT_NE(st.message().find(want), std::string::npos) << st.message();
  // eps bad on the last rank only (rmsnorm)
  st = k3::comm::allreduce_add_rmsnorm_bf16(w, x, {}, g, rows, cols, w.rank() == last ? -1.0f : 1e-6f, out, rout);
  ASSERT_FALSE(st.is_ok());
  if (n > 1) {
    // valid on every rank but disagreeing: rows (x sized to match) and gamma
    const int64_t r2 = w.rank() == last ? rows - 1 : rows;
    std::vector<uint16_t> x2(static_cast<size_t>(r2 * cols), bf16_from_f32(1.0f)), o2(x2.size());
    st = k3::comm::allreduce_bf16(w, x2, r2, cols, o2);
    ASSERT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find("rank " + std::to_string(last) + " passed rows = 3 but rank 0 passed 4"), std::string::npos)
        << st.message();
    auto g2 = g;
    if (w.rank() == last) g2[2] = bf16_from_f32(-1.0f);
    st = k3::comm::allreduce_add_rmsnorm_bf16(w, x, {}, g2, rows, cols, 1e-6f, out, rout);
    ASSERT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find("gamma (digest)"), std::string::npos) << st.message();
  }
  // the communicator is still in step: a valid call works on every rank
  ASSERT_TRUE(k3::comm::allreduce_bf16(w, x, rows, cols, out).is_ok());
  EXPECT_EQ(out[0], bf16_from_f32(static_cast<float>(n)));
}

TEST(MpiAllreduce, NativeAllreduceSumsOverRanks) {
  Communicator& w = k3test::world();
  std::vector<float> d = {1.0f, static_cast<float>(w.rank())};
  ASSERT_TRUE(w.native_allreduce_sum_f32(d.data(), 2).is_ok());
  EXPECT_EQ(d[0], static_cast<float>(w.size()));
  EXPECT_EQ(d[1], static_cast<float>(w.size() * (w.size() - 1) / 2));
}

}  // namespace

TEST(MpiAllreduce, BenchReturnsTheSameTableOnEveryRank) {
  Communicator& w = k3test::world();
  const std::vector<int64_t> sizes = {64, 3 * 7168};
  auto t = k3::comm::bench_allreduce(w, sizes, 2, 1);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  ASSERT_EQ(t->size(), 2u);
  EXPECT_EQ((*t)[1].rows, 3);
  EXPECT_EQ((*t)[1].cols, 3584);
  const double mine[3] = {(*t)[1].k3_us, (*t)[1].k3_rmsnorm_us, (*t)[1].native_us};
  std::vector<double> all(3 * static_cast<size_t>(w.size()));
  ASSERT_TRUE(w.allgather(mine, sizeof mine, all.data()).is_ok());
  for (size_t k = 0; k < all.size(); ++k) EXPECT_EQ(all[k], mine[k % 3]) << "rank " << k / 3;
  EXPECT_EQ((*t)[1].k3_busbw_gbs > 0, w.size() > 1);
  // different sizes on one rank: every rank gets the error
  const std::vector<int64_t> other = {w.rank() == w.size() - 1 ? int64_t{128} : int64_t{64}};
  const auto bad = k3::comm::bench_allreduce(w, other, 2, 1);
  EXPECT_EQ(bad.is_ok(), w.size() == 1) << bad.status().to_string();
}

// The benchmark table (k3/harness/comm_bench.hpp), printed by rank 0. Not part of the suite (timings on
// an oversubscribed CI machine mean little); run with
//   mpirun -np 2 tests/k3_mpi_tests --gtest_also_run_disabled_tests --gtest_filter='*BenchTable*'
TEST(MpiAllreduce, DISABLED_BenchTable) {
  Communicator& w = k3test::world();
  std::vector<int64_t> sizes;
  for (int64_t b = int64_t{8} << 10; b <= int64_t{64} << 20; b *= 4) sizes.push_back(b);
  auto t = k3::comm::bench_allreduce(w, sizes, 5, 1);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  if (w.rank() != 0) return;
  std::printf("W=%d %10s %6s %5s %10s %10s %10s %9s %9s\n", w.size(), "bytes", "rows", "cols", "k3_us", "k3norm_us",
              "native_us", "k3_GB/s", "nat_GB/s");
  for (const auto& r : *t) {
    std::printf("    %10lld %6lld %5lld %10.1f %10.1f %10.1f %9.3f %9.3f\n", static_cast<long long>(r.bytes),
                static_cast<long long>(r.rows), static_cast<long long>(r.cols), r.k3_us, r.k3_rmsnorm_us, r.native_us,
                r.k3_busbw_gbs, r.native_busbw_gbs);
  }
}
