// KDA kernels for AVX-512 (16 FP32 lanes), selected at run time (K3_ISA=avx512 or avx512bf16).
// The KDA math is FP32 throughout (BF16 inputs are widened exactly), so the BF16 level uses
// these kernels too: VDPBF16PS would round Gamma-scaled operands to BF16.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "core/kda/kda_math.hpp"
#include "cpu/kda/kernels.hpp"
#include "cpu/prefetch.hpp"

// GCC 12 reports its own _mm512_undefined_* helpers (inside _mm512_reduce_add_ps) as
// "used uninitialized": a false positive inside avx512fintrin.h.
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// GCC: a target pragma; clang (TSan and fuzz builds) has no GCC target pragma, it attaches the
// same attribute to every function of the region.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#endif

namespace k3::cpu::kda_detail {
namespace avx512_impl {

struct VF {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr int MR = 4, NR = 4;  // 16 accumulators + 4 B vectors of the 32 zmm registers
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load_bf16(const uint16_t* p) {  // 16 BF16 -> FP32 (exact: the bits shifted up)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V max(V a, V b) { return _mm512_max_ps(b, a); }  // NaN in a propagates
  static float reduce_add(V a) { return _mm512_reduce_add_ps(a); }
  // e^x as in kernels_avx2.cpp: degree-7 polynomial on |r| <= ln2 / 2, 0 below -87, NaN kept.
  static V exp(V x) {
    const V lo = set1(-87.0f), hi = set1(88.0f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(hi, _mm512_max_ps(lo, x));
    const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, set1(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm512_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    V p = set1(1.98412698e-4f);
    p = fmadd(p, r, set1(1.38888889e-3f));
    p = fmadd(p, r, set1(8.33333333e-3f));
    p = fmadd(p, r, set1(4.16666667e-2f));
    p = fmadd(p, r, set1(1.66666667e-1f));
    p = fmadd(p, r, set1(0.5f));
    p = fmadd(p, r, set1(1.0f));
    p = fmadd(p, r, set1(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
  }
};

#include "cpu/kda/kernels_impl.hpp"

}  // namespace avx512_impl
}  // namespace k3::cpu::kda_detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace k3::cpu::kda_detail {
const KernelTable& kernels_avx512() { return avx512_impl::table(); }
}  // namespace k3::cpu::kda_detail
