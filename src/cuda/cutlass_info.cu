// Which CUTLASS-based kernels this build contains (k3 info, planning). No CUTLASS header needed.
#include <string>

#include "k3/cuda_sm120.hpp"

namespace k3::cuda {

bool has_sm120_blockscaled_gemm() {
#if defined(K3_HAVE_CUTLASS)
  return std::string(K3_CUDA_ARCHS_STR).find("120a") != std::string::npos;
#else
  return false;
#endif
}

}  // namespace k3::cuda
