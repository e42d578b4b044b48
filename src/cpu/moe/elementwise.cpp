// Gated activations and the MXFP8 block quantizer, one portable body per ISA level.
#include "cpu/moe/elementwise.hpp"

#include <cmath>

#include "k3/activation.hpp"
#include "k3/mx.hpp"

#define K3_INLINE inline __attribute__((always_inline))

namespace k3::cpu::detail {
namespace {

K3_INLINE float as_float(uint32_t u) { return __builtin_bit_cast(float, u); }
K3_INLINE uint32_t as_bits(float f) { return __builtin_bit_cast(uint32_t, f); }

// exp(x) = 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 (two-part ln 2), |r| <= 0.347;
// p = degree-7 Taylor polynomial (truncation < 6e-9 relative). 2^n is applied as two factors
// so that n in [-150, 128] never leaves the normal range of the factors: overflow gives +Inf,
// underflow a subnormal or 0, NaN stays NaN (all without branches or UB on NaN).
K3_INLINE float exp_body(float x) {
  float xc = x > 89.0f ? 89.0f : x;
  xc = xc < -104.0f ? -104.0f : xc;
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer (RNE)
  const float t = std::fma(xc, 1.44269504088896341f, kMagic);
  const float n = t - kMagic;
  const uint32_t ni = as_bits(t) - as_bits(kMagic);
  float r = std::fma(n, -0.693145751953125f, xc);
  r = std::fma(n, -1.42860682030941723e-6f, r);
  float p = 1.0f / 5040.0f;
  p = std::fma(p, r, 1.0f / 720.0f);
  p = std::fma(p, r, 1.0f / 120.0f);
  p = std::fma(p, r, 1.0f / 24.0f);
  p = std::fma(p, r, 1.0f / 6.0f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const uint32_t h = static_cast<uint32_t>(static_cast<int32_t>(ni) >> 1);
  const float s1 = as_float((h + 127u) << 23), s2 = as_float((ni - h + 127u) << 23);
  return p * s1 * s2;
}

// tanh: odd Taylor series to x^13 below |x| = 0.3 (truncation < 1e-10 relative), else
// 1 - 2 / (exp(2|x|) + 1) with the sign restored (exp = Inf gives exactly 1). Both are computed
// and one is kept by a bitwise select: with `ax < 0.3f ? small : big` GCC 12 left the AVX2 SiTU
// loop scalar ("control flow in loop"; AVX-512 has masks and was vectorized): 35-48 against
// 8.5-11 us per 3072 elements (BM_Activation/situ_swiglu_silu:0, AMD EPYC Zen 4 guest, K3_ISA=avx2).
K3_INLINE float tanh_body(float x) {
  const uint32_t sign = as_bits(x) & 0x80000000u;
  const float ax = as_float(as_bits(x) & 0x7FFFFFFFu);
  const float x2 = x * x;
  float ps = 21844.0f / 6081075.0f;
  ps = std::fma(ps, x2, -1382.0f / 155925.0f);
  ps = std::fma(ps, x2, 62.0f / 2835.0f);
  ps = std::fma(ps, x2, -17.0f / 315.0f);
  ps = std::fma(ps, x2, 2.0f / 15.0f);
  ps = std::fma(ps, x2, -1.0f / 3.0f);
  const float small = std::fma(x * x2, ps, x);
  const float e = exp_body(2.0f * ax);
  const float big = as_float(as_bits(1.0f - 2.0f / (e + 1.0f)) | sign);
  const uint32_t keep_small = 0u - static_cast<uint32_t>(ax < 0.3f);  // all ones or zero
  return as_float((as_bits(small) & keep_small) | (as_bits(big) & ~keep_small));
}

// The CPU backend's math for the shared activation formulas (k3/activation.hpp).
struct CpuMath {
  static K3_INLINE float exp(float x) { return exp_body(x); }
  static K3_INLINE float tanh(float x) { return tanh_body(x); }
};

K3_INLINE void activate_body(const ActParams& p, const float* gate, const float* up, float* out, int64_t n) {
  switch (p.kind) {
    case ActivationKind::kSiTU: {
      const float b = p.beta, lb = p.linear_beta;
      for (int64_t i = 0; i < n; ++i) out[i] = act::situ<CpuMath>(gate[i], up[i], b, lb);
      break;
    }
    case ActivationKind::kSwiGLU: {
      const float lim = p.limit, alpha = p.alpha, beta = p.swiglu_beta;
      for (int64_t i = 0; i < n; ++i) out[i] = act::swiglu<CpuMath>(gate[i], up[i], alpha, beta, lim);
      break;
    }
    case ActivationKind::kSiLU:
      for (int64_t i = 0; i < n; ++i) out[i] = act::silu_mul<CpuMath>(gate[i], up[i]);
      break;
  }
}

// The block scale is MxBlockAmax's decision (k3/mx.hpp) on the FP32 bits, so that the loop vectorizes:
// an unsigned max of |bits| is the float max, and a value above 0x7F800000 is a NaN (tested bitwise
// against mx_quantize_block by the W4A8 tests).
// E4M3 RNE of |q| <= 448 (or Inf, which saturates): normal range by mantissa rounding on the
// FP32 bits, subnormal range (|q| < 2^-6) by adding 2^14, whose ulp is the E4M3 quantum 2^-9.
K3_INLINE uint8_t quantize_e4m3_body(const float* v, uint8_t* codes) {
  uint32_t amax = 0;
  for (int i = 0; i < kMxBlock; ++i) {
    const uint32_t a = as_bits(v[i]) & 0x7FFFFFFFu;
    amax = a > amax ? a : amax;
  }
  if (amax > 0x7F800000u) {  // NaN in the block
    for (int i = 0; i < kMxBlock; ++i) codes[i] = 0;
    return kE8M0Nan;
  }
  const uint8_t scale = mx_scale_code(as_float(amax), MxElement::kE4M3, ScaleRule::kRceil);
  const float inv = exp2i(127 - static_cast<int>(scale));  // exact power of two
  constexpr float kSubMagic = 16384.0f;
  for (int i = 0; i < kMxBlock; ++i) {
    const float q = v[i] * inv;
    const uint32_t bits = as_bits(q);
    const uint32_t a = bits & 0x7FFFFFFFu;
    const uint32_t normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    const uint32_t sub = as_bits(as_float(a) + kSubMagic) - as_bits(kSubMagic);
    uint32_t code = a < 0x3C800000u ? sub : normal;
    code = code > 0x7Eu ? 0x7Eu : code;
    codes[i] = static_cast<uint8_t>(code | ((bits >> 24) & 0x80u));
  }
  return scale;
}

K3_INLINE void weighted_sum_body(const float* const* rows, const float* weights, int count, int64_t len, float* acc) {
  for (int64_t c = 0; c < len; ++c) acc[c] = 0.0f;
  for (int i = 0; i < count; ++i) {
    const float w = weights[i];
    const float* r = rows[i];
    for (int64_t c = 0; c < len; ++c) acc[c] = std::fma(w, r[c], acc[c]);
  }
}

void activate_scalar(const ActParams& p, const float* g, const float* u, float* o, int64_t n) {
  activate_body(p, g, u, o, n);
}
uint8_t quantize_scalar(const float* v, uint8_t* c) { return quantize_e4m3_body(v, c); }

__attribute__((target("avx2,fma"))) void activate_avx2(const ActParams& p, const float* g, const float* u, float* o,
                                                       int64_t n) {
  activate_body(p, g, u, o, n);
}
__attribute__((target("avx2,fma"))) uint8_t quantize_avx2(const float* v, uint8_t* c) {
  return quantize_e4m3_body(v, c);
}

__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void activate_avx512(const ActParams& p, const float* g,
                                                                              const float* u, float* o, int64_t n) {
  activate_body(p, g, u, o, n);
}
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) uint8_t quantize_avx512(const float* v, uint8_t* c) {
  return quantize_e4m3_body(v, c);
}

void weighted_sum_scalar(const float* const* r, const float* w, int n, int64_t len, float* acc) {
  weighted_sum_body(r, w, n, len, acc);
}
__attribute__((target("avx2,fma"))) void weighted_sum_avx2(const float* const* r, const float* w, int n, int64_t len, float* acc) {
  weighted_sum_body(r, w, n, len, acc);
}
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void weighted_sum_avx512(const float* const* r, const float* w, int n, int64_t len, float* acc) {
  weighted_sum_body(r, w, n, len, acc);
}
constexpr Elementwise kScalar{activate_scalar, quantize_scalar, weighted_sum_scalar};
constexpr Elementwise kAvx2{activate_avx2, quantize_avx2, weighted_sum_avx2};
constexpr Elementwise kAvx512{activate_avx512, quantize_avx512, weighted_sum_avx512};

}  // namespace

const Elementwise& elementwise(IsaLevel level) {
  switch (level) {
    case IsaLevel::kAvx2: return kAvx2;
    case IsaLevel::kAvx512:
    case IsaLevel::kAvx512Bf16: return kAvx512;
    case IsaLevel::kScalar: break;
  }
  return kScalar;
}

float exp_f32(float x) { return exp_body(x); }
float tanh_f32(float x) { return tanh_body(x); }

}  // namespace k3::cpu::detail
