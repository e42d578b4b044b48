// The KDA gate on the device (k3/cuda_kda.hpp). Ran on an H200 (2026-12-04). One thread per element;
// the math is kda::detail::log_decay, the definition the reference and the CPU backend use.
#include "core/kda/kda_math.hpp"
#include "cuda/common.cuh"
#include "k3/cuda_kda.hpp"

namespace k3::cuda {
namespace {

__global__ void kda_log_decay_kernel(const float* __restrict__ f,        // [T, H, K]
                                     const float* __restrict__ a_log,    // [H] or null
                                     const float* __restrict__ dt_bias,  // [H, K] or null
                                     int64_t n, int64_t heads, int64_t dk, kda::GateMode mode, float lb,
                                     float* __restrict__ g) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t d = i % dk, h = (i / dk) % heads;
  const float a = a_log != nullptr ? kda::detail::gate_exp(a_log[h]) : 0.0f;
  const float bias = dt_bias != nullptr ? dt_bias[h * dk + d] : 0.0f;
  g[i] = kda::detail::log_decay<float>(mode, f[i], a, bias, lb);
}

}  // namespace

Status kda_log_decay(const kda::KdaConfig& cfg, int64_t tokens, std::span<const float> f, std::span<const float> a_log,
                     std::span<const float> dt_bias, std::span<float> g) {
  K3_RETURN_IF_ERROR(kda::validate_config(cfg));
  K3_RETURN_IF_ERROR(kda::check_gate_inputs(cfg, a_log, dt_bias));
  if (tokens < 0) return invalid_argument("cuda::kda_log_decay: tokens = " + std::to_string(tokens) + " must be >= 0");
  K3_ASSIGN_OR_RETURN(const int64_t n, kda::checked_product("cuda::kda_log_decay: f [T, H, K]",
                                                            {tokens, cfg.num_heads, cfg.head_k}));
  if (static_cast<int64_t>(f.size()) != n || static_cast<int64_t>(g.size()) != n) {
    return invalid_argument("cuda::kda_log_decay: f has " + std::to_string(f.size()) + " and g " +
                            std::to_string(g.size()) + " elements, [T, H, K] = " + std::to_string(n));
  }
  K3_RETURN_IF_ERROR(detail::require_device());
  if (n == 0) return Status::ok();
  const bool gated = cfg.gate != kda::GateMode::kLogDecay;
  detail::DeviceBuffer<float> df, dg, da, db;
  K3_RETURN_IF_ERROR(df.allocate(static_cast<size_t>(n)));
  K3_RETURN_IF_ERROR(dg.allocate(static_cast<size_t>(n)));
  K3_CUDA_TRY(cudaMemcpy(df.get(), f.data(), static_cast<size_t>(n) * sizeof(float), cudaMemcpyHostToDevice), "copy f");
  if (gated) {
    K3_RETURN_IF_ERROR(da.allocate(static_cast<size_t>(cfg.num_heads)));
    K3_CUDA_TRY(cudaMemcpy(da.get(), a_log.data(), static_cast<size_t>(cfg.num_heads) * sizeof(float),
                           cudaMemcpyHostToDevice), "copy a_log");
    if (!dt_bias.empty()) {
      K3_RETURN_IF_ERROR(db.allocate(dt_bias.size()));
      K3_CUDA_TRY(cudaMemcpy(db.get(), dt_bias.data(), dt_bias.size() * sizeof(float), cudaMemcpyHostToDevice),
                  "copy dt_bias");
    }
  }
  const unsigned block = 256;
  kda_log_decay_kernel<<<detail::grid_for(n, block), block>>>(df.get(), gated ? da.get() : nullptr, db.get(), n,
                                                              cfg.num_heads, cfg.head_k, cfg.gate,
                                                              cfg.gate_lower_bound, dg.get());
  K3_CUDA_TRY(cudaGetLastError(), "kda_log_decay_kernel launch");
  K3_CUDA_TRY(cudaMemcpy(g.data(), dg.get(), static_cast<size_t>(n) * sizeof(float), cudaMemcpyDeviceToHost), "copy g");
  return Status::ok();
}

}  // namespace k3::cuda
