// The dense linear layer (k3/linear.hpp, k3/cpu_linear.hpp): the CPU backend against the plain
// contract (bit for bit, every ISA level, route and thread count), the contract against the FP64
// oracle (an error bound), non-finite inputs, the W8A8 quantizer, and every error path.
#include <gtest/gtest.h>
#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "k3/backend.hpp"
#include "k3/cpu_linear.hpp"
#include "k3/formats.hpp"
#include "k3/moe_ref.hpp"
#include "k3/mx.hpp"

namespace k3 {
namespace {

std::vector<IsaLevel> supported_levels() {
  std::vector<IsaLevel> v;
  for (int l = 0; l <= static_cast<int>(best_isa_level()); ++l) v.push_back(static_cast<IsaLevel>(l));
  return v;
}

struct Case {
  LinearProblem p;
  std::vector<uint8_t> codes, scales;
  std::vector<float> bias;
  int64_t m = 0;
  std::vector<uint16_t> x;
  std::vector<uint16_t> wb;  // W16A16: BF16 weights [N, K]
  LinearWeightsView view() const { return {codes, scales, bias, wb}; }
};

uint8_t random_code(std::mt19937& rng) {
  for (;;) {
    const auto c = static_cast<uint8_t>(rng() & 0xFF);
    if ((c & 0x7F) != 0x7F) return c;
  }
}

// Weights: non-NaN E4M3 codes (whole blocks of normal codes among them), scales around 2^0 with a few extremes (codes 0 and 254 only
// where asked); W16A16: BF16 weights of magnitude 2^-12 .. 2^4, some zeros and (extreme) some
// subnormals and +-Inf; x: BF16 values of magnitude 2^-8 .. 2^8 with random signs and some zeros.
Case make_case(int64_t k, int64_t n, int64_t m, LinearRecipe recipe, OutDType out, bool bias, uint32_t seed,
               bool extreme_scales = false) {
  Case c;
  c.p = {k, n, recipe, out, bias};
  c.m = m;
  std::mt19937 rng(seed);
  if (recipe == LinearRecipe::kW16A16) {
    c.wb.resize(static_cast<size_t>(n * k));
    std::uniform_real_distribution<float> wd(-12.0f, 4.0f);
    for (auto& v : c.wb) {
      const float mag = std::exp2(wd(rng));
      v = rng() % 16 == 0 ? 0 : bf16_from_f32(rng() % 2 ? mag : -mag);
      if (extreme_scales && rng() % 64 == 0) v = static_cast<uint16_t>(rng() % 2 ? 0x0003 : 0x8041);  // subnormals
    }
  } else {
    // Per (tile of 16 rows, block of 32 k): any non-NaN code, normal codes only (nonzero
    // exponent field: the avx512bf16 level's bit-move expansion), or normal codes with one zero or
    // subnormal among them (the lookup again).
    const int64_t blocks = k / 32, tiles = (n + 15) / 16;
    std::vector<uint8_t> kind(static_cast<size_t>(tiles * blocks));
    for (auto& v : kind) v = static_cast<uint8_t>(rng() % 4);
    c.codes.resize(static_cast<size_t>(n * k));
    for (int64_t row = 0; row < n; ++row)
      for (int64_t kk = 0; kk < k; ++kk) {
        uint8_t v = random_code(rng);
        if (kind[static_cast<size_t>((row / 16) * blocks + kk / 32)] != 0)
          while ((v & 0x78) == 0) v = random_code(rng);
        c.codes[static_cast<size_t>(row * k + kk)] = v;
      }
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t b = 0; b < blocks; ++b)
        if (kind[static_cast<size_t>(t * blocks + b)] == 3) {
          const int64_t row = std::min(n - 1, t * 16 + static_cast<int64_t>(rng() % 16));
          c.codes[static_cast<size_t>(row * k + b * 32 + static_cast<int64_t>(rng() % 32))] =
              static_cast<uint8_t>((rng() % 2 ? 0x80 : 0) | rng() % 8);
        }
    c.scales.resize(static_cast<size_t>(n * k / 32));
    for (auto& s : c.scales) {
      s = static_cast<uint8_t>(118 + rng() % 12);
      if (extreme_scales && rng() % 8 == 0) s = rng() % 2 ? 0 : 1;
    }
  }
  if (bias) {
    c.bias.resize(static_cast<size_t>(n));
    std::normal_distribution<float> nd(0.0f, 4.0f);
    for (auto& b : c.bias) b = nd(rng);
  }
  c.x.resize(static_cast<size_t>(m * k));
  std::uniform_real_distribution<float> ud(-8.0f, 8.0f);
  for (auto& v : c.x) {
    const float mag = std::exp2(ud(rng));
    v = rng() % 16 == 0 ? 0 : bf16_from_f32(rng() % 2 ? mag : -mag);
  }
  return c;
}

std::vector<uint8_t> reference(const Case& c) {
  std::vector<uint8_t> out(static_cast<size_t>(c.m * c.p.n * out_dtype_size(c.p.out_dtype)));
  const Status st = linear_reference(c.p, c.view(), c.m, c.x, out);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return out;
}

Result<std::vector<uint8_t>> run_cpu(const Case& c, const cpu::LinearOptions& o) {
  K3_ASSIGN_OR_RETURN(auto plan, cpu::plan(c.p, o));
  K3_ASSIGN_OR_RETURN(auto packed, cpu::prepack(plan, c.view()));
  std::vector<uint8_t> ws(static_cast<size_t>(plan.workspace_bytes) + 7);
  std::vector<uint8_t> out(static_cast<size_t>(c.m * c.p.n * out_dtype_size(c.p.out_dtype)), 0xAB);
  // An unaligned workspace: run() aligns it.
  K3_RETURN_IF_ERROR(cpu::run(plan, packed, c.m, c.x, std::span<uint8_t>(ws).subspan(7), out));
  return out;
}

std::string where(const Case& c, IsaLevel isa, int threads, int stream) {
  return std::string(linear_recipe_name(c.p.recipe)) + " " + out_dtype_name(c.p.out_dtype) + " K " +
         std::to_string(c.p.k) + " N " + std::to_string(c.p.n) + " M " + std::to_string(c.m) + " isa " +
         isa_level_name(isa) + " threads " + std::to_string(threads) + " stream_max_rows " + std::to_string(stream);
}

// Bits equal, NaN compared as a class (payloads may differ between FMA units).
void expect_same_bits(const Case& c, const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                      const std::string& what) {
  int64_t first = -1;
  const int64_t n = count_output_mismatches(got, want, c.p.out_dtype, &first);
  ASSERT_EQ(n, 0) << what << ": " << n << " outputs differ from the contract, the first at row "
                  << first / c.p.n << " column " << first % c.p.n;
}

// The comparison itself: it sees a one-bit change, and NaN payloads agree.
TEST(CpuLinear, OutputComparisonSeesOneBitAndTreatsNanAsAClass) {
  std::vector<uint8_t> a = {0x00, 0x3F, 0xC0, 0x7F, 0x80, 0x3F}, b = a;
  EXPECT_EQ(count_output_mismatches(a, b, OutDType::kBF16), 0);
  b[0] ^= 1;
  int64_t first = -1;
  EXPECT_EQ(count_output_mismatches(a, b, OutDType::kBF16, &first), 1);
  EXPECT_EQ(first, 0);
  b = a;
  b[2] = 0xC1;  // another NaN payload
  EXPECT_EQ(count_output_mismatches(a, b, OutDType::kBF16), 0);
  EXPECT_EQ(count_output_mismatches(a, std::vector<uint8_t>(4), OutDType::kBF16), -1);
}

TEST(CpuLinear, BitIdenticalToTheContractOnEveryLevelRouteAndThreadCount) {
  struct Shape {
    int64_t k, n;
  };
  const Shape shapes[] = {{32, 1}, {96, 37}, {160, 50}, {288, 129}};
  const int64_t rows[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 23, 40};
  uint32_t seed = 1;
  for (const auto recipe : {LinearRecipe::kW8A16, LinearRecipe::kW8A8, LinearRecipe::kW16A16}) {
    for (const auto& s : shapes) {
      for (const int64_t m : rows) {
        const OutDType out = seed % 3 == 0 ? OutDType::kFP32 : seed % 3 == 1 ? OutDType::kBF16 : OutDType::kFP16;
        const Case c = make_case(s.k, s.n, m, recipe, out, seed % 2 == 0, seed, seed % 4 == 1);
        ++seed;
        const auto want = reference(c);
        for (const IsaLevel isa : supported_levels()) {
          for (const int threads : {1, 3}) {
            for (const int stream : {0, 8}) {
              cpu::LinearOptions o;
              o.isa = isa;
              o.threads = threads;
              o.stream_max_rows = stream;
              o.chunk_tokens = 16;  // several chunks at M = 23 and 40
              auto got = run_cpu(c, o);
              ASSERT_TRUE(got.is_ok()) << got.status().to_string();
              expect_same_bits(c, got.value(), want, where(c, isa, threads, stream));
            }
          }
        }
      }
    }
  }
}

// The pair layout marks each (tile, block) whose 32 x 16 codes all have a nonzero exponent field:
// those blocks take the bit-move expansion, the others the lookup (both checked for bits above, as
// make_case mixes them). Padding columns are zero codes, so a partial last tile is never marked.
TEST(CpuLinear, PairLayoutMarksTheBlocksOfNormalCodes) {
  const Case c = make_case(288, 129, 1, LinearRecipe::kW8A16, OutDType::kBF16, false, 11);
  cpu::LinearOptions o;
  o.isa = IsaLevel::kAvx2;
  if (best_isa_level() >= IsaLevel::kAvx2) {
    auto plan = cpu::plan(c.p, o);
    ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
    auto packed = cpu::prepack(plan.value(), c.view());
    ASSERT_TRUE(packed.is_ok());
    EXPECT_EQ(packed.value().tile_normal(0), nullptr);
    EXPECT_EQ(packed.value().normal_blocks(), 0);
  }
  o.isa = IsaLevel::kAvx512Bf16;
  if (best_isa_level() < IsaLevel::kAvx512Bf16) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  auto plan = cpu::plan(c.p, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  if (!plan.value().pair_layout) GTEST_SKIP() << "AVX512-BF16 without VBMI or GFNI: the FP32 layout";
  auto packed = cpu::prepack(plan.value(), c.view());
  ASSERT_TRUE(packed.is_ok()) << packed.status().to_string();
  const int64_t blocks = c.p.k / 32, tiles = (c.p.n + 15) / 16;
  int64_t normal = 0;
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t b = 0; b < blocks; ++b) {
      bool want = true;
      for (int64_t col = 0; col < 16; ++col)
        for (int64_t kk = 0; kk < 32; ++kk) {
          const int64_t row = t * 16 + col;
          const uint8_t code = row < c.p.n ? c.codes[static_cast<size_t>(row * c.p.k + b * 32 + kk)] : 0;
          want = want && (code & 0x78) != 0;
        }
      ASSERT_NE(packed.value().tile_normal(t), nullptr);
      EXPECT_EQ(packed.value().tile_normal(t)[b], want ? 1 : 0) << "tile " << t << " block " << b;
      normal += want ? 1 : 0;
    }
  EXPECT_EQ(packed.value().normal_blocks(), normal);
  EXPECT_GT(normal, 0);                // the bit moves run
  EXPECT_LT(normal, tiles * blocks);   // and the lookup
}

// The FP32 stream kernels take x' = x 2^120 when every row's finite |x| is below 2^8 and
// x' = x 2^8 (weights times 2^112) otherwise: both give the contract's bits, at the boundary
// (255 and 256 next to the largest E4M3 weight) and with one large row among small ones.
TEST(CpuLinear, StreamRowsBelowAndAbove2p8GiveTheSameBits) {
  for (const auto recipe : {LinearRecipe::kW8A16, LinearRecipe::kW8A8})
    for (const float big : {255.0f, 256.0f, 3.0e5f, -7.0e30f}) {
      for (const int64_t m : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{5}, int64_t{8}}) {
        Case c = make_case(160, 45, m, recipe, OutDType::kFP32, m % 2 == 1, static_cast<uint32_t>(400 + m));
        const int64_t k = c.p.k;
        for (auto& v : c.x) v = bf16_from_f32(bf16_to_f32(v) / 4.0f);  // |x| < 2^6
        c.codes[static_cast<size_t>(3 * k + 17)] = 0x7E;                 // 448
        c.x[static_cast<size_t>((m - 1) * k + 17)] = bf16_from_f32(big);
        const auto want = reference(c);
        for (const IsaLevel isa : supported_levels()) {
          if (isa == IsaLevel::kScalar) continue;
          cpu::LinearOptions o;
          o.isa = isa;
          o.threads = 2;
          auto got = run_cpu(c, o);
          ASSERT_TRUE(got.is_ok()) << got.status().to_string();
          expect_same_bits(c, got.value(), want, where(c, isa, 2, 8) + " big " + std::to_string(big));
        }
      }
    }
}

