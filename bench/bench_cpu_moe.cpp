// Microbenchmarks of the CPU MoE inner kernels (one thread): dequantize + dot (the tile GEMM,
// streaming from memory for decode and from a cache-resident tile for prefill), MXFP8
// re-quantization, activation, finalize. The level is the machine's best (K3_ISA overrides).
#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <algorithm>
#include <random>
#include <vector>

#include "cpu/moe/elementwise.hpp"
#include "cpu/moe/layout.hpp"
#include "k3/formats.hpp"
#include "k3/memory.hpp"
#include "k3/mx.hpp"
#include "k3/system.hpp"

namespace {

using namespace k3::cpu::detail;

k3::IsaLevel level() {
  auto l = k3::active_isa_level();
  return l.is_ok() ? l.value() : k3::IsaLevel::kScalar;
}

// Random tile records: codes uniform, scales 2^-7 (valid codes for the kernels). On huge pages
// where the kernel's THP mode allows, as the packed weights of k3::cpu::Moe are.
using Records = std::vector<uint8_t, k3::HugePageAllocator<uint8_t>>;
Records random_records(int64_t tiles, int64_t blocks, int groups) {
  Records r(static_cast<size_t>(tiles * blocks * record_bytes(groups)));
  std::mt19937_64 rng(7);
  for (size_t i = 0; i < r.size(); i += 8) {
    const uint64_t v = rng();
    for (size_t j = 0; j < 8 && i + j < r.size(); ++j) r[i + j] = static_cast<uint8_t>(v >> (8 * j));
  }
  for (int64_t t = 0; t < tiles * blocks; ++t) {
    uint8_t* s = r.data() + t * record_bytes(groups) + record_code_bytes(groups);
    for (int i = 0; i < groups * kLanes; ++i) s[i] = 120;
  }
  return r;
}

struct Operands {
  std::vector<uint16_t> bf16;
  std::vector<float> f32;
  std::vector<const void*> rows;
  std::vector<std::vector<int16_t>> view_rows;  // AVX2 kernel: integer views, made as run() does
  std::vector<const int16_t*> views;
};
// Gaussian operand rows: BF16 values (W4A16), or with mxfp8 the MXFP8 (RCEIL) values of the same
// Gaussians (W4A8).
Operands random_rows(int64_t rows, int64_t len, bool bf16, bool mxfp8 = false) {
  Operands o;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  o.bf16.resize(static_cast<size_t>(rows * len));
  o.f32.resize(static_cast<size_t>(rows * len));
  for (size_t i = 0; i < o.bf16.size(); ++i) {
    o.bf16[i] = k3::bf16_from_f32(nd(rng));
    o.f32[i] = k3::bf16_to_f32(o.bf16[i]);
  }
  if (mxfp8) {
    for (size_t b = 0; b < o.f32.size(); b += k3::kMxBlock) {
      uint8_t codes[k3::kMxBlock];
      const uint8_t s = k3::mx_quantize_block(o.f32.data() + b, k3::MxElement::kE4M3, k3::ScaleRule::kRceil, codes);
      for (int i = 0; i < k3::kMxBlock; ++i) {
        o.f32[b + static_cast<size_t>(i)] = k3::mx_decode_element(codes[i], s, k3::MxElement::kE4M3);
        o.bf16[b + static_cast<size_t>(i)] = k3::bf16_from_f32(o.f32[b + static_cast<size_t>(i)]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    o.rows.push_back(bf16 ? static_cast<const void*>(o.bf16.data() + r * len) : o.f32.data() + r * len);
  }
  if (uses_int_views(level())) {
    for (int64_t r = 0; r < rows; ++r) {
      o.view_rows.emplace_back(static_cast<size_t>(int_view_bytes(len) / 2));
      int_view_row(o.f32.data() + r * len, len, o.view_rows.back().data());
      o.views.push_back(o.view_rows.back().data());
    }
  }
  return o;
}

// avx_vnni: the FP32 levels' integer form (false: VPMADDWD + VPADDD, as on a CPU without AVX-VNNI).
TileGemmFn gemm_fn(bool avx_vnni = true) {
  return level() == k3::IsaLevel::kAvx512Bf16 ? tile_gemm_bf16() : tile_gemm_fp32(level(), avx_vnni);
}

// Decode: rows over FC1 tiles (K = 3584) taken in turn from `tiles` of them. Counter: MXFP4
// bytes per second.
// operand: 0 = BF16 values, 1 = MXFP8 values, 2 = BF16 values with no integer view (the AVX2
// kernel's FP32 path only).
void dequant_dot(benchmark::State& state, int64_t rows, int64_t tiles, int operand, bool avx_vnni = true) {
  const bool mxfp8 = operand == 1;
  const int64_t blocks = 3584 / kBlock, tile = blocks * record_bytes(kFc1Groups);
  const auto rec = random_records(tiles, blocks, kFc1Groups);
  auto ops = random_rows(rows, 3584, level() == k3::IsaLevel::kAvx512Bf16, mxfp8);
  if (operand == 2) {
    for (auto& v : ops.view_rows) std::fill(v.begin() + 3584, v.end(), int16_t{0});  // T/2 = 0: no view
  }
  std::vector<float> totals(static_cast<size_t>(kRowGroup * 64));
  std::vector<uint8_t> panel(kPanelScratchBytes + 64);
  const TileGemmFn fn = gemm_fn(avx_vnni);
  int64_t t = 0;
  for (auto _ : state) {
    TileGemm g{rec.data() + t * tile, blocks, kFc1Groups, ops.rows.data(), rows, totals.data(), panel.data(),
               ops.views.empty() ? nullptr : ops.views.data()};
    fn(g);
    benchmark::DoNotOptimize(totals.data());
    t = (t + 1) % tiles;
  }
  state.SetBytesProcessed(state.iterations() * tile);
}

// Streamed from a 256 MiB buffer (far beyond the LLC). op: the operand kind of dequant_dot.
void BM_DequantDotStream(benchmark::State& state) {
  dequant_dot(state, state.range(0), (int64_t{256} << 20) / ((3584 / kBlock) * record_bytes(kFc1Groups)),
              static_cast<int>(state.range(1)));
}
BENCHMARK(BM_DequantDotStream)->ArgsProduct({{1, 2, 3, 4, 5, 6}, {0, 1, 2}})->ArgNames({"rows", "op"});

// What one core's loads alone stream from the same buffer, tile by tile (no arithmetic but an OR
// per 32 bytes): the per-core ceiling of BM_DequantDotStream, without software prefetch.
__attribute__((target("avx2"))) void BM_StreamRead(benchmark::State& state) {
  const int64_t blocks = 3584 / kBlock, tile = blocks * record_bytes(kFc1Groups);
  const int64_t tiles = (int64_t{256} << 20) / tile;
  const auto rec = random_records(tiles, blocks, kFc1Groups);
  int64_t t = 0;
  for (auto _ : state) {
    const uint8_t* p = rec.data() + t * tile;
    __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int64_t o = 0; o < tile; o += 128) {
      for (int j = 0; j < 4; ++j) {
        acc[j] = _mm256_or_si256(acc[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + o + 32 * j)));
      }
    }
    __m256i all = _mm256_or_si256(_mm256_or_si256(acc[0], acc[1]), _mm256_or_si256(acc[2], acc[3]));
    benchmark::DoNotOptimize(all);
    t = (t + 1) % tiles;
  }
  state.SetBytesProcessed(state.iterations() * tile);
}
BENCHMARK(BM_StreamRead);

// The same kernel without the memory system: 8 tiles (975 KB: L2-resident where L2 holds
// 1.25 MB or more, partly in L3 with a 1 MB L2), and one tile (122 KB: in any L2).
void BM_DequantDotCached(benchmark::State& state) {
  dequant_dot(state, state.range(0), 8, static_cast<int>(state.range(1)));
}
BENCHMARK(BM_DequantDotCached)->ArgsProduct({{1, 2, 3, 4, 5, 6}, {0, 1, 2}})->ArgNames({"rows", "op"});
void BM_DequantDotL2(benchmark::State& state) {
  dequant_dot(state, state.range(0), 1, static_cast<int>(state.range(1)));
}
BENCHMARK(BM_DequantDotL2)->ArgsProduct({{1, 2, 3, 4, 5, 6}, {0, 1, 2}})->ArgNames({"rows", "op"});

// Both, with the integer dots as VPMADDWD + VPADDD even where the CPU has AVX-VNNI (the same
// kernels as above on a CPU without it).
void BM_DequantDotStreamMadd(benchmark::State& state) {
  dequant_dot(state, state.range(0), (int64_t{256} << 20) / ((3584 / kBlock) * record_bytes(kFc1Groups)),
              static_cast<int>(state.range(1)), false);
}
BENCHMARK(BM_DequantDotStreamMadd)->ArgsProduct({{1, 2, 3, 4, 5, 6}, {0, 1}})->ArgNames({"rows", "op"});
void BM_DequantDotCachedMadd(benchmark::State& state) {
  dequant_dot(state, state.range(0), 8, static_cast<int>(state.range(1)), false);
}
BENCHMARK(BM_DequantDotCachedMadd)->ArgsProduct({{1, 2, 3, 4, 5, 6}, {0, 1}})->ArgNames({"rows", "op"});
void BM_DequantDotL2Madd(benchmark::State& state) {
  dequant_dot(state, state.range(0), 1, static_cast<int>(state.range(1)), false);
}
BENCHMARK(BM_DequantDotL2Madd)->ArgsProduct({{1, 2, 3, 4, 5, 6}, {0, 1}})->ArgNames({"rows", "op"});

// Prefill: many rows against one cache-resident tile (FC1: G = 4, K = 3584; FC2: G = 2,
// N = 3072). Counter: FLOP per second (2 per multiply-add).
void BM_DequantDotRows(benchmark::State& state) {
  const int64_t rows = state.range(0);
  const int groups = static_cast<int>(state.range(1));
  const int64_t len = groups == kFc1Groups ? 3584 : 3072, blocks = len / kBlock;
  const auto rec = random_records(1, blocks, groups);
  auto ops = random_rows(rows, len, level() == k3::IsaLevel::kAvx512Bf16);
  std::vector<float> totals(static_cast<size_t>(kRowGroup * 64));
  alignas(64) static uint8_t panel[kPanelScratchBytes];
  const TileGemmFn fn = gemm_fn();
  for (auto _ : state) {
    TileGemm g{rec.data(), blocks, groups, ops.rows.data(), rows, totals.data(), panel,
               ops.views.empty() ? nullptr : ops.views.data()};
    fn(g);
    benchmark::DoNotOptimize(totals.data());
  }
  state.counters["FLOP/s"] = benchmark::Counter(static_cast<double>(state.iterations() * rows * len * groups * kLanes * 2),
                                                benchmark::Counter::kIsRate);
}
BENCHMARK(BM_DequantDotRows)->Args({36, 4})->Args({48, 4})->Args({12, 4})->Args({4, 4})->Args({36, 2})->Args({48, 2})
    ->ArgNames({"rows", "groups"});

// The instruction's own peak under the same (CPU-time) accounting, to read the FLOP/s above as a
// fraction: 12 (as k3::measure_dot_peak) or 24 independent VDPBF16PS chains, 64 FLOP each.
template <int kChains>
__attribute__((target("avx512f,avx512bf16"))) void BM_Vdpbf16psPeak(benchmark::State& state) {
  if (level() != k3::IsaLevel::kAvx512Bf16) {
    state.SkipWithError("AVX512-BF16 not available (or K3_ISA below avx512bf16)");
    return;
  }
  __m512 acc[kChains];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3F80), y = (__m512bh)_mm512_set1_epi16(0x3400);
  constexpr int64_t kInner = 4096;
  for (auto _ : state) {
    for (int64_t i = 0; i < kInner; ++i) {
      for (auto& a : acc) a = _mm512_dpbf16_ps(a, x, y);
    }
  }
  __m512 sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm512_add_ps(sum, acc[i]);
  benchmark::DoNotOptimize(sum);
  state.counters["FLOP/s"] = benchmark::Counter(static_cast<double>(state.iterations() * kInner * kChains * 64),
                                                benchmark::Counter::kIsRate);
}
BENCHMARK_TEMPLATE(BM_Vdpbf16psPeak, 12);
BENCHMARK_TEMPLATE(BM_Vdpbf16psPeak, 24);

void BM_RequantizeE4M3(benchmark::State& state) {
  std::vector<float> v(3072);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (auto& x : v) x = nd(rng);
  std::vector<uint8_t> codes(v.size()), scales(v.size() / kBlock);
  const Elementwise& ew = elementwise(level());
  for (auto _ : state) {
    for (size_t b = 0; b < scales.size(); ++b) scales[b] = ew.quantize_e4m3_block(&v[b * kBlock], &codes[b * kBlock]);
    benchmark::DoNotOptimize(codes.data());
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(v.size()));
}
BENCHMARK(BM_RequantizeE4M3);

void BM_Activation(benchmark::State& state) {
  const auto kind = static_cast<k3::ActivationKind>(state.range(0));
  std::vector<float> g(3072), u(3072), o(3072);
  std::mt19937 rng(6);
  std::normal_distribution<float> nd(0.f, 2.f);
  for (size_t i = 0; i < g.size(); ++i) g[i] = nd(rng), u[i] = nd(rng);
  ActParams p;
  p.kind = kind;
  const Elementwise& ew = elementwise(level());
  for (auto _ : state) {
    ew.activate(p, g.data(), u.data(), o.data(), static_cast<int64_t>(g.size()));
    benchmark::DoNotOptimize(o.data());
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(g.size()));
}
BENCHMARK(BM_Activation)->Arg(0)->Arg(1)->Arg(2)->ArgNames({"situ_swiglu_silu"});

// Finalize of one token: 8 local slots of K = 3584.
void BM_Finalize(benchmark::State& state) {
  const int slots = 8;
  const int64_t k = 3584;
  std::vector<float> y(static_cast<size_t>(slots * k), 0.5f), acc(static_cast<size_t>(k));
  std::vector<const float*> rows;
  std::vector<float> w(slots, 0.125f);
  for (int s = 0; s < slots; ++s) rows.push_back(y.data() + s * k);
  const Elementwise& ew = elementwise(level());
  for (auto _ : state) {
    ew.weighted_sum(rows.data(), w.data(), slots, k, acc.data());
    benchmark::DoNotOptimize(acc.data());
  }
  state.SetItemsProcessed(state.iterations() * slots * k);
}
BENCHMARK(BM_Finalize);

}  // namespace
