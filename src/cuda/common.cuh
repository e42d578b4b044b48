// Helpers shared by the CUDA sources: error translation into k3::Status and device buffers.
#pragma once

#include <cuda_runtime.h>

#include <string>

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

}  // namespace k3::cuda::detail
