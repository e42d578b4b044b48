// The exact BF16 sum (src/comm/ops/exact_sum.hpp) against an independent bit-array reference,
// and the all-reduce ops (k3/allreduce.hpp) on the one-process communicator: results, the
// RMSNorm epilogue against FP64, and every argument error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "comm/ops/exact_sum.hpp"
#include "k3/allreduce.hpp"
#include "k3/harness/comm_bench.hpp"
#include "k3/formats.hpp"

namespace {

using k3::bf16_from_f32;
using k3::bf16_to_f32;
using k3::f32_to_bits;
namespace detail = k3::comm::detail;

// ---- independent reference: positive and negative parts as plain bit arrays -----------------
// Value of a finite BF16 in units of 2^-133: significand M (with the implicit bit) shifted left
// by max(E, 1) - 1. Sum the positive and negative inputs separately bit by bit (ripple carry),
// subtract, then round to a double with round-to-odd (53 bits: enough for a correct second
// rounding to FP32's 24) and let the hardware round that to FP32.
constexpr int kBits = 400;
using Bits = std::vector<uint8_t>;

void add_bits(Bits& a, uint32_t m, int shift) {
  int carry = 0;
  for (int i = 0; i < kBits; ++i) {
    const int b = (i >= shift && i - shift < 32) ? static_cast<int>((m >> (i - shift)) & 1u) : 0;
    const int t = a[static_cast<size_t>(i)] + b + carry;
    a[static_cast<size_t>(i)] = static_cast<uint8_t>(t & 1);
    carry = t >> 1;
  }
}
int compare_bits(const Bits& a, const Bits& b) {
  for (int i = kBits - 1; i >= 0; --i) {
    if (a[static_cast<size_t>(i)] != b[static_cast<size_t>(i)]) return a[static_cast<size_t>(i)] > b[static_cast<size_t>(i)] ? 1 : -1;
  }
  return 0;
}
Bits sub_bits(const Bits& a, const Bits& b) {  // a >= b
  Bits r(kBits);
  int borrow = 0;
  for (size_t i = 0; i < kBits; ++i) {
    int t = a[i] - b[i] - borrow;
    borrow = t < 0 ? 1 : 0;
    r[i] = static_cast<uint8_t>(t + 2 * borrow);
  }
  return r;
}

float reference_sum(const std::vector<uint16_t>& v) {
  bool nan = false, pinf = false, ninf = false, all_neg_zero = !v.empty();
  Bits pos(kBits), neg(kBits);
  for (const uint16_t h : v) {
    all_neg_zero = all_neg_zero && h == 0x8000;
    const uint32_t e = (h >> 7) & 0xFF, m = h & 0x7F;
    if (e == 0xFF) {
      if (m != 0) nan = true;
      else if (h & 0x8000) ninf = true;
      else pinf = true;
      continue;
    }
    add_bits(h & 0x8000 ? neg : pos, e == 0 ? m : (m | 0x80), e == 0 ? 0 : static_cast<int>(e) - 1);
  }
  if (nan || (pinf && ninf)) return std::numeric_limits<float>::quiet_NaN();
  if (pinf) return std::numeric_limits<float>::infinity();
  if (ninf) return -std::numeric_limits<float>::infinity();
  if (all_neg_zero) return -0.0f;
  const int c = compare_bits(pos, neg);
  if (c == 0) return 0.0f;
  const Bits mag = c > 0 ? sub_bits(pos, neg) : sub_bits(neg, pos);
  int p = kBits - 1;
  while (mag[static_cast<size_t>(p)] == 0) --p;
  const int lo = std::max(0, p - 52);
  uint64_t sig = 0;
  for (int i = p; i >= lo; --i) sig = (sig << 1) | mag[static_cast<size_t>(i)];
  bool sticky = false;
  for (int i = 0; i < lo; ++i) sticky = sticky || mag[static_cast<size_t>(i)] != 0;
  if (sticky) sig |= 1;  // round to odd
  const double d = std::ldexp(static_cast<double>(sig), lo - 133);
  float f;
  if (d >= 0x1.ffffffp127) {  // FLT_MAX + half an ulp and above: RNE gives Inf
    f = std::numeric_limits<float>::infinity();
  } else {
    f = static_cast<float>(d);
  }
  return c > 0 ? f : -f;
}

uint16_t bf(double v) {  // an exactly representable BF16
  const uint16_t h = bf16_from_f32(static_cast<float>(v));
  EXPECT_EQ(static_cast<double>(bf16_to_f32(h)), v) << "not a BF16: " << v;
  return h;
}

uint32_t bits_of(float f) { return std::isnan(f) ? 0x7FC00000u : f32_to_bits(f); }

// Checks both the full path and the fixed-point fallback alone against the reference.
void expect_sum(const std::vector<uint16_t>& v, float want) {
  const auto n = static_cast<int64_t>(v.size());
  EXPECT_EQ(bits_of(detail::exact_sum_bf16(v.data(), 1, n)), bits_of(want)) << "fast+fallback";
  EXPECT_EQ(bits_of(detail::exact_sum_bf16_fixed(v.data(), 1, n)), bits_of(want)) << "fallback only";
  EXPECT_EQ(bits_of(reference_sum(v)), bits_of(want)) << "reference";
}

TEST(AllreduceExactSum, CancellationOfHugeTerms) {
  expect_sum({bf(0x1p100), bf(1.0), bf(-0x1p100)}, 1.0f);
  expect_sum({bf(0x1p127), bf(0x1p-133), bf(-0x1p127)}, 0x1p-133f);
  expect_sum({bf(-0x1p120), bf(0x1p-100), bf(0x1p120), bf(0x1p-100)}, 0x1p-99f);
}

TEST(AllreduceExactSum, SubnormalBf16Inputs) {
  const uint16_t tiny = 0x0001;  // 2^-133
  expect_sum({tiny, tiny, tiny}, 3 * 0x1p-133f);
  expect_sum({0x007F, 0x0001}, 0x1p-126f);  // 127 + 1 units: the smallest normal FP32
  expect_sum({0x8005, 0x0003}, -2 * 0x1p-133f);
  expect_sum({0x007F, bf(0x1p60), bf(-0x1p60)}, 127 * 0x1p-133f);
}

TEST(AllreduceExactSum, RoundsToNearestEven) {
  // fast path (exact in FP64)
  expect_sum({bf(0x1p24), bf(1.0)}, 0x1p24f);                 // tie, even below
  expect_sum({bf(0x1p24), bf(2.0), bf(1.0)}, 0x1p24f + 4);    // tie, even above
  expect_sum({bf(0x1p24), bf(1.0), bf(0x1p-20)}, 0x1p24f + 2);  // above the tie
  // fallback (FP64 inexact): ties and near-ties at 2^120
  expect_sum({bf(0x1p120), bf(0x1p96), bf(0x1p-100), bf(-0x1p-100)}, 0x1p120f);
  expect_sum({bf(0x1p120), bf(0x1p96), bf(0x1p-100)}, 0x1p120f + 0x1p97f);
  expect_sum({bf(0x1p120), bf(0x1p96), bf(-0x1p-100)}, 0x1p120f);
  expect_sum({bf(0x1p120), bf(0x1p97), bf(0x1p96), bf(0x1p-120)}, 0x1p120f + 0x1p98f);
  expect_sum({bf(-0x1p120), bf(-0x1p97), bf(-0x1p96), bf(-0x1p-120)}, -(0x1p120f + 0x1p98f));
}

TEST(AllreduceExactSum, OverflowToInfAsRneGives) {
  std::vector<uint16_t> flt_max;  // 2^104 + ... + 2^127 = FLT_MAX exactly
  for (int k = 104; k <= 127; ++k) flt_max.push_back(bf(std::ldexp(1.0, k)));
  const float fmax = std::numeric_limits<float>::max();
  expect_sum(flt_max, fmax);
  auto with = [&](std::vector<uint16_t> extra) {
    std::vector<uint16_t> v = flt_max;
    v.insert(v.end(), extra.begin(), extra.end());
    return v;
  };
  const float inf = std::numeric_limits<float>::infinity();
  expect_sum(with({bf(0x1p103)}), inf);                      // the tie: rounds to even = 2^128
  expect_sum(with({bf(0x1p102)}), fmax);                     // below the tie
  expect_sum(with({bf(0x1p103), bf(-0x1p-133)}), fmax);      // just below the tie (fallback)
  expect_sum(with({bf(0x1p102), bf(0x1p102), bf(0x1p-133)}), inf);
  expect_sum({0x7F7F, 0x7F7F}, inf);
  expect_sum({0xFF7F, 0xFF7F, 0x7F7F, 0xFF7F}, -inf);
  expect_sum({0x7F7F, 0x7F7F, 0xFF7F}, bf16_to_f32(0x7F7F));  // no overflow of the exact sum
}

TEST(AllreduceExactSum, NanAndInfClasses) {
  const uint16_t pinf = 0x7F80, ninf = 0xFF80, nan = 0x7FC1, snan = 0xFF81;
  const float inf = std::numeric_limits<float>::infinity(), qnan = std::numeric_limits<float>::quiet_NaN();
  expect_sum({nan}, qnan);
  expect_sum({snan, bf(1.0)}, qnan);
  expect_sum({pinf, bf(1.0)}, inf);
  expect_sum({bf(-0x1p127), pinf, bf(-0x1p127)}, inf);
  expect_sum({ninf, ninf}, -inf);
  expect_sum({pinf, ninf}, qnan);
  expect_sum({nan, pinf}, qnan);
  expect_sum({bf(1.0), ninf, bf(0x1p-133)}, -inf);
}

TEST(AllreduceExactSum, SignOfZero) {
  expect_sum({0x8000}, -0.0f);
  expect_sum({0x8000, 0x8000, 0x8000}, -0.0f);
  expect_sum({0x8000, 0x0000}, 0.0f);
  expect_sum({bf(1.0), bf(-1.0)}, 0.0f);
  expect_sum({bf(-0x1p100), bf(0x1p-100), bf(0x1p100), bf(-0x1p-100)}, 0.0f);
  EXPECT_EQ(bits_of(detail::exact_sum_bf16(nullptr, 1, 0)), 0u);
}

// Random finite BF16 with exponents from the whole range or a narrow band.
uint16_t random_finite(std::mt19937_64& rng, bool wide) {
  for (;;) {
    auto h = static_cast<uint16_t>(rng());
    if (!wide) {
      const auto e = static_cast<uint32_t>(110 + rng() % 30);
      h = static_cast<uint16_t>((h & 0x807Fu) | (e << 7));
    }
    if ((h & 0x7F80u) != 0x7F80u) return h;
  }
}

TEST(AllreduceExactSum, FuzzAgainstBitArrayReferenceAndOrderInvariance) {
  std::mt19937_64 rng(12345);
  int fallbacks = 0;
  for (int it = 0; it < 6000; ++it) {
    const int n = 1 + static_cast<int>(rng() % 40);
    const int mode = static_cast<int>(rng() % 4);
    std::vector<uint16_t> v;
    for (int i = 0; i < n; ++i) v.push_back(random_finite(rng, mode != 1));
    if (mode == 2) {  // cancelling pairs
      for (int i = 0; i < n && v.size() < 60; ++i) v.push_back(static_cast<uint16_t>(v[static_cast<size_t>(i)] ^ 0x8000u));
      v.push_back(random_finite(rng, true));
    }
    if (mode == 3 && rng() % 8 == 0) v.push_back(static_cast<uint16_t>(rng() % 2 ? 0x7F80 : 0xFFC0));  // non-finite
    if (mode == 3 && rng() % 4 == 0) v.push_back(static_cast<uint16_t>(rng() % 2 ? 0x7F7F : 0xFF7F));  // near overflow
    std::shuffle(v.begin(), v.end(), rng);
    const float want = reference_sum(v);
    const auto len = static_cast<int64_t>(v.size());
    ASSERT_EQ(bits_of(detail::exact_sum_bf16(v.data(), 1, len)), bits_of(want)) << "iteration " << it;
    ASSERT_EQ(bits_of(detail::exact_sum_bf16_fixed(v.data(), 1, len)), bits_of(want)) << "iteration " << it;
    std::reverse(v.begin(), v.end());
    ASSERT_EQ(bits_of(detail::exact_sum_bf16(v.data(), 1, len)), bits_of(want)) << "reversed, iteration " << it;
    double s = 0;
    bool inexact = false;
    for (const uint16_t h : v) inexact = detail::two_sum_inexact(s, static_cast<double>(bf16_to_f32(h))) || inexact;
    fallbacks += inexact ? 1 : 0;
  }
  EXPECT_GT(fallbacks, 1000);  // both paths are exercised
}

TEST(AllreduceExactSum, ManyAddsAndStridedInputs) {
  // 3 * 2^20 additions of the largest BF16 with alternating signs plus one tiny term.
  detail::Bf16FixedAccumulator acc;
  for (int i = 0; i < (3 << 20); ++i) acc.add(i % 3 == 2 ? 0xFF7F : 0x7F7F);
  acc.add(0x0001);
  // (2^20 net copies of 0x7F7F) = 255 * 2^140 overflows FP32.
  EXPECT_EQ(acc.to_f32(), std::numeric_limits<float>::infinity());
  const std::vector<uint16_t> v = {bf(1.0), 0xAAAA, bf(2.0), 0xBBBB, bf(-0x1p80), 0xCCCC, bf(0x1p80), 0xDDDD};
  EXPECT_EQ(detail::exact_sum_bf16(v.data(), 2, 4), 3.0f);
  EXPECT_EQ(detail::exact_sum_bf16_fixed(v.data(), 2, 4), 3.0f);
}

// ---- the ops on the one-process communicator -----------------------------------------------

std::vector<uint16_t> random_tensor(int64_t n, uint64_t seed, bool wide) {
  std::mt19937_64 rng(seed);
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (auto& h : v) h = random_finite(rng, wide);
  return v;
}

TEST(AllreduceSelf, AllreduceIsBf16OfTheInput) {
  auto self = k3::comm::make_self_communicator();
  const int64_t rows = 5, cols = 37;
  auto x = random_tensor(rows * cols, 7, true);
  x[3] = 0x8000;
  x[4] = 0x7F80;
  x[5] = 0xFFC3;  // NaN -> canonical 0x7FFF
  std::vector<uint16_t> out(x.size());
  ASSERT_TRUE(k3::comm::allreduce_bf16(*self, x, rows, cols, out, {.threads = 3}).is_ok());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(out[i], bf16_from_f32(bf16_to_f32(x[i]))) << i;
  }
  EXPECT_EQ(out[5], 0x7FFF);
  // several rounds of whole rows give the same bits
  std::vector<uint16_t> out2(x.size());
  ASSERT_TRUE(k3::comm::allreduce_bf16(*self, x, rows, cols, out2, {.threads = 1, .max_call_bytes = 100}).is_ok());
  EXPECT_EQ(out, out2);
}

