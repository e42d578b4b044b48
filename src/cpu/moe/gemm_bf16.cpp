// Tile GEMM on AVX512-BF16 (VDPBF16PS): MXFP4 weight tiles x BF16 operand rows, FP32 totals.
//
// Uses: AVX-512 F/BW (VPMOVZXBW, VPERMW, VPSRLW), AVX512-BF16 (VDPBF16PS), FMA for the block
// scales. Weights are dequantized to *unscaled* E2M1 values (exact in BF16: 0, +-0.5 .. +-6), so
// the dot product of one block is exact per product and FP32-rounded per add; the block's
// power-of-two scale (2^(s-127), an FP32 normal for s in [1, 254]) is applied to the partial sum
// with one FMA into the totals. This removes every BF16-range condition on the weight scales.
//
// Two weight sources with identical arithmetic (so results do not depend on which one runs):
//   direct  <= kDirectMaxRows rows (decode): each 32-byte load of codes becomes two weight
//           vectors in registers (VPMOVZXBW, VPSRLW, 2x VPERMW) and feeds every row.
//   panel   more rows: kPanelBlocks blocks of the tile are dequantized once into an L1 panel
//           of BF16 vectors, then streamed by MR x G register tiles (MR*G accumulators).
// VDPBF16PS treats BF16 subnormal inputs as zero and flushes subnormal results (DAZ/FTZ): the
// caller scales operand rows so that no nonzero product or partial sum is subnormal (run.cpp).
//
// Exact integer blocks (direct path, CPUs with AVX512-VNNI): when the task carries the rows'
// integer views (int_view_row_bf16: x[k] = xi[k] * 2^(e-14), |xi| < 2^15) and every row has one
// for block b, the block takes VPDPWSSD on int16 weights 2w (the same VPERMW lookup with an
// integer table) instead of VDPBF16PS. Then no product and no partial sum of the VDPBF16PS chain
// rounds (each is an integer multiple of 2^(e-15) below 2^24 of them; with the row shift no
// nonzero one is subnormal), so the chain's result is the exact block dot, which the int32 sum
// gives: (float)sum * 2^(e-15) is exact and gives the same bits. VPDPWSSD does the VDPBF16PS
// step's 32 multiply-adds in one instruction at twice its rate on Intel Xeon (Emerald Rapids:
// VDPBF16PS zmm about one per 2 cycles, VPDPWSSD zmm one per cycle).
#include <immintrin.h>

#include <cstring>

#include "cpu/moe/layout.hpp"
#include "cpu/prefetch.hpp"

// GCC 12 reports its own _mm512_undefined_* helpers as "used uninitialized" (avx512fintrin.h).
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define K3_TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define K3_TARGET_BF16_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,fma")))




namespace k3::cpu::detail {
namespace {

// BF16 bits of the E2M1 value of (index & 15): VPERMW looks at 5 index bits, so the 16-entry
// table is stored twice and a stray bit 4 (the neighbouring nibble) selects the same value.
alignas(64) constexpr uint16_t kE2M1Bf16[32] = {
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,  // +0 .. +6
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,  // -0 .. -6
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
K3_TARGET_BF16 inline __m512i e2m1_bf16_table() { return _mm512_load_si512(kE2M1Bf16); }

// 2w as an int16 for the E2M1 value w of (index & 15) (w = +-0, 0.5 .. 6), stored twice as above.
alignas(64) constexpr int16_t kTwiceE2M1[32] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                                0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 32 code bytes -> the weight vectors of groups 2p (low nibbles) and 2p+1 (high nibbles).
K3_TARGET_BF16 inline void expand_pair(const uint8_t* codes, __m512i table, __m512i& lo, __m512i& hi) {
  const __m512i z = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
  lo = _mm512_permutexvar_epi16(z, table);
  hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(z, 4), table);
}

// 16 E8M0 codes -> 16 FP32 scales 2^(s-127) (exact for s in [1, 254]; s = 0 gives +0.0, which
// prepack allows only for all-zero blocks).
K3_TARGET_BF16 inline __m512 scale_vector(const uint8_t* s) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))), 23));
}

K3_TARGET_BF16 inline __m512i broadcast_pair(const uint16_t* row, int64_t k) {
  int32_t v;
  std::memcpy(&v, row + k, sizeof(v));
  return _mm512_set1_epi32(v);
}