#if defined(__x86_64__) || defined(__i386__)
// The FP32 kernels widen a subnormal E4M3 code to an FP32 subnormal (w 2^-120); a caller's
// MXCSR.DAZ (torch.set_flush_denormal, -ffast-math startup code) would read it as zero. The
// kernels clear DAZ on their threads for the call and restore it.
TEST(CpuLinear, DenormalsAreZeroInTheCallersThreadsChangesNothing) {
  constexpr unsigned kDaz = 0x40;
  for (const auto recipe : {LinearRecipe::kW8A16, LinearRecipe::kW8A8}) {
    Case c = make_case(256, 64, 8, recipe, OutDType::kFP32, false, 515);
    for (size_t i = 0; i < c.codes.size(); i += 7) c.codes[i] = static_cast<uint8_t>((i & 8) << 4 | (1 + i % 7));
    const auto want = reference(c);
    for (const IsaLevel isa : supported_levels())
      for (const int64_t m : {int64_t{1}, int64_t{4}, int64_t{8}})
        for (const int stream : {0, 8}) {
          Case cm = c;
          cm.m = m;
          cm.x.resize(static_cast<size_t>(m * c.p.k));
          cpu::LinearOptions o;
          o.isa = isa;
          o.threads = 2;
          o.stream_max_rows = stream;
          // DAZ on the caller (LLVM's libomp gives the caller's MXCSR to its workers at each
          // parallel region and restores the caller's at the join) and on the pool threads
          // (GCC's libgomp leaves each thread's own).
          const unsigned caller = _mm_getcsr();
          unsigned pool[2] = {caller, caller};
#pragma omp parallel num_threads(2)
          {
            const int t = omp_get_thread_num();
            pool[t] = _mm_getcsr();
            _mm_setcsr(pool[t] | kDaz);
          }
          _mm_setcsr(caller | kDaz);
          auto got = run_cpu(cm, o);
          const unsigned after = _mm_getcsr();
          _mm_setcsr(caller);
#pragma omp parallel num_threads(2)
          _mm_setcsr(pool[omp_get_thread_num()]);
          EXPECT_NE(after & kDaz, 0u) << "the caller's DAZ is restored";
          ASSERT_TRUE(got.is_ok()) << got.status().to_string();
          std::vector<uint8_t> w(want.begin(), want.begin() + m * c.p.n * 4);
          expect_same_bits(cm, got.value(), w, where(cm, isa, 2, stream) + " with DAZ set");
        }
  }
}
#endif

