// Scalar pieces of the KDA math shared by the references, the CPU backend and device code
// (internal; the gate functions are host + device).
#pragma once

#include <cmath>
#include <cstdint>

#include "k3/config.hpp"
#include "k3/formats.hpp"
#include "k3/kda.hpp"

namespace k3::kda::detail {

// validate_prefill on output sizes instead of spans (o and final_state element counts; a
// final_state size of 0 means "not returned"). host_values = false: the spans are device memory,
// so only sizes are checked (no cu_seqlens or a_log value is read; the device checks those).
Result<PrefillShape> validate_prefill_sizes(const KdaConfig& c, const KdaInputs& in, int64_t o_size,
                                            int64_t final_state_size, bool host_values = true);

// Element i of an activation tensor, widened exactly to FP32.
inline float act_at(const ActSpan& a, int64_t i) {
  return a.is_bf16() ? bf16_to_f32(a.bf16[static_cast<size_t>(i)]) : a.f32[static_cast<size_t>(i)];
}

// exp / log1p for the gate: the C++ library on the host, CUDA's math library on a device (both
// within a few ulp; KDA backends agree within the tolerances of docs/kda.md, not bit for bit).
K3_HOST_DEVICE inline float gate_exp(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}
K3_HOST_DEVICE inline double gate_exp(double x) {
#if defined(__CUDA_ARCH__)
  return ::exp(x);
#else
  return std::exp(x);
#endif
}
K3_HOST_DEVICE inline float gate_log1p(float x) {
#if defined(__CUDA_ARCH__)
  return log1pf(x);
#else
  return std::log1p(x);
#endif
}
K3_HOST_DEVICE inline double gate_log1p(double x) {
#if defined(__CUDA_ARCH__)
  return ::log1p(x);
#else
  return std::log1p(x);
#endif
}

// The gate, one definition for the FP64 reference, the CPU backend and device code.
template <typename T>
K3_HOST_DEVICE T sigmoid(T x) {
  return T(1) / (T(1) + gate_exp(-x));
}

// softplus(x) = log(1 + exp(x)), with the x > 20 shortcut of the Kimi-Linear / fla code.
template <typename T>
K3_HOST_DEVICE T softplus(T x) {
  return x > T(20) ? x : gate_log1p(gate_exp(x));
}

// Log-space decay of one channel from the gate input f (see GateMode), clamped below at
// kMinLogDecay. `a` is exp(A_log[h]) and `bias` dt_bias[h, d] (0 when absent). NaN passes the
// clamp (the comparison is false) and is caught by decay_poisons.
template <typename T>
K3_HOST_DEVICE T log_decay(GateMode mode, T f, T a, T bias, T lower_bound) {
  T g;
  switch (mode) {
    case GateMode::kSafe: g = lower_bound * sigmoid(a * (f + bias)); break;
    case GateMode::kSoftplus: g = -a * softplus(f + bias); break;
    default: g = f; break;
  }
  return g < T(kMinLogDecay) ? T(kMinLogDecay) : g;
}

// The non-finite policy (docs/kda.md, "Non-finite values"): a log decay g (after the gate and
// the clamp) poisons the token's write when it is NaN or above kMaxLogDecay (+inf included).
template <typename T>
K3_HOST_DEVICE bool decay_poisons(T g) {
  return !(g <= T(kMaxLogDecay));
}

}  // namespace k3::kda::detail
