// The linear kernels on AVX-512: the FP32 stream and panel kernels (16-lane ZMM, 32 registers;
// see kernels_fp32_impl.hpp) and, on the avx512bf16 level, the VDPBF16PS panel kernel.
#include <immintrin.h>

#include "cpu/linear/kernels.hpp"
#include "cpu/prefetch.hpp"
#include "k3/formats.hpp"
#include "k3/system.hpp"

// GCC 12 reports its own _mm512_undefined_* helpers as "used uninitialized" (avx512fintrin.h).
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define K3_LIN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define K3_LIN_NS avx512

namespace k3::cpu::lin::avx512 {
namespace {
using vf = __m512;
using vi = __m512i;
constexpr int kVw = 16;
constexpr int kPanelRows = 12;  // 12 accumulators + 1 weight vector + 1 broadcast
K3_LIN_TARGET inline vf zero() { return _mm512_setzero_ps(); }
K3_LIN_TARGET inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
K3_LIN_TARGET inline vf bcast(const float* p) { return _mm512_set1_ps(*p); }
K3_LIN_TARGET inline vf load(const float* p) { return _mm512_loadu_ps(p); }
K3_LIN_TARGET inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
// Per 16-bit word, the high byte's code shifted into place (codes 3 and 1 of each 32-bit word:
// hi) and the low byte's (codes 2 and 0: lo), with sign copies and neighbours' bits around them.
K3_LIN_TARGET inline void quad_split(const uint8_t* c, __m512i& hi, __m512i& lo) {
  const __m512i v = _mm512_loadu_si512(c);
  hi = _mm512_srai_epi16(v, 4);
  lo = _mm512_srai_epi16(_mm512_bslli_epi128(v, 1), 4);
}
// Stored k 4q + s of the quad: w 2^-120 (the mask keeps the sign, exponent and mantissa).
K3_LIN_TARGET inline vf quad_slot(__m512i hi, __m512i lo, int s) {
  const __m512i m = _mm512_set1_epi32(static_cast<int>(0x87F00000u));
  const __m512i t = s == 3 ? hi : s == 2 ? lo : s == 1 ? _mm512_bslli_epi128(hi, 2) : _mm512_bslli_epi128(lo, 2);
  return _mm512_castsi512_ps(_mm512_and_si512(t, m));
}
// 16 columns x 4 stored k of E4M3 codes (64 bytes) -> 4 vectors of w 2^-120 (kernels_fp32_impl.hpp).
K3_LIN_TARGET inline void decode_quad(const uint8_t* c, vf (&w)[4]) {
  __m512i hi, lo;
  quad_split(c, hi, lo);
  for (int s = 0; s < 4; ++s) w[s] = quad_slot(hi, lo, s);
}
// w 2^-120 -> w 2^-8 (exact: subnormal inputs, normal results; MXCSR.DAZ is clear in the kernels).
K3_LIN_TARGET inline vf times_2p112(vf a) { return _mm512_mul_ps(a, _mm512_set1_ps(0x1p112f)); }
// 16 BF16 weights (32 bytes) -> FP32: zero-extend to 32 bits and shift into the high half.
K3_LIN_TARGET inline void decode16_bf16(const uint8_t* c, vf (&w)[1]) {
  w[0] = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c))), 16));
}
K3_LIN_TARGET inline vf scale16(const uint8_t* s) {
  const __m512i e = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))), 23);
  return _mm512_castsi512_ps(_mm512_max_epi32(e, _mm512_set1_epi32(0x00400000)));
}
K3_LIN_TARGET inline void scales16(const uint8_t* s, vf (&sc)[1]) { sc[0] = scale16(s); }
}  // namespace
}  // namespace k3::cpu::lin::avx512

#include "cpu/linear/kernels_fp32_impl.hpp"