// Rows that the SIMD kernels hand to the portable body (|x| >= 2^120; on avx512bf16 also tiny,
// huge and non-finite values) give the contract's bits too, next to ordinary rows.
TEST(CpuLinear, EdgeRowsTakeThePortableBodyWithTheSameBits) {
  for (const auto recipe : {LinearRecipe::kW8A16, LinearRecipe::kW8A8, LinearRecipe::kW16A16}) {
    Case c = make_case(128, 40, 12, recipe, OutDType::kFP32, true, 77);
    const int64_t k = c.p.k;
    c.x[0 * k + 5] = bf16_from_f32(std::ldexp(1.0f, 121));    // huge: portable on every level
    c.x[1 * k + 9] = bf16_from_f32(std::ldexp(1.0f, -120));   // tiny: not for VDPBF16PS
    c.x[2 * k + 3] = 0x0001;                                   // BF16 subnormal
    c.x[3 * k + 7] = bf16_from_f32(std::ldexp(1.0f, 116));    // above the BF16 kernel's window
    c.x[4 * k + 1] = bf16_from_f32(INFINITY);
    c.x[5 * k + 2] = 0x7FC0;                                   // NaN
    for (int64_t i = 0; i < k; ++i) c.x[6 * k + i] = 0;        // an all-zero row
    const auto want = reference(c);
    for (const IsaLevel isa : supported_levels())
      for (const int stream : {0, 8}) {
        cpu::LinearOptions o;
        o.isa = isa;
        o.threads = 2;
        o.stream_max_rows = stream;
        for (const int64_t m : {int64_t{7}, int64_t{12}}) {
          Case cm = c;
          cm.m = m;
          cm.x.resize(static_cast<size_t>(m * k));
          auto got = run_cpu(cm, o);
          ASSERT_TRUE(got.is_ok()) << got.status().to_string();
          std::vector<uint8_t> w(want.begin(), want.begin() + m * c.p.n * 4);
          expect_same_bits(cm, got.value(), w, where(cm, isa, 2, stream));
        }
      }
  }
}

