// The CUDA entry points of a build without nvcc: each reports that CUDA is not compiled in.
#include "k3/cuda.hpp"
#include "k3/harness/cuda_bench.hpp"
#include "k3/cuda_kda.hpp"
#include "k3/cuda_kda_ops.hpp"
#include "k3/cuda_moe.hpp"
#include "k3/cuda_routing.hpp"
#include "k3/cuda_sm120.hpp"

namespace k3::cuda {
namespace {
Status not_built() {
  return unavailable("k3 was built without CUDA (K3_CUDA=OFF, or nvcc not found at configure time); rebuild with -DK3_CUDA=ON");
}
}  // namespace

bool compiled() { return false; }
std::string compiled_archs() { return ""; }
bool has_sm120_blockscaled_gemm() { return false; }
Result<std::vector<DeviceInfo>> devices() { return not_built(); }
Status kda_log_decay(const kda::KdaConfig&, int64_t, std::span<const float>, std::span<const float>,
                     std::span<const float>, std::span<float>) {
  return not_built();
}
Status prefill(const KdaPlan&, const kda::KdaInputs&, const kda::KdaOutputs&, void*, void*) { return not_built(); }
Status decode(const KdaPlan&, const kda::DecodeArgs&, void*, void*) { return not_built(); }
Status verify(const KdaPlan&, const kda::VerifyArgs&, void*, void*) { return not_built(); }
Status kda_status(const KdaPlan&, const void*, void*) { return not_built(); }
Status prefill_host(const kda::KdaConfig&, const kda::KdaInputs&, const kda::KdaOutputs&, kda::Algorithm) {
  return not_built();
}
Status decode_host(const kda::KdaConfig&, const kda::DecodeArgs&) { return not_built(); }
Status verify_host(const kda::KdaConfig&, const kda::VerifyArgs&) { return not_built(); }
Status causal_conv1d(const kda::ConvArgs&, void*) { return not_built(); }
Status gated_rmsnorm(const kda::GatedRmsNormArgs&, void*) { return not_built(); }
Status causal_conv1d_host(const kda::ConvArgs&) { return not_built(); }
Status gated_rmsnorm_host(const kda::GatedRmsNormArgs&) { return not_built(); }
Status mx_quantize(std::span<const float>, int64_t, int64_t, MxElement, ScaleRule, std::span<uint8_t>,
                   std::span<uint8_t>) {
  return not_built();
}
Status mx_dequantize(std::span<const uint8_t>, std::span<const uint8_t>, int64_t, int64_t, MxElement,
                     std::span<float>) {
  return not_built();
}

struct DeviceWeights::Impl {};
DeviceWeights::DeviceWeights() = default;
DeviceWeights::DeviceWeights(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DeviceWeights::~DeviceWeights() = default;
DeviceWeights::DeviceWeights(DeviceWeights&&) noexcept = default;
DeviceWeights& DeviceWeights::operator=(DeviceWeights&&) noexcept = default;

Result<DeviceCaps> device_caps(int) { return not_built(); }
Result<DeviceTiming> time_kda_prefill(const kda::KdaConfig&, const kda::KdaInputs&, kda::Algorithm, int, int) {
  return not_built();
}
Result<DeviceTiming> time_kda_decode(const kda::KdaConfig&, const kda::KdaInputs&, int64_t, int, int, bool) {
  return not_built();
}
Result<DeviceWeights> prepack(const MoePlan&, const MoeWeightsView&) { return not_built(); }
MoePath effective_path(const MoePlan& plan, const DeviceWeights&) { return plan.path; }
bool has_sm90_grouped_gemm() { return false; }
Status run(const MoePlan&, const DeviceWeights&, const DeviceInputs&, void*, void*) { return not_built(); }
ExpertRows expert_rows(const MoePlan& plan, void* workspace) {
  if (workspace == nullptr) return {};
  auto* base = static_cast<char*>(workspace);
  return {reinterpret_cast<const float*>(base + plan.ws_y), reinterpret_cast<const int32_t*>(base + plan.ws_slot_row)};
}
Result<ExpertRows> run_experts(const MoePlan&, const DeviceWeights&, const DeviceInputs&, void*, void*) {
  return not_built();
}
Status finalize(const MoePlan&, const int32_t*, const ExpertRows&, const float*, void*, void*) { return not_built(); }
Status run_host(const MoeProblem&, const MoeWeightsView&, const MoeInputsView&, std::span<uint8_t>, const std::string&,
                int) {
  return not_built();
}
struct HostMoe::Impl {};
HostMoe::HostMoe(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HostMoe::~HostMoe() = default;
Result<std::unique_ptr<HostMoe>> HostMoe::create(const MoeProblem&, const MoeWeightsView&, int64_t, const std::string&,
                                                 int) {
  return not_built();
}
const MoePlan& HostMoe::plan() const {
  static const MoePlan none;
  return none;
}
MoePath HostMoe::path() const { return MoePath::kDecodeSplitK; }
Status HostMoe::run(const MoeInputsView&, std::span<uint8_t>) const { return not_built(); }

Result<DeviceTiming> time_device_copy(int64_t, int, int) { return not_built(); }
Result<DeviceTiming> time_moe(const MoeProblem&, const MoeWeightsView&, const MoeInputsView&, int, int, int,
                              const std::string&, int) {
  return not_built();
}
Result<DeviceTiming> time_cublas_baseline(const MoeProblem&, std::span<const int64_t>, int, int) { return not_built(); }

Status route_device(const RoutingConfig&, const int32_t*, int64_t, const float*, const float*, int32_t*, float*, void*) {
  return not_built();
}
Status route_host(const RoutingConfig&, int64_t, std::span<const float>, std::span<const float>, std::span<int32_t>,
                  std::span<float>) {
  return not_built();
}

}  // namespace k3::cuda