namespace k3::cpu::lin {

template <bool B16, bool X120>
K3_LIN_TARGET void stream_avx512_t(const PackedLinear& w, const Operand& x, int64_t t0, int64_t t1, float* tot) {
  using namespace avx512;
  const int64_t ldt = (t1 - t0) * kLanes;
  switch (x.rows) {
    case 1: return stream_range<1, B16 ? 1 : 2, B16, X120>(w, x, 0, t0, t1, tot, ldt);
    case 2: return stream_range<2, B16 ? 1 : 2, B16, X120>(w, x, 0, t0, t1, tot, ldt);
    case 3: return stream_range<3, 2, B16, X120>(w, x, 0, t0, t1, tot, ldt);
    case 4: return stream_range<4, 2, B16, X120>(w, x, 0, t0, t1, tot, ldt);
    case 5: return stream_range<5, 2, B16, X120>(w, x, 0, t0, t1, tot, ldt);
    case 6: return stream_range<6, X120 || B16 ? 2 : 1, B16, X120>(w, x, 0, t0, t1, tot, ldt);  // 2 x 2^112: spills
    case 7: return stream_range<7, B16 ? 2 : 1, B16, X120>(w, x, 0, t0, t1, tot, ldt);
    default: return stream_range<8, B16 ? 2 : 1, B16, X120>(w, x, 0, t0, t1, tot, ldt);
  }
}

// Tiles in flight: 2 (each tile is a separate memory stream; fewer streams per thread stream
// faster), E4M3 with 7 and 8 rows (and 6 on the w 2^-8 kernel) 1: the stream kernel holds at most
// 12 accumulators, and GCC spilled the 6-row, 2-tile w 2^-8 kernel.
K3_LIN_TARGET void stream_avx512(const PackedLinear& w, const Operand& x, int64_t t0, int64_t t1, float* tot) {
  if (w.bf16_weights()) return stream_avx512_t<true, false>(w, x, t0, t1, tot);
  if (x.x120) return stream_avx512_t<false, true>(w, x, t0, t1, tot);
  stream_avx512_t<false, false>(w, x, t0, t1, tot);
}

K3_LIN_TARGET void panel_avx512(const PackedLinear& w, const Operand& x, int64_t tile, void* panel, float* tot) {
  if (w.bf16_weights()) return avx512::panel<true>(w, x, tile, panel, tot);
  avx512::panel<false>(w, x, tile, panel, tot);
}

// ---- avx512bf16: VDPBF16PS kernels on the pair layout ----------------------------------------
#define K3_LIN_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi,gfni,avx2,fma,f16c")))

bool bf16_kernels_available() {
  const auto& f = cpu_info().features;
  return f.avx512_bf16 && f.avx512_vbmi && f.gfni && f.avx512bw && f.avx512vl && f.f16c && f.fma;
}

namespace {

constexpr int kBf16Rows = 12;  // panel, one tile: 12 accumulators + 12 totals + 1 weight vector + 1 broadcast

// Low and high byte of the BF16 pattern of w 2^-8 for each E4M3 magnitude w (0 .. 127; 127 is NaN, never
// present after prepack), for VPERMT2B: [0, 64) in the first register, [64, 128) in the second.
struct E4m3Tables {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  E4m3Tables() {
    for (int c = 0; c < 128; ++c) {
      // w 2^-8 (the rows hold x 2^8): exact, a normal BF16 even for the subnormal codes (2^-17 up).
      const uint16_t b = bf16_from_f32(e4m3_to_f32(static_cast<uint8_t>(c)) * 0x1p-8f);
      lo[c] = static_cast<uint8_t>(b & 0xFF);
      hi[c] = static_cast<uint8_t>(b >> 8);
    }
  }
};
const E4m3Tables kTables;

// E4M3 codes -> BF16 words of w * 2^-8, 64 codes (one group: two k-pairs x 16 columns) at a time.
//
// A normal code s eeee mmm (e != 0) is the BF16 number s, exponent e + 112 = 0111eeee, mantissa
// mmm0000: high byte s 0111 e3 e2 e1, low byte e0 m2 m1 m0 0000. Both bytes are affine maps of the
// code's bits over GF(2), so one VGF2P8AFFINEQB each computes them (result bit i of a byte is the
// parity of the code AND matrix byte 7 - i, XOR bit i of the constant): low byte: matrix bytes 0-3
// pick code bits 3, 2, 1, 0 into bits 7-4; high byte: matrix byte 0 picks bit 7 (the sign), bytes
// 5-7 bits 6, 5, 4 into bits 2-0, and the constant 0x38 sets bits 5-3. Then VPUNPCK{L,H}BW
// interleave them. Zero and subnormal codes (e == 0) do not follow the pattern: blocks holding one
// take the lookup (two VPERMT2B of the BF16 bytes of each magnitude, the sign ORed in). On the
// Emerald Rapids guest the lookup cost 55 ns per KiB of codes in the M = 1 stream loop from L2,
// the bit moves 40 (one core; docs/linear.md).
struct Decoder {
  __m512i lo_a, lo_b, hi_a, hi_b, sign, m_lo, m_hi;
  K3_LIN_BF16 Decoder()
      : lo_a(_mm512_load_si512(kTables.lo)),
        lo_b(_mm512_load_si512(kTables.lo + 64)),
        hi_a(_mm512_load_si512(kTables.hi)),
        hi_b(_mm512_load_si512(kTables.hi + 64)),
        sign(_mm512_set1_epi8(static_cast<char>(0x80))),
        m_lo(_mm512_set1_epi64(0x0000000001020408LL)),
        m_hi(_mm512_set1_epi64(0x1020400000000080LL)) {}
  // Any code but NaN.
  K3_LIN_BF16 inline void decode(const uint8_t* p, __m512i& pair0, __m512i& pair1) const {
    const __m512i c = _mm512_loadu_si512(p);
    const __m512i lo = _mm512_permutex2var_epi8(lo_a, c, lo_b);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi_a, c, hi_b), c, sign, 0xF8);  // hi | (c & 0x80)
    pair0 = _mm512_unpacklo_epi8(lo, hi);
    pair1 = _mm512_unpackhi_epi8(lo, hi);
  }
  // Normal codes only (exponent field != 0).
  K3_LIN_BF16 inline void decode_normal(const uint8_t* p, __m512i& pair0, __m512i& pair1) const {
    const __m512i c = _mm512_loadu_si512(p);
    const __m512i lo = _mm512_gf2p8affine_epi64_epi8(c, m_lo, 0);
    const __m512i hi = _mm512_gf2p8affine_epi64_epi8(c, m_hi, 0x38);
    pair0 = _mm512_unpacklo_epi8(lo, hi);
    pair1 = _mm512_unpackhi_epi8(lo, hi);
  }
  template <bool Normal>
  K3_LIN_BF16 inline void group(const uint8_t* p, __m512i& pair0, __m512i& pair1) const {
    if constexpr (Normal) decode_normal(p, pair0, pair1);
    else decode(p, pair0, pair1);
  }
};