// The contract against the FP64 oracle: every element within the FP32 accumulation bound
// (K + 2 roundings of at most 2^-24 relative each, on the sum of |terms|) plus the output rounding.
TEST(CpuLinear, ContractWithinTheFp32AccumulationBoundOfTheFp64Oracle) {
  for (const auto recipe : {LinearRecipe::kW8A16, LinearRecipe::kW8A8, LinearRecipe::kW16A16}) {
    const Case c = make_case(1536, 48, 5, recipe, OutDType::kFP32, true, 5);
    std::vector<double> oracle(static_cast<size_t>(c.m * c.p.n));
    ASSERT_TRUE(linear_oracle_fp64(c.p, c.view(), c.m, c.x, oracle).is_ok());
    // sum of |terms| with the same operands
    Case a = c;
    for (auto& v : a.codes) v &= 0x7F;
    for (auto& v : a.wb) v &= 0x7FFF;
    for (auto& v : a.bias) v = std::fabs(v);
    for (auto& v : a.x) v &= 0x7FFF;
    std::vector<double> abs_sum(oracle.size());
    ASSERT_TRUE(linear_oracle_fp64(a.p, a.view(), a.m, a.x, abs_sum).is_ok());
    cpu::LinearOptions o;
    o.threads = 2;
    auto got = run_cpu(c, o);
    ASSERT_TRUE(got.is_ok());
    double err2 = 0, ref2 = 0;
    for (size_t i = 0; i < oracle.size(); ++i) {
      float g;
      std::memcpy(&g, &got.value()[i * 4], 4);
      const double bound = (static_cast<double>(c.p.k) + 2) * std::ldexp(1.0, -24) * abs_sum[i] +
                           std::ldexp(1.0, -24) * std::fabs(oracle[i]);
      ASSERT_LE(std::fabs(g - oracle[i]), bound) << linear_recipe_name(recipe) << " element " << i;
      err2 += (g - oracle[i]) * (g - oracle[i]);
      ref2 += oracle[i] * oracle[i];
    }
    EXPECT_LT(std::sqrt(err2 / ref2), 1e-6) << linear_recipe_name(recipe);
  }
}