// Block epilogue: totals[m][g] += partial[m][g] * scale[g].
template <int MR, int G>
K3_TARGET_BF16 inline void apply_scales(const uint8_t* scales, __m512 (&acc)[MR][G], float* totals) {
  __m512 s[G];
  for (int g = 0; g < G; ++g) s[g] = scale_vector(scales + g * kLanes);
  for (int m = 0; m < MR; ++m) {
    for (int g = 0; g < G; ++g) {
      float* t = totals + (m * G + g) * kLanes;
      _mm512_storeu_ps(t, _mm512_fmadd_ps(acc[m][g], s[g], _mm512_loadu_ps(t)));
    }
  }
}

// Direct path: records are streamed from memory once, with software prefetch kAhead records
// ahead on Intel CPUs (cpu/prefetch.hpp): on a 2-vCPU Intel Xeon (Emerald Rapids) guest `k3 bench
// moe --m 1,8 --recipe both` took 6.9 ms at M = 1 (W4A8) with it against 8.8 ms without, M = 8
// 32.9 against 39.5 ms (three alternated runs each). On AMD Zen 4 the hardware prefetcher alone
// was faster: prefetching 8 records ahead made M = 1 (W4A16) 4.65 ms against 4.12 ms without
// (five alternated runs, 2026-12-05). The prefetch of the later record is spread over the block's
// k-pairs, one line each (its scale line first), and runs on past the tile's end into the next
// tile of the expert, which follows in memory (a prefetch never faults): M = 1 W4A8 then took
// 5.66-5.82 against 5.90-6.30 ms on the Xeon (three alternated runs).
inline constexpr int64_t kAhead = 4;
inline bool prefetch_direct_records() { return prefetch_single_streams(); }


// Direct, one block by VDPBF16PS: acc[m][g] = the block's partial sums.
template <int MR, int G>
__attribute__((always_inline)) K3_TARGET_BF16 inline void block_bf16(const uint8_t* r, int64_t b, __m512i table,
                                                                     const uint16_t* const* rows, __m512 (&acc)[MR][G],
                                                                     const uint8_t* prefetch) {
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < G; ++g) acc[m][g] = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int kp = 0; kp < kPairs; ++kp) {
    if (prefetch != nullptr) prefetch_line(prefetch + kp * (record_code_bytes(G) / kPairs));
    __m512i w[G];
    for (int p = 0; p < G / 2; ++p) expand_pair(r + (kp * (G / 2) + p) * 32, table, w[2 * p], w[2 * p + 1]);
    for (int m = 0; m < MR; ++m) {
      const __m512bh x = (__m512bh)broadcast_pair(rows[m], b * kBlock + 2 * kp);
      for (int g = 0; g < G; ++g) acc[m][g] = _mm512_dpbf16_ps(acc[m][g], (__m512bh)w[g], x);
    }
  }
}

// Direct, one block whose rows all have an integer view: the same partial sums, exactly, from
// int32 sums of 2w * xi (VPDPWSSD) times each row's 2^(e-15).
template <int MR, int G>
__attribute__((always_inline)) K3_TARGET_BF16_VNNI inline void block_int(const uint8_t* r, int64_t b, __m512i table,
                                                                         const uint16_t* const* xi,
                                                                         const float* const* half, __m512 (&acc)[MR][G],
                                                                         const uint8_t* prefetch) {
  // With at most 4 accumulators VPDPWSSD's latency (5 cycles) would bound the loop: then two
  // chains, even and odd k-pairs, added at the end (int32 sums: exact in any order).
  constexpr int kChains = MR * G <= 4 ? 2 : 1;
  __m512i iacc[kChains][MR][G];
  for (int c = 0; c < kChains; ++c)
    for (int m = 0; m < MR; ++m)
      for (int g = 0; g < G; ++g) iacc[c][m][g] = _mm512_setzero_si512();
#pragma GCC unroll 16
  for (int kq = 0; kq < kPairs; kq += kChains) {
    for (int c = 0; c < kChains; ++c) {
      const int kp = kq + c;
      if (prefetch != nullptr) prefetch_line(prefetch + kp * (record_code_bytes(G) / kPairs));
      __m512i w[G];
      for (int p = 0; p < G / 2; ++p) expand_pair(r + (kp * (G / 2) + p) * 32, table, w[2 * p], w[2 * p + 1]);
      for (int m = 0; m < MR; ++m) {
        const __m512i x = broadcast_pair(xi[m], b * kBlock + 2 * kp);
        for (int g = 0; g < G; ++g) iacc[c][m][g] = _mm512_dpwssd_epi32(iacc[c][m][g], w[g], x);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    const __m512 h = _mm512_set1_ps(half[m][b]);
    for (int g = 0; g < G; ++g) {
      const __m512i sum = kChains == 2 ? _mm512_add_epi32(iacc[0][m][g], iacc[kChains - 1][m][g]) : iacc[0][m][g];
      acc[m][g] = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), h);
    }
  }
}