K3_LIN_BF16 inline __m512 dp(__m512 acc, __m512i w, uint32_t xpair) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(static_cast<int>(xpair)));
}

// One block of G tiles for R rows (pairs in order, each accumulator one chain).
template <int R, int G, bool Normal>
K3_LIN_BF16 inline void stream_block_bf16(const Decoder& d, const uint8_t* const* codes, const uint32_t* const* xr,
                                          __m512 (&acc)[R][G]) {
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int grp = 0; grp < kBlock / 4; ++grp) {
    for (int g = 0; g < G; ++g) {
      __m512i w0, w1;
      d.group<Normal>(codes[g] + grp * 64, w0, w1);
      for (int r = 0; r < R; ++r) {
        acc[r][g] = dp(acc[r][g], w0, xr[r][2 * grp]);
        acc[r][g] = dp(acc[r][g], w1, xr[r][2 * grp + 1]);
      }
    }
  }
}

template <int R, int G>
K3_LIN_BF16 void stream_rows_bf16(const PackedLinear& w, const Operand& x, int64_t t_begin, int64_t t_end,
                                  int64_t t_base, float* tot, int64_t ldt) {
  const Decoder d;
  const bool prefetch = k3::cpu::detail::prefetch_single_streams();
  constexpr int64_t kAhead = 4;  // blocks of software prefetch ahead (2 to 16 tried: 4 best)
  const int64_t blocks = w.k() / kBlock;
  for (int64_t t = t_begin; t < t_end; t += G) {
    float* trow[R];
    for (int r = 0; r < R; ++r) {
      trow[r] = tot + static_cast<int64_t>(r) * ldt + (t - t_base) * kLanes;
      for (int c = 0; c < G * kLanes; ++c) trow[r][c] = 0.0f;
    }
    const uint8_t* tc[G];
    const uint8_t* ts[G];
    const uint8_t* tn[G];
    for (int g = 0; g < G; ++g) {
      tc[g] = w.tile_codes(t + g);
      ts[g] = w.tile_scales(t + g);
      tn[g] = w.tile_normal(t + g);
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* codes[G];
      for (int g = 0; g < G; ++g) {
        codes[g] = tc[g] + b * (kBlock * kLanes);
        // Software prefetch with two tiles in flight (M >= 3: about 5 % faster at M = 8), and on
        // Intel with one (cpu/prefetch.hpp). With one stream per thread (M <= 2) the Zen 4
        // guest's hardware prefetcher did better alone: M = 1 went from 31 to 33 GB/s, and from
        // 35-38 to 42-44 GB/s in the minutes when the read-bandwidth probe reads 45-50 GB/s,
        // without it.
        // Near the end of the tiles it prefetches the next tiles of this range, and the scale
        // stream one line per 4 blocks (prefetch_stream_ahead, shared with the FP32 stream
        // kernels): with the prefetch stopping 4
        // blocks before each tile's end, M = 1 on the Emerald Rapids guest lost about 2 % at
        // K = 7168 and 5 % at K = 1536 (docs/linear.md).
        if (G == 2 || prefetch) prefetch_stream_ahead(w, tc[g], ts[g], b, blocks, t + G + g, t_end, kBlock * kLanes, kAhead);
      }
      const uint32_t* xr[R];
      for (int r = 0; r < R; ++r) xr[r] = x.xb + static_cast<int64_t>(r) * x.ldb + b * (kBlock / 2);
      __m512 acc[R][G];
      bool normal = true;
      for (int g = 0; g < G; ++g) normal = normal && tn[g][b] != 0;
      if (normal) stream_block_bf16<R, G, true>(d, codes, xr, acc);
      else stream_block_bf16<R, G, false>(d, codes, xr, acc);
      for (int g = 0; g < G; ++g) {
        const __m512 sc = avx512::scale16(ts[g] + b * kLanes);
        for (int r = 0; r < R; ++r) {
          float* p = trow[r] + g * kLanes;
          _mm512_storeu_ps(p, _mm512_fmadd_ps(acc[r][g], sc, _mm512_loadu_ps(p)));
        }
      }
    }
  }
}