// FP64 reference of the epilogue (the documented formula).
void rmsnorm_reference(const std::vector<uint16_t>& x, const std::vector<uint16_t>& res, const std::vector<uint16_t>& g,
                       int64_t rows, int64_t cols, float eps, std::vector<double>& y, std::vector<uint16_t>& rout) {
  y.assign(x.size(), 0);
  rout.assign(x.size(), 0);
  for (int64_t i = 0; i < rows; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < cols; ++j) {
      const auto k = static_cast<size_t>(i * cols + j);
      const float z = res.empty() ? bf16_to_f32(x[k]) : bf16_to_f32(x[k]) + bf16_to_f32(res[k]);
      rout[k] = bf16_from_f32(z);
      const double r = bf16_to_f32(rout[k]);
      ss += r * r;
    }
    const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(cols) + eps);
    for (int64_t j = 0; j < cols; ++j) {
      const auto k = static_cast<size_t>(i * cols + j);
      y[k] = (static_cast<double>(bf16_to_f32(rout[k])) * rstd) * static_cast<double>(bf16_to_f32(g[static_cast<size_t>(j)]));
    }
  }
}

// Within one BF16 ulp of the FP64 value.
void expect_within_one_ulp(uint16_t got, double want, size_t k) {
  const double g = bf16_to_f32(got);
  const double ulp = std::ldexp(1.0, std::max(std::ilogb(want == 0 ? 1e-30 : want), -126) - 7);
  EXPECT_LE(std::fabs(g - want), ulp) << "element " << k << ": got " << g << ", FP64 " << want;
}

