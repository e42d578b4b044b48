// k3/activation.hpp — the gated activations of the fused MoE (k3/moe.hpp, ActivationKind), one
// definition for the FP64 oracle (k3/moe_ref.hpp), the CPU backend and the CUDA kernels.
//
// Each function is a template on the value type T and on a math policy M that supplies
// M::exp(T) and M::tanh(T): the oracle instantiates it with the C++ library in FP64, the CPU
// backend with its branch-free FP32 bodies (vectorized per ISA level), the CUDA kernels with the
// device math library. The formulas and their operation order live only here:
//   SiTU:   (b tanh(g / b) sigmoid(g)) (lb tanh(u / lb))
//   SwiGLU: g' = min(g, L), u' = clamp(u, -L, L), g' sigmoid(alpha g') (u' + beta)
//   SiLU:   g sigmoid(g) u
// NaN in g or u propagates in every activation (the clamps are written so that a NaN falls
// through; fmin / fmax would return the limit). Everything is force-inlined (K3_FORCE_INLINE), so
// that a CPU kernel compiled for an ISA level keeps the whole activation in its vectorized loop.
#pragma once

#include "k3/config.hpp"
#include "k3/moe.hpp"

namespace k3::act {

template <typename T>
K3_HOST_DEVICE K3_FORCE_INLINE constexpr T min_keep_nan(T v, T hi) {
  return v > hi ? hi : v;
}
template <typename T>
K3_HOST_DEVICE K3_FORCE_INLINE constexpr T clamp_keep_nan(T v, T lo, T hi) {
  return v > hi ? hi : (v < lo ? lo : v);
}

template <class M, typename T>
K3_HOST_DEVICE K3_FORCE_INLINE T sigmoid(T x) {
  return T(1) / (T(1) + M::exp(-x));
}

template <class M, typename T>
K3_HOST_DEVICE K3_FORCE_INLINE T situ(T g, T u, T b, T lb) {
  return (b * M::tanh(g / b) * sigmoid<M>(g)) * (lb * M::tanh(u / lb));
}

template <class M, typename T>
K3_HOST_DEVICE K3_FORCE_INLINE T swiglu(T g, T u, T alpha, T beta, T limit) {
  const T gc = min_keep_nan(g, limit);
  const T uc = clamp_keep_nan(u, -limit, limit);
  return gc * sigmoid<M>(alpha * gc) * (uc + beta);
}

template <class M, typename T>
K3_HOST_DEVICE K3_FORCE_INLINE T silu_mul(T g, T u) {
  return g * sigmoid<M>(g) * u;
}

// The activation of `kind`; b, lb: the SiTU betas; alpha, beta, limit: SwiGLU's.
template <class M, typename T>
K3_HOST_DEVICE K3_FORCE_INLINE T gated(ActivationKind kind, T g, T u, T b, T lb, T alpha, T beta, T limit) {
  switch (kind) {
    case ActivationKind::kSiTU: return situ<M>(g, u, b, lb);
    case ActivationKind::kSwiGLU: return swiglu<M>(g, u, alpha, beta, limit);
    case ActivationKind::kSiLU:
    default: return silu_mul<M>(g, u);
  }
}

}  // namespace k3::act
