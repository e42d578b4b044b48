// The parts of k3/comm_ipc.hpp common to builds with and without CUDA: the options check and the
// dispatchers (one-shot over IPC for messages that fit, the NCCL two-shot otherwise). The device
// paths themselves are in src/comm/cuda/ipc_allreduce.cu, or stubbed in src/comm/nccl_absent.cpp.
#include <string>

#include "k3/comm_ipc.hpp"

namespace k3::comm {

Status check_ipc_options(const IpcOptions& options) {
  if (options.capacity_bytes < 256 || options.capacity_bytes > kIpcMaxCapacityBytes || options.capacity_bytes % 256 != 0) {
    return invalid_argument("IpcOptions.capacity_bytes = " + std::to_string(options.capacity_bytes) +
                            " must be a multiple of 256 in [256, " + std::to_string(kIpcMaxCapacityBytes) + "]");
  }
  if (!(options.timeout_s > 0) || options.timeout_s > 3600) {
    return invalid_argument("IpcOptions.timeout_s = " + std::to_string(options.timeout_s) + " must be in (0, 3600]");
  }
  return Status::ok();
}

namespace {

Status check_group(DeviceCommunicator& comm, IpcAllreduceGroup* ipc, const char* fn) {
  if (ipc != nullptr && &ipc->comm() != &comm) {
    return invalid_argument(std::string(fn) + ": the IpcAllreduceGroup was made from another DeviceCommunicator");
  }
  return Status::ok();
}

}  // namespace

Result<AllreducePath> allreduce_bf16_auto(DeviceCommunicator& comm, IpcAllreduceGroup* ipc, const uint16_t* x,
                                          int64_t rows, int64_t cols, uint16_t* out, void* stream) {
  K3_RETURN_IF_ERROR(check_group(comm, ipc, "allreduce_bf16_auto"));
  const AllreducePath p = choose_allreduce_path(ipc != nullptr ? ipc->capacity_bytes() : 0, rows, cols);
  if (p == AllreducePath::kOneShotIpc) {
    K3_RETURN_IF_ERROR(allreduce_bf16_oneshot(*ipc, x, rows, cols, out, stream));
  } else {
    K3_RETURN_IF_ERROR(allreduce_bf16_device(comm, x, rows, cols, out, stream));
  }
  return p;
}

Result<AllreducePath> allreduce_add_rmsnorm_bf16_auto(DeviceCommunicator& comm, IpcAllreduceGroup* ipc,
                                                      const uint16_t* x, const uint16_t* residual,
                                                      const uint16_t* gamma, int64_t rows, int64_t cols, float eps,
                                                      uint16_t* out, uint16_t* residual_out, void* stream) {
  K3_RETURN_IF_ERROR(check_group(comm, ipc, "allreduce_add_rmsnorm_bf16_auto"));
  const AllreducePath p = choose_allreduce_path(ipc != nullptr ? ipc->capacity_bytes() : 0, rows, cols);
  if (p == AllreducePath::kOneShotIpc) {
    K3_RETURN_IF_ERROR(
        allreduce_add_rmsnorm_bf16_oneshot(*ipc, x, residual, gamma, rows, cols, eps, out, residual_out, stream));
  } else {
    K3_RETURN_IF_ERROR(
        allreduce_add_rmsnorm_bf16_device(comm, x, residual, gamma, rows, cols, eps, out, residual_out, stream));
  }
  return p;
}

}  // namespace k3::comm