TEST(AllreduceSelf, AddRmsnormMatchesFp64Reference) {
  auto self = k3::comm::make_self_communicator();
  for (const int64_t cols : {int64_t{1}, int64_t{100}, int64_t{3584}}) {
    for (const bool with_residual : {true, false}) {
      const int64_t rows = 6;
      const auto x = random_tensor(rows * cols, 11 + static_cast<uint64_t>(cols), false);
      std::vector<uint16_t> res;
      if (with_residual) res = random_tensor(rows * cols, 99, false);
      std::vector<uint16_t> g(static_cast<size_t>(cols));
      std::mt19937_64 rng(5);
      for (auto& h : g) h = bf16_from_f32(0.5f + static_cast<float>(rng() % 1000) / 1000.0f);
      std::vector<uint16_t> out(x.size()), rout(x.size());
      const float eps = 1e-6f;
      ASSERT_TRUE(k3::comm::allreduce_add_rmsnorm_bf16(*self, x, res, g, rows, cols, eps, out, rout, {.threads = 2}).is_ok());
      std::vector<double> y;
      std::vector<uint16_t> want_rout;
      rmsnorm_reference(x, res, g, rows, cols, eps, y, want_rout);
      EXPECT_EQ(rout, want_rout) << "cols " << cols;
      for (size_t k = 0; k < out.size(); ++k) {
        expect_within_one_ulp(out[k], y[k], k);
        // and bitwise the documented formula (the vectorized kernel evaluates the same operations)
        EXPECT_EQ(out[k], bf16_from_f32(static_cast<float>(y[k]))) << "element " << k;
      }
      // in place: residual_out is the residual span itself
      if (with_residual) {
        std::vector<uint16_t> inplace = res, out2(x.size());
        ASSERT_TRUE(k3::comm::allreduce_add_rmsnorm_bf16(*self, x, inplace, g, rows, cols, eps, out2, inplace).is_ok());
        EXPECT_EQ(inplace, want_rout);
        EXPECT_EQ(out2, out);
      }
    }
  }
}

