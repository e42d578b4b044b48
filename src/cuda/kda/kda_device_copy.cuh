// Device copies of host KDA tensors and the plan on device 0, for the host conveniences and the
// benchmarks. Internal.
#pragma once

#include <cuda_runtime.h>

#include <span>

#include "cuda/common.cuh"
#include "k3/cuda_kda.hpp"
#include "k3/kda.hpp"

namespace k3::cuda::kda_detail {

// The plan for device 0 and `seqs` sequences (at least 1), as the host conveniences and the
// benchmarks make it.
inline Result<KdaPlan> device0_plan(const kda::KdaConfig& cfg, int64_t seqs, kda::Algorithm algorithm) {
  K3_RETURN_IF_ERROR(detail::require_device());
  K3_ASSIGN_OR_RETURN(auto caps, device_caps(0));
  KdaOptions o;
  o.device = caps;
  o.max_seqs = seqs < 1 ? 1 : seqs;
  o.algorithm = algorithm;
  return plan(cfg, o);
}

// A device copy of a host span (an empty span stays empty).
template <typename T>
class DeviceCopy {
 public:
  Status upload(std::span<const T> host, const char* what) {
    size_ = host.size();
    if (size_ == 0) return Status::ok();
    K3_RETURN_IF_ERROR(buf_.allocate(size_));
    return detail::from_cuda(cudaMemcpy(buf_.get(), host.data(), size_ * sizeof(T), cudaMemcpyHostToDevice),
                             what);
  }
  Status download(std::span<T> host, const char* what) const {
    if (size_ == 0) return Status::ok();
    return detail::from_cuda(cudaMemcpy(host.data(), buf_.get(), size_ * sizeof(T), cudaMemcpyDeviceToHost), what);
  }
  std::span<T> span() const { return size_ == 0 ? std::span<T>() : std::span<T>(buf_.get(), size_); }
  std::span<const T> cspan() const { return span(); }

 private:
  detail::DeviceBuffer<T> buf_;
  size_t size_ = 0;
};

// The token inputs on the device.
struct DeviceTokens {
  DeviceCopy<uint16_t> q16, k16, v16;
  DeviceCopy<float> q32, k32, v32, g, beta, a_log, dt_bias, initial_state;
  DeviceCopy<int64_t> cu;

  Status upload(const kda::KdaInputs& in) {
    K3_RETURN_IF_ERROR(q16.upload(in.q.bf16, "copy q"));
    K3_RETURN_IF_ERROR(q32.upload(in.q.f32, "copy q"));
    K3_RETURN_IF_ERROR(k16.upload(in.k.bf16, "copy k"));
    K3_RETURN_IF_ERROR(k32.upload(in.k.f32, "copy k"));
    K3_RETURN_IF_ERROR(v16.upload(in.v.bf16, "copy v"));
    K3_RETURN_IF_ERROR(v32.upload(in.v.f32, "copy v"));
    K3_RETURN_IF_ERROR(g.upload(in.g, "copy g"));
    K3_RETURN_IF_ERROR(beta.upload(in.beta, "copy beta"));
    K3_RETURN_IF_ERROR(a_log.upload(in.a_log, "copy a_log"));
    K3_RETURN_IF_ERROR(dt_bias.upload(in.dt_bias, "copy dt_bias"));
    K3_RETURN_IF_ERROR(initial_state.upload(in.initial_state, "copy initial_state"));
    return cu.upload(in.cu_seqlens, "copy cu_seqlens");
  }
  kda::KdaInputs view() const {
    kda::KdaInputs d;
    d.q = {q16.cspan(), q32.cspan()};
    d.k = {k16.cspan(), k32.cspan()};
    d.v = {v16.cspan(), v32.cspan()};
    d.g = g.cspan();
    d.beta = beta.cspan();
    d.a_log = a_log.cspan();
    d.dt_bias = dt_bias.cspan();
    d.cu_seqlens = cu.cspan();
    d.initial_state = initial_state.cspan();
    return d;
  }
};

}  // namespace k3::cuda::kda_detail
