// Builds without the CUDA backend: the NCCL transport reports why it is missing.
#include "k3/comm_nccl.hpp"
#include "k3/cuda_ep.hpp"

namespace k3::comm {

Status nccl_available() {
  return unsupported("k3 was built without the CUDA backend (K3_CUDA=OFF or no nvcc), so without its NCCL transport");
}
Result<std::unique_ptr<DeviceCommunicator>> make_nccl_communicator(Communicator& host, const NcclOptions&) {
  K3_RETURN_IF_ERROR(agree_on_status(host, nccl_available()));  // the same "rank q of W: ..." as the CUDA build
  return nccl_available();
}
Status allreduce_bf16_device(DeviceCommunicator&, const uint16_t*, int64_t, int64_t, uint16_t*, void*) {
  return nccl_available();
}
Status allreduce_add_rmsnorm_bf16_device(DeviceCommunicator&, const uint16_t*, const uint16_t*, const uint16_t*, int64_t,
                                         int64_t, float, uint16_t*, uint16_t*, void*) {
  return nccl_available();
}


// The GPU expert-parallel path (k3/cuda_ep.hpp).
struct DeviceEpBuffers::Impl {};
DeviceEpBuffers::DeviceEpBuffers() : impl_(std::make_unique<Impl>()) {}
DeviceEpBuffers::~DeviceEpBuffers() = default;
DeviceEpBuffers::DeviceEpBuffers(DeviceEpBuffers&&) noexcept = default;
DeviceEpBuffers& DeviceEpBuffers::operator=(DeviceEpBuffers&&) noexcept = default;
Result<DeviceEpDispatch> ep_dispatch_device(DeviceCommunicator&, const cuda::MoePlan&, int64_t, const uint16_t*,
                                            const int32_t*, DeviceEpBuffers&, void*) {
  return nccl_available();
}
Result<const float*> ep_experts_device(const cuda::MoePlan&, const cuda::DeviceWeights&, const DeviceEpDispatch&, void*,
                                       DeviceEpBuffers&, void*) {
  return nccl_available();
}
Status ep_combine_device(DeviceCommunicator&, const DeviceEpDispatch&, const cuda::MoePlan&, const float*,
                         const float*, void*, DeviceEpBuffers&, void*) {
  return nccl_available();
}
Status ep_moe_run_device(DeviceCommunicator&, const cuda::MoePlan&, const cuda::DeviceWeights&, int64_t,
                         const uint16_t*, const int32_t*, const float*, void*, void*, DeviceEpBuffers&, void*) {
  return nccl_available();
}

}  // namespace k3::comm