// Non-finite inputs follow IEEE through the contract: a NaN in a row makes the row NaN; W8A16 Inf
// gives +-Inf (or NaN where it meets a zero weight or both signs); W8A8 Inf saturates in the MX
// codec (scale 2^127, element +-448) and dequantizes to +-Inf, as the codec defines.
TEST(CpuLinear, NonFiniteInputsFollowTheOraclesClass) {
  for (const auto recipe : {LinearRecipe::kW8A16, LinearRecipe::kW8A8, LinearRecipe::kW16A16}) {
    Case c = make_case(64, 20, 3, recipe, OutDType::kBF16, false, 9);
    c.x[0 * 64 + 4] = 0x7FC0;                    // NaN
    c.x[1 * 64 + 10] = bf16_from_f32(INFINITY);  // +Inf
    std::vector<double> oracle(static_cast<size_t>(c.m * c.p.n));
    ASSERT_TRUE(linear_oracle_fp64(c.p, c.view(), c.m, c.x, oracle).is_ok());
    for (const IsaLevel isa : supported_levels()) {
      cpu::LinearOptions o;
      o.isa = isa;
      auto got = run_cpu(c, o);
      ASSERT_TRUE(got.is_ok());
      for (int64_t i = 0; i < c.m * c.p.n; ++i) {
        uint16_t h;
        std::memcpy(&h, &got.value()[static_cast<size_t>(i) * 2], 2);
        const float g = bf16_to_f32(h);
        const double r = oracle[static_cast<size_t>(i)];
        if (i / c.p.n == 0) {
          EXPECT_TRUE(std::isnan(g)) << isa_level_name(isa) << " element " << i;
        } else if (std::isnan(r) || std::isinf(r)) {
          EXPECT_EQ(std::isnan(g), std::isnan(r)) << isa_level_name(isa) << " element " << i << " oracle " << r;
          if (std::isinf(r)) {
            EXPECT_EQ(g, static_cast<float>(r)) << isa_level_name(isa) << " element " << i;
          }
        } else {
          EXPECT_TRUE(std::isfinite(g)) << isa_level_name(isa) << " element " << i;
        }
      }
    }
    if (recipe != LinearRecipe::kW8A8) {
      // row 1 meets the Inf: with random weights its outputs are +-Inf or NaN in the oracle
      int nonfinite = 0;
      for (int64_t j = 0; j < c.p.n; ++j) nonfinite += !std::isfinite(oracle[static_cast<size_t>(c.p.n + j)]);
      EXPECT_EQ(nonfinite, c.p.n);
    }
  }
}

TEST(CpuLinear, SeparateQuantizerRouteGivesTheFusedRoutesBits) {
  const Case c = make_case(224, 33, 6, LinearRecipe::kW8A8, OutDType::kBF16, true, 21);
  cpu::LinearOptions o;
  o.threads = 2;
  auto plan = cpu::plan(c.p, o);
  ASSERT_TRUE(plan.is_ok());
  auto packed = cpu::prepack(plan.value(), c.view());
  ASSERT_TRUE(packed.is_ok());
  std::vector<uint8_t> codes(static_cast<size_t>(c.m * c.p.k)), scales(static_cast<size_t>(c.m * c.p.k / 32));
  ASSERT_TRUE(cpu::quantize_x(plan.value(), c.m, c.x, codes, scales).is_ok());
  // the codec's bits
  std::vector<uint8_t> codes_ref(codes.size()), scales_ref(scales.size());
  ASSERT_TRUE(mx_quantize_bf16(c.x, c.m, c.p.k, MxElement::kE4M3, ScaleRule::kRceil, codes_ref, scales_ref).is_ok());
  EXPECT_EQ(codes, codes_ref);
  EXPECT_EQ(scales, scales_ref);
  std::vector<uint8_t> ws(static_cast<size_t>(plan->workspace_bytes));
  std::vector<uint8_t> fused(static_cast<size_t>(c.m * c.p.n * 2)), separate(fused.size());
  ASSERT_TRUE(cpu::run(plan.value(), packed.value(), c.m, c.x, ws, fused).is_ok());  // M = 6: stream route
  ASSERT_TRUE(cpu::run_quantized(plan.value(), packed.value(), c.m, codes, scales, ws, separate).is_ok());
  EXPECT_EQ(fused, separate);
  EXPECT_EQ(fused, reference(c));
}

TEST(CpuLinear, DescribeNamesTheChoice) {
  LinearProblem p{1536, 7168, LinearRecipe::kW8A8, OutDType::kBF16, false};
  cpu::LinearOptions o;
  o.threads = 2;
  o.isa = IsaLevel::kScalar;
  auto plan = cpu::plan(p, o);
  ASSERT_TRUE(plan.is_ok());
  const std::string d = plan->describe();
  EXPECT_NE(d.find("K 1536 -> N 7168"), std::string::npos) << d;
  EXPECT_NE(d.find("isa scalar"), std::string::npos) << d;
  EXPECT_NE(d.find("tiles 448"), std::string::npos) << d;
  EXPECT_GT(plan->workspace_bytes, 256 * 1536 * 4) << d;
}

void expect_error(const Status& st, StatusCode code, const std::string& needle) {
  EXPECT_EQ(st.code(), code) << st.to_string();
  EXPECT_NE(st.message().find(needle), std::string::npos) << "message: " << st.message() << "\nwanted: " << needle;
}

