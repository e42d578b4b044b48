// Builds without the CUDA backend: the NCCL transport reports why it is missing.
#include "k3/comm_ipc.hpp"
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

// The one-shot IPC all-reduce (k3/comm_ipc.hpp): no group can be made without CUDA.
struct IpcAllreduceGroup::Impl {
  DeviceCommunicator* comm = nullptr;
};
IpcAllreduceGroup::IpcAllreduceGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
IpcAllreduceGroup::~IpcAllreduceGroup() = default;
int IpcAllreduceGroup::rank() const { return 0; }
int IpcAllreduceGroup::size() const { return 1; }
int64_t IpcAllreduceGroup::capacity_bytes() const { return 0; }
DeviceCommunicator& IpcAllreduceGroup::comm() { return *impl_->comm; }
Status IpcAllreduceGroup::synchronize(void*) { return ipc_available(); }
Status ipc_available() {
  return unsupported("k3 was built without the CUDA backend (K3_CUDA=OFF or no nvcc), so without its one-shot IPC "
                     "all-reduce");
}
Result<std::unique_ptr<IpcAllreduceGroup>> make_ipc_allreduce_group(DeviceCommunicator& comm, const IpcOptions& options) {
  Status local = check_ipc_options(options);
  if (local.is_ok()) local = ipc_available();
  K3_RETURN_IF_ERROR(agree_on_status(comm.host(), local));  // the same "rank q of W: ..." as the CUDA build
  return ipc_available();
}
Status allreduce_bf16_oneshot(IpcAllreduceGroup&, const uint16_t*, int64_t, int64_t, uint16_t*, void*) {
  return ipc_available();
}
Status allreduce_add_rmsnorm_bf16_oneshot(IpcAllreduceGroup&, const uint16_t*, const uint16_t*, const uint16_t*, int64_t,
                                          int64_t, float, uint16_t*, uint16_t*, void*) {
  return ipc_available();
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
