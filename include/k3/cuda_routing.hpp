// k3/cuda_routing.hpp — the Kimi-K3 router on the GPU (top-16 of 896 and any E <= 4096,
// top-k <= 32, grouped top-k), bit-identical to k3::route (k3/routing.hpp): the same portable
// sigmoid (k3/portable_math.hpp), the same total order (larger choice first, NaN never, lower index
// on ties), the same summation order for the renormalization. Ran on an H200 (2026-12-04).
#pragma once

#include <cstdint>
#include <span>

#include "k3/routing.hpp"
#include "k3/status.hpp"

namespace k3::cuda {

// Graph-safe: a fixed grid of max_tokens blocks; the real M is read from m_device (<= max_tokens); writes
// only the caller-owned ids / weights rows < M; allocates nothing; never synchronizes.
//   logits [max_tokens, E] FP32, bias [E] FP32 or nullptr, ids [max_tokens, top_k] int32, weights [max_tokens, top_k] FP32.
Status route_device(const RoutingConfig& cfg, const int32_t* m_device, int64_t max_tokens, const float* logits,
                    const float* bias, int32_t* ids, float* weights, void* stream);

// Convenience for tools and tests: copies in, routes on device 0, copies out (same contract as k3::route).
Status route_host(const RoutingConfig& cfg, int64_t m, std::span<const float> logits, std::span<const float> bias,
                  std::span<int32_t> ids, std::span<float> weights);

}  // namespace k3::cuda