TEST(CpuLinear, PlanErrorsNameTheArgumentTheLimitAndTheValue) {
  LinearProblem p{96, 40, LinearRecipe::kW8A16, OutDType::kBF16, false};
  auto bad = [&](LinearProblem q, cpu::LinearOptions o = {}) { return cpu::plan(q, o).status(); };
  LinearProblem q = p;
  q.k = 48;
  expect_error(bad(q), StatusCode::kInvalidArgument, "k = 48 must be a positive multiple of 32");
  q.k = 0;
  expect_error(bad(q), StatusCode::kInvalidArgument, "k = 0");
  q = p;
  q.n = 0;
  expect_error(bad(q), StatusCode::kInvalidArgument, "n = 0 must be in [1, 1048576]");
  q.n = kLinearMaxDim + 1;
  expect_error(bad(q), StatusCode::kInvalidArgument, "n = 1048577");
  cpu::LinearOptions o;
  o.threads = -1;
  expect_error(bad(p, o), StatusCode::kInvalidArgument, "threads = -1 must be in [0, 256]");
  o = {};
  o.max_tokens = 0;
  expect_error(bad(p, o), StatusCode::kInvalidArgument, "max_tokens = 0 must be in [1, 2^24]");
  o = {};
  o.chunk_tokens = 8;
  expect_error(bad(p, o), StatusCode::kInvalidArgument, "chunk_tokens = 8 must be in [16, 4096]");
  o = {};
  o.stream_max_rows = 9;
  expect_error(bad(p, o), StatusCode::kInvalidArgument, "stream_max_rows = 9 must be in [0, 8]");
  if (best_isa_level() != IsaLevel::kAvx512Bf16) {
    o = {};
    o.isa = IsaLevel::kAvx512Bf16;
    expect_error(bad(p, o), StatusCode::kUnsupported, "isa = avx512bf16 is above this CPU's best level");
  }
}

TEST(CpuLinear, PrepackAndRunErrorsNameWhatIsWrong) {
  Case c = make_case(64, 20, 3, LinearRecipe::kW8A16, OutDType::kFP32, true, 3);
  auto plan = cpu::plan(c.p, {});
  ASSERT_TRUE(plan.is_ok());
  {
    Case d = c;
    d.codes.pop_back();
    expect_error(cpu::prepack(plan.value(), d.view()).status(), StatusCode::kInvalidArgument,
                 "weight codes has 1279 elements; expected 1280");
    d = c;
    d.scales.push_back(1);
    expect_error(cpu::prepack(plan.value(), d.view()).status(), StatusCode::kInvalidArgument,
                 "weight scales has 41 elements; expected 40");
    d = c;
    d.bias.clear();
    expect_error(cpu::prepack(plan.value(), d.view()).status(), StatusCode::kInvalidArgument,
                 "bias has 0 elements; expected 20");
    d = c;
    d.codes[static_cast<size_t>(7 * 64 + 40)] = 0xFF;
    expect_error(cpu::prepack(plan.value(), d.view()).status(), StatusCode::kInvalidArgument,
                 "weight code of row 7, column 40 (block 1) is 0xFF (E4M3 NaN)");
    d = c;
    d.scales[static_cast<size_t>(3 * 2 + 1)] = 0xFF;
    expect_error(cpu::prepack(plan.value(), d.view()).status(), StatusCode::kInvalidArgument,
                 "weight scale of row 3, block 1 is 0xFF");
    LinearProblem nb = c.p;
    nb.bias = false;
    auto plan_nb = cpu::plan(nb, {});
    expect_error(cpu::prepack(plan_nb.value(), c.view()).status(), StatusCode::kInvalidArgument,
                 "a bias of 20 values was given but the problem has bias = false");
  }
  auto packed = cpu::prepack(plan.value(), c.view());
  ASSERT_TRUE(packed.is_ok());
  std::vector<uint8_t> ws(static_cast<size_t>(plan->workspace_bytes)), out(static_cast<size_t>(3 * 20 * 4));
  expect_error(cpu::run(plan.value(), packed.value(), 2, c.x, ws, out), StatusCode::kInvalidArgument,
               "x has 192 elements; expected 128");
  std::vector<uint8_t> small(out.size() - 1);
  expect_error(cpu::run(plan.value(), packed.value(), 3, c.x, ws, small), StatusCode::kInvalidArgument,
               "out has 239 bytes; expected 240");
  std::vector<uint8_t> ws_small(ws.size() - 1);
  expect_error(cpu::run(plan.value(), packed.value(), 3, c.x, ws_small, out), StatusCode::kInvalidArgument,
               "workspace has");
  cpu::LinearOptions o;
  o.max_tokens = 2;
  auto plan2 = cpu::plan(c.p, o);
  expect_error(cpu::run(plan2.value(), packed.value(), 3, c.x, ws, out), StatusCode::kInvalidArgument,
               "m = 3 exceeds the plan's max_tokens = 2");
  LinearProblem other = c.p;
  other.n = 24;
  auto plan3 = cpu::plan(other, {});
  std::vector<uint8_t> ws3(static_cast<size_t>(plan3->workspace_bytes)), out3(static_cast<size_t>(3 * 24 * 4));
  expect_error(cpu::run(plan3.value(), packed.value(), 3, c.x, ws3, out3), StatusCode::kInvalidArgument,
               "do not belong to this plan");
  std::vector<uint8_t> codes(static_cast<size_t>(3 * 64)), scales(6);
  expect_error(cpu::run_quantized(plan.value(), packed.value(), 3, codes, scales, ws, out),
               StatusCode::kInvalidArgument, "needs a w8a8 plan");
}