TEST(AllreduceSelf, ThreadCountAndRoundsNeverChangeBits) {
  auto self = k3::comm::make_self_communicator();
  const int64_t rows = 33, cols = 129;
  const auto x = random_tensor(rows * cols, 3, true), res = random_tensor(rows * cols, 4, true);
  std::vector<uint16_t> g(static_cast<size_t>(cols), bf(1.5));
  std::vector<uint16_t> o1(x.size()), r1(x.size());
  ASSERT_TRUE(k3::comm::allreduce_add_rmsnorm_bf16(*self, x, res, g, rows, cols, 1e-5f, o1, r1).is_ok());
  for (const int t : {2, 3, 8}) {
    std::vector<uint16_t> o(x.size()), r(x.size());
    ASSERT_TRUE(k3::comm::allreduce_add_rmsnorm_bf16(*self, x, res, g, rows, cols, 1e-5f, o, r,
                                                     {.threads = t, .max_call_bytes = 1000}).is_ok());
    EXPECT_EQ(o, o1) << t;
    EXPECT_EQ(r, r1) << t;
  }
}

TEST(AllreduceSelf, EmptyShapesAreFine) {
  auto self = k3::comm::make_self_communicator();
  std::vector<uint16_t> none;
  EXPECT_TRUE(k3::comm::allreduce_bf16(*self, none, 0, 5, none).is_ok());
  EXPECT_TRUE(k3::comm::allreduce_bf16(*self, none, 5, 0, none).is_ok());
  EXPECT_TRUE(k3::comm::allreduce_add_rmsnorm_bf16(*self, none, none, none, 3, 0, 1e-6f, none, none).is_ok());
  std::vector<uint16_t> g(4, bf(1.0));
  EXPECT_TRUE(k3::comm::allreduce_add_rmsnorm_bf16(*self, none, none, g, 0, 4, 1e-6f, none, none).is_ok());
}

