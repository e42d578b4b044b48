// k3/cuda_kda.hpp — the first piece of the CUDA KDA backend: the gate, computed on the device
// from the same host + device definition the CPU backend and the reference use
// (docs/kda.md, "Gate"). NOT YET RUN ON A GPU: compiled and linked here, tested only where a
// device is present (tests/cuda/test_cuda_kda_gate.cpp skips without one).
#pragma once

#include <cstdint>
#include <span>

#include "k3/kda.hpp"
#include "k3/status.hpp"

namespace k3::cuda {

// g[t, h, d] = the log-space decay of cfg.gate from the gate input f[t, h, d] (kda::GateMode),
// clamped below at kMinLogDecay, for `tokens` tokens: f and g are [tokens, H, K] FP32, a_log [H]
// and dt_bias [H, K] (may be empty) as kda::check_gate_inputs checks them. Host buffers in and
// out on device 0 (copies included). Within a few FP32 ulp of the CPU backend (device expf /
// log1pf against the host's); NaN and +-Inf follow the same rules.
Status kda_log_decay(const kda::KdaConfig& cfg, int64_t tokens, std::span<const float> f, std::span<const float> a_log,
                     std::span<const float> dt_bias, std::span<float> g);

}  // namespace k3::cuda
