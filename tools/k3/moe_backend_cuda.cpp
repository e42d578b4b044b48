// The "cuda" fused-MoE backend for the CLI (k3 validate / k3 moe run / k3 bench moe --backend cuda).
// Priority 5, below "cpu" (10): the CUDA kernels have never run on a GPU, so they are used only
// when asked for by name until scripts/device-check.sh has passed on a device.
#include "k3/cuda.hpp"
#include "k3/cuda_moe.hpp"
#include "moe_backends.hpp"

namespace k3::tool {
namespace {

Status cuda_available() {
  auto devs = cuda::devices();
  if (!devs.is_ok()) return devs.status();
  if (!devs.value()[0].runnable) {
    return unavailable("CUDA device 0 (" + devs.value()[0].name + ") is not among the compiled architectures " +
                       cuda::compiled_archs());
  }
  return Status::ok();
}

const MoeBackendRegistration kCuda(MoeBackendAdapter{
    "cuda", 5, cuda_available,
    [](const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in, std::span<uint8_t> out) {
      return cuda::run_host(p, w, in, out);
    }});

}  // namespace
}  // namespace k3::tool
