// Device timing of the CUDA KDA backend (k3/harness/cuda_bench.hpp). Ran on an H200 (2026-12-04).
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/kda/kda_device_copy.cuh"
#include "cuda/timing.cuh"
#include "k3/harness/cuda_bench.hpp"
#include "k3/cuda_kda.hpp"

namespace k3::cuda {

Result<DeviceTiming> time_kda_prefill(const kda::KdaConfig& cfg, const kda::KdaInputs& in, kda::Algorithm algorithm,
                                      int warmup, int iters) {
  const int64_t state = cfg.num_heads * cfg.head_k * cfg.head_v;
  const int64_t tokens = in.q.size() / (cfg.num_heads * cfg.head_k);
  const int64_t seqs = in.cu_seqlens.empty() ? 1 : static_cast<int64_t>(in.cu_seqlens.size()) - 1;
  std::vector<float> o_host(static_cast<size_t>(tokens * cfg.num_heads * cfg.head_v));
  std::vector<float> f_host(static_cast<size_t>(seqs * state));
  K3_RETURN_IF_ERROR(kda::validate_prefill(cfg, in, {o_host, f_host}).status());
  K3_ASSIGN_OR_RETURN(const KdaPlan p, kda_detail::device0_plan(cfg, seqs, algorithm));
  kda_detail::DeviceTokens tok;
  K3_RETURN_IF_ERROR(tok.upload(in));
  detail::DeviceBuffer<float> o, f;
  detail::DeviceBuffer<uint8_t> ws;
  K3_RETURN_IF_ERROR(o.allocate(o_host.size()));
  K3_RETURN_IF_ERROR(f.allocate(f_host.size()));
  K3_RETURN_IF_ERROR(ws.allocate(static_cast<size_t>(p.workspace_bytes)));
  const kda::KdaInputs d = tok.view();
  const kda::KdaOutputs out{{o.get(), o_host.size()}, {f.get(), f_host.size()}};
  auto r = detail::time_events([&](int) { return prefill(p, d, out, ws.get(), nullptr); }, warmup, iters);
  K3_RETURN_IF_ERROR(kda_status(p, ws.get(), nullptr));
  return r;
}

Result<DeviceTiming> time_kda_decode(const kda::KdaConfig& cfg, const kda::KdaInputs& in, int64_t pool_slots,
                                     int warmup, int iters, bool bf16_state) {
  const int64_t n = in.q.size() / (cfg.num_heads * cfg.head_k);
  const int64_t state = cfg.num_heads * cfg.head_k * cfg.head_v;
  if (n < 1 || pool_slots < n) {
    return invalid_argument("time_kda_decode: pool_slots = " + std::to_string(pool_slots) +
                            " must be >= the batch N = " + std::to_string(n) + " >= 1");
  }
  K3_ASSIGN_OR_RETURN(const KdaPlan p, kda_detail::device0_plan(cfg, n, kda::Algorithm::kAuto));
  const int64_t groups = pool_slots / n;
  std::vector<int32_t> idx(static_cast<size_t>(groups * n));
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>(i);
  kda_detail::DeviceTokens tok;
  K3_RETURN_IF_ERROR(tok.upload(in));
  kda_detail::DeviceCopy<int32_t> didx;
  K3_RETURN_IF_ERROR(didx.upload(idx, "copy state_indices"));
  detail::DeviceBuffer<float> o;
  detail::DeviceBuffer<uint8_t> ws, pool;
  const size_t pool_elems = static_cast<size_t>(groups * n * state), elem = bf16_state ? 2 : 4;
  K3_RETURN_IF_ERROR(pool.allocate(pool_elems * elem));
  K3_RETURN_IF_ERROR(o.allocate(static_cast<size_t>(n * cfg.num_heads * cfg.head_v)));
  K3_RETURN_IF_ERROR(ws.allocate(static_cast<size_t>(p.workspace_bytes)));
  K3_CUDA_TRY(cudaMemset(pool.get(), 0, pool_elems * elem), "clear the pool");
  kda::DecodeArgs a;
  a.in = tok.view();
  if (bf16_state) {
    a.state_pool_bf16 = {reinterpret_cast<uint16_t*>(pool.get()), pool_elems};
  } else {
    a.state_pool = {reinterpret_cast<float*>(pool.get()), pool_elems};
  }
  a.o = {o.get(), static_cast<size_t>(n * cfg.num_heads * cfg.head_v)};
  auto r = detail::time_events(
      [&](int i) {
        kda::DecodeArgs step = a;
        step.state_indices = didx.cspan().subspan(static_cast<size_t>((i % groups) * n), static_cast<size_t>(n));
        return decode(p, step, ws.get(), nullptr);
      },
      warmup, iters);
  K3_RETURN_IF_ERROR(kda_status(p, ws.get(), nullptr));
  return r;
}

}  // namespace k3::cuda