// W16A16: BF16 weights, no quantization. The avx512bf16 level runs the AVX-512 FP32 kernels (VDPBF16PS
// is not exact for BF16 x BF16 sums), and an Inf weight follows IEEE like an Inf input. MXFP8
// weights given as their BF16 values give the W8A16 bits: the block scale, a power of two, then
// scales every partial sum exactly (no subnormal or overflowing partial in this case).
TEST(CpuLinear, Bf16WeightsGiveTheContractAndEqualMxfp8WeightsOfTheSameValues) {
  LinearProblem p{1536, 7168, LinearRecipe::kW16A16, OutDType::kBF16, false};
  cpu::LinearOptions o;
  o.threads = 2;
  auto plan = cpu::plan(p, o);
  ASSERT_TRUE(plan.is_ok());
  EXPECT_FALSE(plan->pair_layout);
  EXPECT_NE(plan->describe().find("w16a16"), std::string::npos) << plan->describe();
  EXPECT_NE(plan->describe().find("bf16 weights"), std::string::npos) << plan->describe();
  // The MXFP8 case's weights as BF16 values (E4M3 x 2^(s-127) is exact in BF16 for these scales).
  Case q = make_case(96, 37, 5, LinearRecipe::kW8A16, OutDType::kFP32, true, 41);
  Case b = q;
  b.p.recipe = LinearRecipe::kW16A16;
  b.codes.clear();
  b.scales.clear();
  b.wb.resize(static_cast<size_t>(q.p.n * q.p.k));
  for (int64_t i = 0; i < q.p.n * q.p.k; ++i)
    b.wb[static_cast<size_t>(i)] = bf16_from_f32(e4m3_to_f32(q.codes[static_cast<size_t>(i)]) *
                                                 e8m0_to_f32(q.scales[static_cast<size_t>(i / 32)]));
  const auto want = reference(b);
  EXPECT_EQ(count_output_mismatches(want, reference(q), OutDType::kFP32), 0);
  for (const IsaLevel isa : supported_levels()) {
    cpu::LinearOptions oi;
    oi.isa = isa;
    oi.threads = 2;
    auto got = run_cpu(b, oi);
    ASSERT_TRUE(got.is_ok()) << got.status().to_string();
    expect_same_bits(b, got.value(), want, where(b, isa, 2, 8));
  }
  std::vector<double> o8(static_cast<size_t>(q.m * q.p.n)), o16(o8.size());
  ASSERT_TRUE(linear_oracle_fp64(q.p, q.view(), q.m, q.x, o8).is_ok());
  ASSERT_TRUE(linear_oracle_fp64(b.p, b.view(), b.m, b.x, o16).is_ok());
  EXPECT_EQ(o8, o16);
  // An Inf weight: the outputs of its column are +-Inf or NaN, as in the oracle.
  Case inf = make_case(64, 20, 3, LinearRecipe::kW16A16, OutDType::kFP32, false, 43);
  inf.wb[static_cast<size_t>(5 * 64 + 7)] = 0x7F80;
  std::vector<double> oi(static_cast<size_t>(inf.m * inf.p.n));
  ASSERT_TRUE(linear_oracle_fp64(inf.p, inf.view(), inf.m, inf.x, oi).is_ok());
  auto got = run_cpu(inf, o);
  ASSERT_TRUE(got.is_ok());
  expect_same_bits(inf, got.value(), reference(inf), "w16a16 with an Inf weight");
  for (int64_t r = 0; r < inf.m; ++r) EXPECT_FALSE(std::isfinite(oi[static_cast<size_t>(r * inf.p.n + 5)]));
}

TEST(CpuLinear, Bf16WeightErrorsNameTheFieldRowAndColumn) {
  Case c = make_case(64, 20, 3, LinearRecipe::kW16A16, OutDType::kFP32, true, 47);
  auto plan = cpu::plan(c.p, {});
  ASSERT_TRUE(plan.is_ok());
  Case d = c;
  d.wb.pop_back();
  expect_error(cpu::prepack(plan.value(), d.view()).status(), StatusCode::kInvalidArgument,
               "BF16 weights has 1279 elements; expected 1280 (N x K BF16 values)");
  d = c;
  d.wb[static_cast<size_t>(4 * 64 + 33)] = 0xFFC1;
  expect_error(cpu::prepack(plan.value(), d.view()).status(), StatusCode::kInvalidArgument,
               "BF16 weight of row 4, column 33 is NaN");
  d = c;
  d.codes.assign(static_cast<size_t>(20 * 64), 0);
  expect_error(cpu::prepack(plan.value(), d.view()).status(), StatusCode::kInvalidArgument,
               "recipe w16a16 takes BF16 weights (the bf16 field); codes and scales must be empty, got 1280 codes");
  // MXFP8 recipes refuse BF16 weights, and a W8A16 plan refuses W16A16 packed weights.
  Case m8 = make_case(64, 20, 3, LinearRecipe::kW8A16, OutDType::kFP32, true, 48);
  m8.wb = c.wb;
  auto plan8 = cpu::plan(m8.p, {});
  expect_error(cpu::prepack(plan8.value(), m8.view()).status(), StatusCode::kInvalidArgument,
               "recipe w8a16 takes MXFP8 weights (codes and scales); the bf16 field must be empty, got 1280 values");
  auto packed16 = cpu::prepack(plan.value(), c.view());
  ASSERT_TRUE(packed16.is_ok());
  std::vector<uint8_t> ws(static_cast<size_t>(plan8->workspace_bytes)), out(static_cast<size_t>(3 * 20 * 4));
  expect_error(cpu::run(plan8.value(), packed16.value(), 3, c.x, ws, out), StatusCode::kInvalidArgument,
               "do not belong to this plan");
  expect_error(parse_linear_recipe("w4a16").status(), StatusCode::kInvalidArgument, "allowed: w8a8, w8a16, w16a16");
  EXPECT_EQ(parse_linear_recipe("w16a16").value(), LinearRecipe::kW16A16);
}

