// KDA kernels for AVX2 + FMA (8 FP32 lanes), selected at run time (K3_ISA=avx2).
// Standard and k3 headers come first so that only this file's own functions get the target.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "core/kda/kda_math.hpp"
#include "cpu/kda/kernels.hpp"
#include "cpu/prefetch.hpp"

// GCC: a target pragma; clang (TSan and fuzz builds) has no GCC target pragma, it attaches the
// same attribute to every function of the region.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

namespace k3::cpu::kda_detail {
namespace avx2_impl {

struct VF {
  using V = __m256;
  static constexpr int W = 8;
  static constexpr int MR = 4, NR = 2;  // 8 accumulators + 2 B vectors of the 16 ymm registers
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load_bf16(const uint16_t* p) {  // 8 BF16 -> FP32 (exact: the bits shifted up)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V max(V a, V b) { return _mm256_max_ps(b, a); }  // NaN in a propagates
  static float reduce_add(V a) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
  // e^x: x = n ln2 + r, |r| <= ln2 / 2, degree-7 Taylor polynomial (truncation < 6e-9
  // relative), times 2^n. Below -87 the result is 0 (true value < 1.7e-38); NaN propagates.
  static V exp(V x) {
    const V lo = set1(-87.0f), hi = set1(88.0f);
    const V under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(hi, _mm256_max_ps(lo, x));
    const V n = _mm256_round_ps(_mm256_mul_ps(x, set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm256_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    V p = set1(1.98412698e-4f);
    p = fmadd(p, r, set1(1.38888889e-3f));
    p = fmadd(p, r, set1(8.33333333e-3f));
    p = fmadd(p, r, set1(4.16666667e-2f));
    p = fmadd(p, r, set1(1.66666667e-1f));
    p = fmadd(p, r, set1(0.5f));
    p = fmadd(p, r, set1(1.0f));
    p = fmadd(p, r, set1(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  }
};

#include "cpu/kda/kernels_impl.hpp"

}  // namespace avx2_impl
}  // namespace k3::cpu::kda_detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace k3::cpu::kda_detail {
const KernelTable& kernels_avx2() { return avx2_impl::table(); }
}  // namespace k3::cpu::kda_detail
