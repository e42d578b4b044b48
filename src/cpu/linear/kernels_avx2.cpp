// The FP32 linear kernels on AVX2 + FMA (8-lane YMM, 16 registers). See kernels_fp32_impl.hpp.
#include <immintrin.h>

#include "cpu/linear/kernels.hpp"

#define K3_LIN_TARGET __attribute__((target("avx2,fma")))
#define K3_LIN_NS avx2

namespace k3::cpu::lin::avx2 {
namespace {
using vf = __m256;
using vi = __m256i;
constexpr int kVw = 8;
constexpr int kPanelRows = 6;  // 6 rows x 2 vectors = 12 accumulators + 2 weights + 1 broadcast
K3_LIN_TARGET inline vf zero() { return _mm256_setzero_ps(); }
K3_LIN_TARGET inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
K3_LIN_TARGET inline vf bcast(const float* p) { return _mm256_broadcast_ss(p); }
K3_LIN_TARGET inline vf load(const float* p) { return _mm256_loadu_ps(p); }
K3_LIN_TARGET inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
// Per 16-bit word, the high byte's code shifted into place (codes 3 and 1 of each 32-bit word:
// hi) and the low byte's (codes 2 and 0: lo), with sign copies and neighbours' bits around them.
K3_LIN_TARGET inline void quad_split(const uint8_t* c, __m256i& hi, __m256i& lo) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
  hi = _mm256_srai_epi16(v, 4);
  lo = _mm256_srai_epi16(_mm256_bslli_epi128(v, 1), 4);
}
// Stored k 4q + s of the quad: w 2^-120 (the mask keeps the sign, exponent and mantissa).
K3_LIN_TARGET inline vf quad_slot(__m256i hi, __m256i lo, int s) {
  const __m256i m = _mm256_set1_epi32(static_cast<int>(0x87F00000u));
  const __m256i t = s == 3 ? hi : s == 2 ? lo : s == 1 ? _mm256_bslli_epi128(hi, 2) : _mm256_bslli_epi128(lo, 2);
  return _mm256_castsi256_ps(_mm256_and_si256(t, m));
}
// 8 columns x 4 stored k of E4M3 codes (32 bytes) -> 4 vectors of w 2^-120 (kernels_fp32_impl.hpp).
K3_LIN_TARGET inline void decode_quad(const uint8_t* c, vf (&w)[4]) {
  __m256i hi, lo;
  quad_split(c, hi, lo);
  for (int s = 0; s < 4; ++s) w[s] = quad_slot(hi, lo, s);
}
// w 2^-120 -> w 2^-8 (exact: subnormal inputs, normal results; MXCSR.DAZ is clear in the kernels).
K3_LIN_TARGET inline vf times_2p112(vf a) { return _mm256_mul_ps(a, _mm256_set1_ps(0x1p112f)); }
// 16 BF16 weights (32 bytes) -> FP32: zero-extend to 32 bits and shift into the high half.
K3_LIN_TARGET inline void decode16_bf16(const uint8_t* c, vf (&w)[2]) {
  w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))), 16));
  w[1] = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16))), 16));
}
// 2^(s-127) from E8M0 codes (code 0: 2^-127, the FP32 subnormal 0x00400000).
K3_LIN_TARGET inline vf scale8(const uint8_t* s) {
  const __m256i e = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s))), 23);
  return _mm256_castsi256_ps(_mm256_max_epi32(e, _mm256_set1_epi32(0x00400000)));
}
K3_LIN_TARGET inline void scales16(const uint8_t* s, vf (&sc)[2]) {
  sc[0] = scale8(s);
  sc[1] = scale8(s + 8);
}
}  // namespace
}  // namespace k3::cpu::lin::avx2

#include "cpu/linear/kernels_fp32_impl.hpp"

namespace k3::cpu::lin {

// Tiles in flight: 2 at M = 1 (each tile is a separate memory stream, and fewer streams per
// thread stream faster; 2 tiles x 2 vectors = 4 FMA chains; 4 tiles were slower from memory;
// BF16 weights 1), else 1 (M = 2: 2 rows x 2 vectors, the broadcasts shared by the vectors);
// 5-8 rows in two passes.
template <bool B16, bool X120>
K3_LIN_TARGET void stream_avx2_t(const PackedLinear& w, const Operand& x, int64_t t0, int64_t t1, float* tot) {
  using namespace avx2;
  const int64_t ldt = (t1 - t0) * kLanes;
  switch (x.rows) {
    case 1: return stream_range<1, B16 ? 1 : 2, B16, X120>(w, x, 0, t0, t1, tot, ldt);
    case 2: return stream_range<2, 1, B16, X120>(w, x, 0, t0, t1, tot, ldt);
    case 3: return stream_range<3, 1, B16, X120>(w, x, 0, t0, t1, tot, ldt);
    case 4: return stream_range<4, 1, B16, X120>(w, x, 0, t0, t1, tot, ldt);
    default: break;
  }
  // 5..8 rows: per tile, rows 0-3 then the rest; the tile (16 K weights) is in L2 for the second pass.
  for (int64_t t = t0; t < t1; ++t) {
    float* base = tot + (t - t0) * kLanes;
    stream_rows<4, 1, B16, X120>(w, x, 0, t, t + 1, t, base, ldt);
    switch (x.rows) {
      case 5: stream_rows<1, 1, B16, X120>(w, x, 4, t, t + 1, t, base, ldt); break;
      case 6: stream_rows<2, 1, B16, X120>(w, x, 4, t, t + 1, t, base, ldt); break;
      case 7: stream_rows<3, 1, B16, X120>(w, x, 4, t, t + 1, t, base, ldt); break;
      default: stream_rows<4, 1, B16, X120>(w, x, 4, t, t + 1, t, base, ldt); break;
    }
  }
}

K3_LIN_TARGET void stream_avx2(const PackedLinear& w, const Operand& x, int64_t t0, int64_t t1, float* tot) {
  if (w.bf16_weights()) return stream_avx2_t<true, false>(w, x, t0, t1, tot);
  if (x.x120) return stream_avx2_t<false, true>(w, x, t0, t1, tot);
  stream_avx2_t<false, false>(w, x, t0, t1, tot);
}

K3_LIN_TARGET void panel_avx2(const PackedLinear& w, const Operand& x, int64_t tile, void* panel, float* tot) {
  if (w.bf16_weights()) return avx2::panel<true>(w, x, tile, panel, tot);
  avx2::panel<false>(w, x, tile, panel, tot);
}

}  // namespace k3::cpu::lin