TEST(CpuLinear, RegistryOffersCpuThenReferenceWithTheSameBits) {
  auto cpu_b = find_linear_backend("cpu");
  auto ref_b = find_linear_backend("reference");
  ASSERT_TRUE(cpu_b.is_ok());
  ASSERT_TRUE(ref_b.is_ok());
  EXPECT_EQ(default_linear_backend().name, "cpu");
  expect_error(find_linear_backend("gpu").status(), StatusCode::kInvalidArgument, "known: cpu, reference");
  const Case c = make_case(96, 21, 4, LinearRecipe::kW8A8, OutDType::kFP16, true, 11);
  std::vector<uint8_t> a(static_cast<size_t>(4 * 21 * 2)), b(a.size());
  ASSERT_TRUE(run_linear(*cpu_b.value(), c.p, c.view(), c.m, c.x, a).is_ok());
  ASSERT_TRUE(run_linear(*ref_b.value(), c.p, c.view(), c.m, c.x, b).is_ok());
  EXPECT_EQ(a, b);
}

// prepare_linear: the cpu handle (plan + prepacked weights) and the reference one (its own copy of
// the weights) give run_linear's bits on every call; their limits and refusals are named.
TEST(CpuLinear, PreparedLayersOfTheRegistryGiveTheOneShotBits) {
  for (const auto recipe : {LinearRecipe::kW8A16, LinearRecipe::kW16A16}) {
    Case c = make_case(64, 40, 6, recipe, OutDType::kBF16, true, 21);
    std::vector<uint8_t> want(static_cast<size_t>(c.m * 40 * 2));
    ASSERT_TRUE(run_linear(default_linear_backend(), c.p, c.view(), c.m, c.x, want).is_ok());
    for (const char* name : {"cpu", "reference"}) {
      BackendOptions o;
      o.threads = 2;
      o.max_tokens = 8;
      auto layer = prepare_linear(*find_linear_backend(name).value(), c.p, c.view(), o);
      ASSERT_TRUE(layer.is_ok()) << name << ": " << layer.status().to_string();
      const PreparedLinear& l = **layer;
      EXPECT_EQ(l.backend(), name);
      EXPECT_EQ(l.max_tokens(), 8);
      EXPECT_GT(l.weight_bytes(), 0);
      EXPECT_FALSE(l.describe().empty());
      // The handle owns its weights: the caller's buffers may go.
      c.codes.assign(c.codes.size(), 0);
      c.wb.assign(c.wb.size(), 0);
      std::vector<uint8_t> ws(static_cast<size_t>(l.workspace_bytes())), out(want.size());
      for (int call = 0; call < 2; ++call) {
        ASSERT_TRUE(l.run(c.m, c.x, ws, out).is_ok()) << name;
        EXPECT_EQ(out, want) << name << " " << linear_recipe_name(recipe);
      }
      std::vector<uint16_t> big(static_cast<size_t>(9 * 64));
      std::vector<uint8_t> big_out(static_cast<size_t>(9 * 40 * 2));
      const Status over = l.run(9, big, ws, big_out);
      EXPECT_FALSE(over.is_ok()) << name;
      EXPECT_NE(over.message().find("max_tokens = 8"), std::string::npos) << over.message();
      c = make_case(64, 40, 6, recipe, OutDType::kBF16, true, 21);  // the weights back for the next backend
    }
  }
  const Case c = make_case(64, 40, 6, LinearRecipe::kW8A8, OutDType::kFP32, false, 3);
  BackendOptions bad;
  bad.max_tokens = -1;
  expect_error(prepare_linear(default_linear_backend(), c.p, c.view(), bad).status(), StatusCode::kInvalidArgument,
               "max_tokens = -1 must be in [1, 2^24]");
  bad = {};
  bad.path = "prefill";
  expect_error(prepare_linear(default_linear_backend(), c.p, c.view(), bad).status(), StatusCode::kInvalidArgument,
               "has no kernel paths");
  const LinearWeightsView short_w{std::span<const uint8_t>(c.codes).first(10), c.scales, {}, {}};
  EXPECT_FALSE(prepare_linear(default_linear_backend(), c.p, short_w, {}).is_ok());
}

}  // namespace
}  // namespace k3
