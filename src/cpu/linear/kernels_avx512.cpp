// The linear kernels on AVX-512: the FP32 stream and panel kernels (16-lane ZMM, 32 registers;
// see kernels_fp32_impl.hpp) and, on the avx512bf16 level, the VDPBF16PS panel kernel.
#include <immintrin.h>

#include "cpu/linear/kernels.hpp"

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
constexpr int kVw = 16;
constexpr int kPanelRows = 12;  // 12 accumulators + 1 weight vector + 1 broadcast
K3_LIN_TARGET inline vf zero() { return _mm512_setzero_ps(); }
K3_LIN_TARGET inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
K3_LIN_TARGET inline vf bcast(const float* p) { return _mm512_set1_ps(*p); }
K3_LIN_TARGET inline vf load(const float* p) { return _mm512_loadu_ps(p); }
K3_LIN_TARGET inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
K3_LIN_TARGET inline __m256i fp16_of(const uint8_t* c) {
  const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  return _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
}
K3_LIN_TARGET inline void decode16(const uint8_t* c, vf (&w)[1]) { w[0] = _mm512_cvtph_ps(fp16_of(c)); }
K3_LIN_TARGET inline vf scale16(const uint8_t* s) {
  const __m512i e = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))), 23);
  return _mm512_castsi512_ps(_mm512_max_epi32(e, _mm512_set1_epi32(0x00400000)));
}
K3_LIN_TARGET inline void scales16(const uint8_t* s, vf (&sc)[1]) { sc[0] = scale16(s); }
}  // namespace
}  // namespace k3::cpu::lin::avx512

#include "cpu/linear/kernels_fp32_impl.hpp"

namespace k3::cpu::lin {

// Accumulators per pass: rows x tiles in flight = 8 (1 and 2 rows) or 16 (3..8 rows: 2 tiles).
K3_LIN_TARGET void stream_avx512(const PackedLinear& w, const Operand& x, int64_t t0, int64_t t1, float* tot) {
  using namespace avx512;
  const int64_t ldt = (t1 - t0) * kLanes;
  switch (x.rows) {
    case 1: return stream_range<1, 8>(w, x, 0, t0, t1, tot, ldt);
    case 2: return stream_range<2, 4>(w, x, 0, t0, t1, tot, ldt);
    case 3: return stream_range<3, 2>(w, x, 0, t0, t1, tot, ldt);
    case 4: return stream_range<4, 2>(w, x, 0, t0, t1, tot, ldt);
    case 5: return stream_range<5, 2>(w, x, 0, t0, t1, tot, ldt);
    case 6: return stream_range<6, 2>(w, x, 0, t0, t1, tot, ldt);
    case 7: return stream_range<7, 2>(w, x, 0, t0, t1, tot, ldt);
    default: return stream_range<8, 2>(w, x, 0, t0, t1, tot, ldt);
  }
}

K3_LIN_TARGET void panel_avx512(const PackedLinear& w, const Operand& x, int64_t tile, void* panel, float* tot) {
  avx512::panel(w, x, tile, panel, tot);
}

// ---- avx512bf16: VDPBF16PS panel -------------------------------------------------------------
#define K3_LIN_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))

namespace {

constexpr int kBf16Rows = 16;  // 16 accumulators + 1 weight vector + 1 broadcast

// Blocks [b0, b0 + nb) of one tile as BF16 pairs of w' = w 2^-8: [block][pair][16 columns] u32,
// low half the even k, high half the odd k (exact: w' has 4 significant bits and is >= 2^-17).
K3_LIN_BF16 void build_panel_bf16(const uint8_t* codes, int64_t b0, int64_t nb, uint32_t* panel) {
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t bb = 0; bb < nb; ++bb)
    for (int p = 0; p < kBlock / 2; ++p) {
      const uint8_t* c = codes + ((b0 + bb) * kBlock + 2 * p) * kLanes;  // stored k = 2p+1, then 2p
      const __m512i odd = _mm512_castps_si512(_mm512_cvtph_ps(avx512::fp16_of(c)));
      const __m512i even = _mm512_castps_si512(_mm512_cvtph_ps(avx512::fp16_of(c + kLanes)));
      const __m512i pair = _mm512_or_si512(_mm512_and_si512(odd, hi), _mm512_srli_epi32(even, 16));
      _mm512_storeu_si512(panel + (bb * (kBlock / 2) + p) * kLanes, pair);
    }
}

template <int R>
K3_LIN_BF16 void bf16_rows(const uint32_t* panel, const uint8_t* scales, const Operand& x, int64_t k_dim, int r0,
                           int64_t b0, int64_t nb, float* tot) {
  (void)k_dim;
  for (int64_t bb = 0; bb < nb; ++bb) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const uint32_t* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = x.xb + static_cast<int64_t>(r0 + r) * x.ldb + (b0 + bb) * (kBlock / 2);
    const uint32_t* pw = panel + bb * (kBlock / 2) * kLanes;
#pragma GCC unroll 4
    for (int p = 0; p < kBlock / 2; ++p) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(pw + p * kLanes);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], wv, (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[r][p])));
    }
    const __m512 sc = avx512::scale16(scales + (b0 + bb) * kLanes);
    for (int r = 0; r < R; ++r) {
      float* t = tot + static_cast<int64_t>(r0 + r) * kLanes;
      _mm512_storeu_ps(t, _mm512_fmadd_ps(acc[r], sc, _mm512_loadu_ps(t)));
    }
  }
}

template <int R>
K3_LIN_BF16 void bf16_dispatch(int rr, const uint32_t* panel, const uint8_t* scales, const Operand& x, int64_t k_dim,
                               int r0, int64_t b0, int64_t nb, float* tot) {
  if constexpr (R > 1) {
    if (rr < R) return bf16_dispatch<R - 1>(rr, panel, scales, x, k_dim, r0, b0, nb, tot);
  }
  bf16_rows<R>(panel, scales, x, k_dim, r0, b0, nb, tot);
}

}  // namespace

K3_LIN_BF16 void panel_bf16(const PackedLinear& w, const Operand& x, int64_t tile, void* panel_mem, float* tot) {
  const int64_t k_dim = w.k(), blocks = k_dim / kBlock;
  auto* pan = static_cast<uint32_t*>(panel_mem);
  for (int64_t i = 0; i < static_cast<int64_t>(x.rows) * kLanes; ++i) tot[i] = 0.0f;
  for (int64_t b0 = 0; b0 < blocks; b0 += kPanelBlocks) {
    const int64_t nb = blocks - b0 < kPanelBlocks ? blocks - b0 : kPanelBlocks;
    build_panel_bf16(w.tile_codes(tile), b0, nb, pan);
    for (int r0 = 0; r0 < x.rows; r0 += kBf16Rows) {
      const int rr = x.rows - r0 < kBf16Rows ? x.rows - r0 : kBf16Rows;
      bf16_dispatch<kBf16Rows>(rr, pan, w.tile_scales(tile), x, k_dim, r0, b0, nb, tot);
    }
  }
}

}  // namespace k3::cpu::lin