// Direct: MR rows, every block of the tile, weights expanded in registers.
template <int MR, int G>
K3_TARGET_BF16 void direct_rows(const TileGemm& a, const uint16_t* const* rows, float* totals) {
  const bool prefetch = prefetch_direct_records();
  const __m512i table = e2m1_bf16_table();
  const int64_t rec = record_bytes(G);
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* r = a.records + b * rec;
    const uint8_t* ahead = prefetch ? r + kAhead * rec : nullptr;
    if (ahead != nullptr) prefetch_line(ahead + record_code_bytes(G));  // its scales
    __m512 acc[MR][G];
    block_bf16<MR, G>(r, b, table, rows, acc, ahead);
    float* t = totals;  // opaque: see panel_rows
    __asm__("" : "+r"(t));
    apply_scales<MR, G>(r + record_code_bytes(G), acc, t);
  }
}

// The same with the rows' integer views (a.views): a block viewed in every row takes block_int.
template <int MR, int G>
K3_TARGET_BF16_VNNI void direct_rows_int(const TileGemm& a, const uint16_t* const* rows, float* totals) {
  const bool prefetch = prefetch_direct_records();
  const __m512i table = e2m1_bf16_table();
  const __m512i itable = _mm512_load_si512(kTwiceE2M1);
  const int64_t rec = record_bytes(G);
  const uint16_t* xi[MR];
  const float* half[MR];
  for (int m = 0; m < MR; ++m) {
    xi[m] = reinterpret_cast<const uint16_t*>(a.views[m]);
    half[m] = reinterpret_cast<const float*>(a.views[m] + a.blocks * kBlock);
  }
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* r = a.records + b * rec;
    const uint8_t* ahead = prefetch ? r + kAhead * rec : nullptr;
    if (ahead != nullptr) prefetch_line(ahead + record_code_bytes(G));  // its scales
    __m512 acc[MR][G];
    bool viewed = true;
    for (int m = 0; m < MR; ++m) viewed = viewed && half[m][b] != 0.f;
    if (viewed) {
      block_int<MR, G>(r, b, itable, xi, half, acc, ahead);
    } else {
      block_bf16<MR, G>(r, b, table, rows, acc, ahead);
    }
    float* t = totals;  // opaque: see panel_rows
    __asm__("" : "+r"(t));
    apply_scales<MR, G>(r + record_code_bytes(G), acc, t);
  }
}

// Dequantize blocks [b0, b1) of the tile into the panel: [block][kp][G][32 BF16].
template <int G>
K3_TARGET_BF16 void fill_panel(const TileGemm& a, int64_t b0, int64_t b1, uint16_t* panel) {
  const __m512i table = e2m1_bf16_table();
  const int64_t rec = record_bytes(G);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* r = a.records + b * rec;
    uint16_t* dst = panel + (b - b0) * kPairs * G * 32;
    for (int kp = 0; kp < kPairs; ++kp) {
      for (int p = 0; p < G / 2; ++p) {
        __m512i lo, hi;
        expand_pair(r + (kp * (G / 2) + p) * 32, table, lo, hi);
        _mm512_storeu_si512(dst + (kp * G + 2 * p) * 32, lo);
        _mm512_storeu_si512(dst + (kp * G + 2 * p + 1) * 32, hi);
      }
    }
  }
}