template <int R, int G>
K3_LIN_BF16 void stream_range_bf16(const PackedLinear& w, const Operand& x, int64_t t0, int64_t t1, float* tot) {
  const int64_t ldt = (t1 - t0) * kLanes;
  const int64_t full = t0 + (t1 - t0) / G * G;
  if (full > t0) stream_rows_bf16<R, G>(w, x, t0, full, t0, tot, ldt);
  if (full < t1) stream_rows_bf16<R, 1>(w, x, full, t1, t0, tot, ldt);
}

// Blocks [b0, b0 + nb) of one tile as BF16 pairs of w 2^-8: [block][pair][16 columns] u32 (bit moves
// for the blocks the prepack marked normal, the lookup for the others).
template <bool Normal>
K3_LIN_BF16 inline void panel_block_bf16(const Decoder& d, const uint8_t* codes, uint32_t* panel) {
  for (int grp = 0; grp < kBlock / 4; ++grp) {
    __m512i w0, w1;
    d.group<Normal>(codes + grp * 64, w0, w1);
    _mm512_storeu_si512(panel + (2 * grp) * kLanes, w0);
    _mm512_storeu_si512(panel + (2 * grp + 1) * kLanes, w1);
  }
}

K3_LIN_BF16 void build_panel_bf16(const Decoder& d, const uint8_t* codes, const uint8_t* normal, int64_t b0, int64_t nb,
                                  uint32_t* panel) {
  for (int64_t bb = 0; bb < nb; ++bb) {
    const uint8_t* c = codes + (b0 + bb) * 8 * 64;
    uint32_t* p = panel + bb * (kBlock / 2) * kLanes;
    if (normal[b0 + bb]) panel_block_bf16<true>(d, c, p);
    else panel_block_bf16<false>(d, c, p);
  }
}