void expect_error(const k3::Status& st, const std::vector<std::string>& parts) {
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.code(), k3::StatusCode::kInvalidArgument) << st.to_string();
  for (const auto& p : parts) EXPECT_NE(st.message().find(p), std::string::npos) << "'" << p << "' not in: " << st.message();
}

TEST(AllreduceSelf, EveryArgumentErrorNamesTheArgumentAndValues) {
  auto self = k3::comm::make_self_communicator();
  auto& c = *self;
  const int64_t rows = 2, cols = 3;
  std::vector<uint16_t> x(6, bf(1.0)), res(6, bf(1.0)), g(3, bf(1.0)), out(6), rout(6), small(5);
  using k3::comm::allreduce_add_rmsnorm_bf16;
  using k3::comm::allreduce_bf16;
  expect_error(allreduce_bf16(c, x, -1, cols, out), {"allreduce_bf16", "rows = -1", ">= 0"});
  expect_error(allreduce_bf16(c, x, rows, -2, out), {"cols = -2", "[0, 1048576]"});
  expect_error(allreduce_bf16(c, x, rows, (int64_t{1} << 20) + 1, out), {"cols = 1048577"});
  expect_error(allreduce_bf16(c, x, int64_t{1} << 20, int64_t{1} << 20, out), {"rows * cols", "68719476736"});
  expect_error(allreduce_bf16(c, small, rows, cols, out), {"x has 5 elements", "expected rows * cols (2 * 3) = 6"});
  expect_error(allreduce_bf16(c, x, rows, cols, small), {"out has 5 elements", "= 6"});
  expect_error(allreduce_bf16(c, x, rows, cols, out, {.threads = 0}), {"AllreduceOptions.threads = 0", "[1, 1024]"});
  expect_error(allreduce_bf16(c, x, rows, cols, out, {.threads = 1, .max_call_bytes = -1}),
               {"AllreduceOptions.max_call_bytes = -1"});
  expect_error(allreduce_bf16(c, x, rows, cols, out, {.threads = 1, .max_call_bytes = int64_t{1} << 31}),
               {"max_call_bytes = 2147483648", "2^31 - 1"});
  std::vector<uint16_t> buf(12, bf(1.0));
  expect_error(allreduce_bf16(c, std::span<const uint16_t>(buf).subspan(0, 6), rows, cols, std::span<uint16_t>(buf).subspan(3, 6)),
               {"out overlaps x"});
  expect_error(allreduce_add_rmsnorm_bf16(c, x, small, g, rows, cols, 1e-6f, out, rout),
               {"allreduce_add_rmsnorm_bf16", "residual has 5 elements", "or 0 = 6"});
  expect_error(allreduce_add_rmsnorm_bf16(c, x, res, small, rows, cols, 1e-6f, out, rout), {"gamma has 5 elements", "expected cols = 3"});
  expect_error(allreduce_add_rmsnorm_bf16(c, x, res, g, rows, cols, 1e-6f, out, small), {"residual_out has 5 elements"});
  expect_error(allreduce_add_rmsnorm_bf16(c, x, res, g, rows, cols, 1e-6f, small, rout), {"out has 5 elements"});
  expect_error(allreduce_add_rmsnorm_bf16(c, small, res, g, rows, cols, 1e-6f, out, rout), {"x has 5 elements"});
  for (const float eps : {0.0f, -1.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    expect_error(allreduce_add_rmsnorm_bf16(c, x, res, g, rows, cols, eps, out, rout), {"eps = ", "must be > 0 and finite"});
  }
  expect_error(allreduce_add_rmsnorm_bf16(c, x, res, g, rows, cols, 1e-6f, out, out), {"out overlaps"});
  expect_error(allreduce_add_rmsnorm_bf16(c, x, res, g, rows, cols, 1e-6f, res, rout), {"out overlaps"});
  expect_error(allreduce_add_rmsnorm_bf16(c, x, res, g, rows, cols, 1e-6f, out, x), {"residual_out overlaps"});
  std::vector<uint16_t> gr(9, bf(1.0));
  expect_error(allreduce_add_rmsnorm_bf16(c, x, res, std::span<const uint16_t>(gr).subspan(0, 3), rows, cols, 1e-6f, out,
                                          std::span<uint16_t>(gr).subspan(2, 6)),
               {"residual_out overlaps x, gamma or residual"});
  std::vector<uint16_t> shifted(7, bf(1.0));
  expect_error(allreduce_add_rmsnorm_bf16(c, x, std::span<const uint16_t>(shifted).subspan(0, 6), g, rows, cols, 1e-6f, out,
                                          std::span<uint16_t>(shifted).subspan(1, 6)),
               {"residual_out overlaps x, gamma or residual"});
  expect_error(allreduce_add_rmsnorm_bf16(c, x, res, g, rows, cols, 1e-6f, out, rout, {.threads = 2000}), {"threads = 2000"});
}

TEST(AllreduceSelf, NativeAllreduceAndBenchOnOneRank) {
  auto self = k3::comm::make_self_communicator();
  std::vector<float> d = {1.5f, -2.0f};
  ASSERT_TRUE(self->native_allreduce_sum_f32(d.data(), 2).is_ok());
  EXPECT_EQ(d[0], 1.5f);
  expect_error(self->native_allreduce_sum_f32(d.data(), -1), {"count = -1"});
  const std::vector<int64_t> sizes = {64, 8192};
  auto t = k3::comm::bench_allreduce(*self, sizes, 3, 1);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  ASSERT_EQ(t->size(), 2u);
  EXPECT_EQ((*t)[0].rows, 1);
  EXPECT_EQ((*t)[0].cols, 32);
  EXPECT_EQ((*t)[1].rows, 1);
  EXPECT_EQ((*t)[1].cols, 3584);
  EXPECT_EQ((*t)[1].bytes, 7168);
  EXPECT_GT((*t)[1].k3_us, 0);
  EXPECT_EQ((*t)[1].k3_busbw_gbs, 0);  // W = 1
  const std::vector<int64_t> bad = {1};
  expect_error(k3::comm::bench_allreduce(*self, bad, 3, 1).status(), {"sizes_bytes[0] = 1"});
  expect_error(k3::comm::bench_allreduce(*self, sizes, 0, 1).status(), {"iters = 0"});
}

}  // namespace