// Panel: MR rows over blocks [b0, b1) whose dequantized weights are in the panel, with the MR x G
// totals held in registers across the blocks (loaded and stored once per panel pass, not once
// per block): MR*G accumulators + MR*G totals + G weights + 1 broadcast <= 32 zmm registers.
// With 6 x 64 / 12 x 32 tiles and the totals in memory, `k3 bench moe` at M = 128 and 512 took
// 7-9 % longer (three alternated runs, Zen 4 guest, 2 threads).
template <int MR, int G>
K3_TARGET_BF16 void panel_rows(const TileGemm& a, int64_t b0, int64_t b1, const uint16_t* panel,
                                   const uint16_t* const* rows, float* totals) {
  __m512 tv[MR][G];
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < G; ++g) tv[m][g] = _mm512_loadu_ps(totals + (m * G + g) * kLanes);
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* pw = panel + (b - b0) * kPairs * G * 32;
    __m512 acc[MR][G];
    for (int m = 0; m < MR; ++m)
      for (int g = 0; g < G; ++g) acc[m][g] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int kp = 0; kp < kPairs; ++kp) {
      __m512i w[G];
      for (int g = 0; g < G; ++g) w[g] = _mm512_loadu_si512(pw + (kp * G + g) * 32);
      for (int m = 0; m < MR; ++m) {
        const __m512bh x = (__m512bh)broadcast_pair(rows[m], b * kBlock + 2 * kp);
        for (int g = 0; g < G; ++g) acc[m][g] = _mm512_dpbf16_ps(acc[m][g], (__m512bh)w[g], x);
      }
    }
    const uint8_t* sc = a.records + b * record_bytes(G) + record_code_bytes(G);
    for (int g = 0; g < G; ++g) {
      const __m512 s = scale_vector(sc + g * kLanes);
      for (int m = 0; m < MR; ++m) tv[m][g] = _mm512_fmadd_ps(acc[m][g], s, tv[m][g]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(totals + (m * G + g) * kLanes, tv[m][g]);
}

// Largest register tile: MR*G = 12 accumulators (and 12 totals).
template <int G>
constexpr int kPanelMr = G == 4 ? 3 : 6;

template <int G, bool kInt, int MR = 1>
K3_TARGET_BF16 void direct_dispatch(const TileGemm& a, int64_t rows, const uint16_t* const* r, float* t) {
  if constexpr (MR < kDirectMaxRows) {
    if (rows != MR) return direct_dispatch<G, kInt, MR + 1>(a, rows, r, t);
  }
  if constexpr (kInt) {
    direct_rows_int<MR, G>(a, r, t);
  } else {
    direct_rows<MR, G>(a, r, t);
  }
}

template <int G, int MR = 1>
K3_TARGET_BF16 void panel_dispatch(const TileGemm& a, int64_t rows, int64_t b0, int64_t b1, const uint16_t* panel,
                                   const uint16_t* const* r, float* t) {
  if constexpr (MR < kPanelMr<G>) {
    if (rows != MR) return panel_dispatch<G, MR + 1>(a, rows, b0, b1, panel, r, t);
  }
  panel_rows<MR, G>(a, b0, b1, panel, r, t);
}

template <int G, bool kVnni>
K3_TARGET_BF16 void tile_gemm(const TileGemm& a) {
  const uint16_t* rows[kRowGroup];  // [num_rows] BF16 operand rows
  for (int64_t i = 0; i < a.num_rows; ++i) rows[i] = static_cast<const uint16_t*>(a.rows[i]);
  const int64_t width = G * kLanes;
  std::memset(a.totals, 0, static_cast<size_t>(a.num_rows * width) * sizeof(float));
  if (a.num_rows <= kDirectMaxRows) {
    if (kVnni && a.views != nullptr) {
      direct_dispatch<G, true>(a, a.num_rows, rows, a.totals);
    } else {
      direct_dispatch<G, false>(a, a.num_rows, rows, a.totals);
    }
    return;
  }
  auto* panel = static_cast<uint16_t*>(a.panel);
  for (int64_t b0 = 0; b0 < a.blocks; b0 += kPanelBlocks) {
    const int64_t b1 = b0 + kPanelBlocks < a.blocks ? b0 + kPanelBlocks : a.blocks;
    fill_panel<G>(a, b0, b1, panel);
    // Near-equal register tiles (FC2, 37 rows: 7 tiles of 5 or 6 rows, not 6 x 6 + 1), so that
    // no tile streams the whole panel for one or two rows of work.
    const int64_t tiles = (a.num_rows + kPanelMr<G> - 1) / kPanelMr<G>;
    for (int64_t i = 0, m0 = 0; i < tiles; ++i) {
      const int64_t mr = (a.num_rows - m0) / (tiles - i);
      panel_dispatch<G>(a, mr, b0, b1, panel, rows + m0, a.totals + m0 * width);
      m0 += mr;
    }
  }
}

template <bool kVnni>
void tile_gemm_entry(const TileGemm& a) {
  if (a.groups == kFc1Groups) {
    tile_gemm<kFc1Groups, kVnni>(a);
  } else {
    tile_gemm<kFc2Groups, kVnni>(a);
  }
}

}  // namespace

// With AVX512-VNNI the kernel reads the integer views a task carries; without, it never does
// (and uses_int_views() makes none).
TileGemmFn tile_gemm_bf16() {
  return cpu_info().features.avx512_vnni ? tile_gemm_entry<true> : tile_gemm_entry<false>;
}

}  // namespace k3::cpu::detail
