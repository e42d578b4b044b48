// Device discovery for `k3 info` and for plan-time capability checks.
#include <cstdlib>
#include <sstream>

#include "cuda/common.cuh"
#include "k3/cuda.hpp"

namespace k3::cuda {

bool compiled() { return true; }
std::string compiled_archs() { return K3_CUDA_ARCHS_STR; }

namespace {
// An "a" architecture (sm_90a, sm_120a) runs only on exactly that compute capability.
bool arch_compiled_for(int major, int minor) {
  std::stringstream ss(K3_CUDA_ARCHS_STR);
  std::string arch;
  while (std::getline(ss, arch, ',')) {
    const int num = std::atoi(arch.c_str());
    if (num == major * 10 + minor) return true;
  }
  return false;
}
}  // namespace

Result<std::vector<DeviceInfo>> devices() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    return unavailable(std::string("no usable CUDA device: ") + cudaGetErrorName(err) + " (" +
                       cudaGetErrorString(err) + ")");
  }
  std::vector<DeviceInfo> out;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    K3_CUDA_TRY(cudaGetDeviceProperties(&prop, i), "cudaGetDeviceProperties");
    DeviceInfo d;
    d.index = i;
    d.name = prop.name;
    d.cc_major = prop.major;
    d.cc_minor = prop.minor;
    d.sm_count = prop.multiProcessorCount;
    d.total_memory = static_cast<int64_t>(prop.totalGlobalMem);
    d.runnable = arch_compiled_for(prop.major, prop.minor);
    out.push_back(d);
  }
  if (out.empty()) return unavailable("no CUDA device present (the driver reports 0 devices)");
  return out;
}

}  // namespace k3::cuda
