// k3/portable_math.hpp — elementary functions built only from IEEE-754 operations that every
// backend rounds identically (+, *, / and fused multiply-add, all correctly rounded; scaling by
// powers of two). CPU and CUDA code that must agree bit for bit (the router) call these instead of
// the platform's expf, whose last bit differs between glibc and CUDA's libdevice.
//
// Accuracy: exp_f32 within 2 ulp of exp over its whole range (tested against FP64);
// sigmoid_f32(x) = 1 / (1 + exp_f32(-x)). Every multiply-add is an explicit fmaf, so no compiler
// contraction choice can change a bit.
#pragma once

#include <cmath>

#include "k3/config.hpp"
#include "k3/formats.hpp"

namespace k3 {

K3_HOST_DEVICE inline float portable_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

K3_HOST_DEVICE inline float portable_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);  // never contracted into an FMA
#else
  return a * b;
#endif
}

// e^x. NaN -> NaN, x > 88.72 -> +Inf, x < -103.98 -> +0.
K3_HOST_DEVICE inline float exp_f32(float x) {
  if (x != x) return x;
  if (x > 88.7228394f) return bits_to_f32(0x7F800000u);
  if (x < -103.972084f) return 0.0f;
  // x = n ln2 + r, |r| <= ln2 / 2; ln2 split so that n * ln2_hi is exact for |n| <= 150.
  const float n = static_cast<float>(static_cast<int>(portable_mul(x, 1.44269502f) + (x >= 0 ? 0.5f : -0.5f)));
  float r = portable_fma(n, -0.693145752f, x);  // ln2_hi (13 significant bits)
  r = portable_fma(n, -1.42860677e-6f, r);      // ln2_lo
  // e^r on [-0.35, 0.35]: Taylor to degree 7 (truncation < 2^-29 relative).
  float p = 1.98412698e-4f;                     // 1/5040
  p = portable_fma(p, r, 1.38888889e-3f);       // 1/720
  p = portable_fma(p, r, 8.33333333e-3f);       // 1/120
  p = portable_fma(p, r, 4.16666667e-2f);       // 1/24
  p = portable_fma(p, r, 1.66666667e-1f);       // 1/6
  p = portable_fma(p, r, 0.5f);
  p = portable_fma(p, r, 1.0f);
  p = portable_fma(p, r, 1.0f);
  // p * 2^n in two exact steps (2^n alone may not be a normal float near the range ends).
  const int ni = static_cast<int>(n);
  const int n1 = ni / 2, n2 = ni - n1;
  return portable_mul(portable_mul(p, exp2i(n1)), exp2i(n2));
}

K3_HOST_DEVICE inline float sigmoid_f32(float x) { return 1.0f / (1.0f + exp_f32(-x)); }

}  // namespace k3
