// Helpers shared by the CUDA sources: error translation into k3::Status, device buffers, the
// device check and launch sizes.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "k3/cuda.hpp"
#include "k3/status.hpp"

namespace k3::cuda::detail {

inline Status from_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::ok();
  return unavailable(std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

#define K3_CUDA_TRY(expr, what) K3_RETURN_IF_ERROR(::k3::cuda::detail::from_cuda((expr), (what)))

// Owning device allocation; freed on scope exit.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  Status allocate(size_t count) {
    return from_cuda(cudaMalloc(reinterpret_cast<void**>(&ptr_), count * sizeof(T) + 1), "cudaMalloc");
  }
  T* get() const { return ptr_; }

 private:
  T* ptr_ = nullptr;
};

// Device 0 exists and one of the compiled architectures runs on it; else UNAVAILABLE naming both.
inline Status require_device() {
  auto devs = devices();
  if (!devs.is_ok()) return devs.status();
  if (!devs.value()[0].runnable) {
    return unavailable("device 0 (" + devs.value()[0].name + ", sm_" + std::to_string(devs.value()[0].cc_major) +
                       std::to_string(devs.value()[0].cc_minor) + ") is not among the compiled architectures " +
                       compiled_archs() + "; use the CPU backend");
  }
  return Status::ok();
}

// Blocks of `block` threads covering n elements.
inline unsigned grid_for(int64_t n, unsigned block) { return static_cast<unsigned>((n + block - 1) / block); }

}  // namespace k3::cuda::detail