// R rows x G tiles (G panels side by side), blocks [b0, b0 + nb): R x G accumulators, one weight
// vector per tile and one broadcast per row and pair (G = 2: a broadcast feeds two dot products),
// and the R x G totals held in registers across the blocks (loaded once, stored once; with 12 x 2
// tiles and the totals loaded and stored every block, M = 256 ran at 56-71 % of the VDPBF16PS
// peak, with 6 x 2 and register totals at 72-80 %).
template <int R, int G>
K3_LIN_BF16 void bf16_rows(const uint32_t* const* panel, const uint8_t* const* scales, const Operand& x, int r0,
                               int64_t b0, int64_t nb, float* tot) {
  __m512 tv[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) tv[r][g] = _mm512_loadu_ps(tot + static_cast<int64_t>(r0 + r) * G * kLanes + g * kLanes);
  const uint32_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x.xb + static_cast<int64_t>(r0 + r) * x.ldb + b0 * (kBlock / 2);
  for (int64_t bb = 0; bb < nb; ++bb) {
    __m512 acc[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int p = 0; p < kBlock / 2; ++p) {
      __m512i wv[G];
      for (int g = 0; g < G; ++g) wv[g] = _mm512_loadu_si512(panel[g] + (bb * (kBlock / 2) + p) * kLanes);
      for (int r = 0; r < R; ++r) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[r][bb * (kBlock / 2) + p]));
        for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], (__m512bh)wv[g], xb);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 sc = avx512::scale16(scales[g] + (b0 + bb) * kLanes);
      for (int r = 0; r < R; ++r) tv[r][g] = _mm512_fmadd_ps(acc[r][g], sc, tv[r][g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(tot + static_cast<int64_t>(r0 + r) * G * kLanes + g * kLanes, tv[r][g]);
}

template <int R, int G>
K3_LIN_BF16 void bf16_dispatch(int rr, const uint32_t* const* panel, const uint8_t* const* scales, const Operand& x,
                               int r0, int64_t b0, int64_t nb, float* tot) {
  if constexpr (R > 1) {
    if (rr < R) return bf16_dispatch<R - 1, G>(rr, panel, scales, x, r0, b0, nb, tot);
  }
  bf16_rows<R, G>(panel, scales, x, r0, b0, nb, tot);
}

template <int G, int RT>
K3_LIN_BF16 void panel_bf16_tiles(const PackedLinear& w, const Operand& x, int64_t tile, uint32_t* pan, float* tot) {
  const Decoder d;
  const int64_t blocks = w.k() / kBlock;
  for (int64_t i = 0; i < static_cast<int64_t>(x.rows) * G * kLanes; ++i) tot[i] = 0.0f;
  const uint32_t* panels[G];
  const uint8_t* scales[G];
  for (int g = 0; g < G; ++g) {
    panels[g] = pan + g * kPanelBlocks * (kBlock / 2) * kLanes;
    scales[g] = w.tile_scales(tile + g);
  }
  for (int64_t b0 = 0; b0 < blocks; b0 += kPanelBlocks) {
    const int64_t nb = blocks - b0 < kPanelBlocks ? blocks - b0 : kPanelBlocks;
    for (int g = 0; g < G; ++g)
      build_panel_bf16(d, w.tile_codes(tile + g), w.tile_normal(tile + g), b0, nb,
                       pan + g * kPanelBlocks * (kBlock / 2) * kLanes);
    for (int r0 = 0; r0 < x.rows; r0 += RT) {
      const int rr = x.rows - r0 < RT ? x.rows - r0 : RT;
      bf16_dispatch<RT, G>(rr, panels, scales, x, r0, b0, nb, tot);
    }
  }
}

}  // namespace

// Tiles in flight: 1 at M = 1 and 2 (one memory stream per thread: 84-98 % of the read bandwidth
// against about 62 % with 8 on the Zen 4 guest), 2 at 3-8 rows. On Intel (software prefetch on,
// cpu/prefetch.hpp) 2 at M = 1 and 2 as well: on the Emerald Rapids guest M = 1 at 3584 -> 7168
// took 1.10 ms against 1.30 with one (three alternated runs).
K3_LIN_BF16 void stream_bf16(const PackedLinear& w, const Operand& x, int64_t t0, int64_t t1, float* tot) {
  const bool two = k3::cpu::detail::prefetch_single_streams();
  switch (x.rows) {
    case 1: return two ? stream_range_bf16<1, 2>(w, x, t0, t1, tot) : stream_range_bf16<1, 1>(w, x, t0, t1, tot);
    case 2: return two ? stream_range_bf16<2, 2>(w, x, t0, t1, tot) : stream_range_bf16<2, 1>(w, x, t0, t1, tot);
    case 3: return stream_range_bf16<3, 2>(w, x, t0, t1, tot);
    case 4: return stream_range_bf16<4, 2>(w, x, t0, t1, tot);
    case 5: return stream_range_bf16<5, 2>(w, x, t0, t1, tot);
    case 6: return stream_range_bf16<6, 2>(w, x, t0, t1, tot);
    case 7: return stream_range_bf16<7, 2>(w, x, t0, t1, tot);
    default: return stream_range_bf16<8, 2>(w, x, t0, t1, tot);
  }
}

// tiles: 1 or 2 (tot: [rows][tiles * 16]; panel: tiles x kPanelBytes / 2).
K3_LIN_BF16 void panel_bf16(const PackedLinear& w, const Operand& x, int64_t tile, int tiles, void* panel_mem,
                            float* tot) {
  auto* pan = static_cast<uint32_t*>(panel_mem);
  if (tiles == 2) panel_bf16_tiles<2, 6>(w, x, tile, pan, tot);  // 12 accumulators + 12 totals
  else panel_bf16_tiles<1, kBf16Rows>(w, x, tile, pan, tot);
}

}  // namespace k3::cpu::lin
