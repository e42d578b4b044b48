// k3/comm_nccl.hpp — the multi-rank ops on GPU buffers, over NCCL (docs/distributed.md, "NCCL").
//
// Ran at world size 1 on an H200 (2026-12-04: its tests pass in scripts/device-check.sh); never
// run across GPUs, so treat the multi-GPU path as unverified. Compiled in CI (sm_90a, sm_120a)
// and checked on the host for its refusals.
//
// NCCL is opened at run time (dlopen of libnccl.so.2; $K3_NCCL_LIBRARY names another file), so
// neither the library nor the `k3` tool needs NCCL to start. A DeviceCommunicator is made from a
// host Communicator (MPI, or the one-process one), which carries the NCCL unique id, the
// argument agreement of each op and must outlive it. Work is stream-ordered: calls enqueue on the
// caller's stream (a cudaStream_t passed as void*) and return; synchronize() waits with a
// deadline, so a peer that vanished fails the wait instead of hanging it (the NCCL communicator
// is then aborted and unusable).
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "k3/comm.hpp"
#include "k3/status.hpp"

namespace k3::comm {

class DeviceCommunicator {
 public:
  virtual ~DeviceCommunicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual int device() const = 0;
  virtual Communicator& host() = 0;  // the bootstrap communicator

  // Device pointers; byte counts on the host, in the Communicator::alltoallv layout (per-peer
  // counts, displacements = prefix sums). Grouped ncclSend / ncclRecv.
  virtual Status alltoallv(const void* send, std::span<const int64_t> send_bytes, void* recv,
                           std::span<const int64_t> recv_bytes, void* stream) = 0;
  // ncclAllReduce(sum) in place: the transport's own reduction, a benchmark baseline (its bits
  // depend on NCCL's algorithm and the world size).
  virtual Status native_allreduce_sum_f32(float* data, int64_t count, void* stream) = 0;
  // Waits for `stream`, at most NcclOptions::timeout_s; checks NCCL's asynchronous errors.
  virtual Status synchronize(void* stream) = 0;
};

struct NcclOptions {
  int device = -1;          // CUDA device of this rank; -1: the current device
  double timeout_s = 120;   // synchronize()'s deadline
};

// ok when this build has the CUDA backend, NCCL can be opened and a CUDA device exists; else why not.
Status nccl_available();

// Collective over `host` (every rank calls it): rank 0 makes the NCCL unique id, all ranks get
// it through `host`, each initializes its NCCL rank on its device.
Result<std::unique_ptr<DeviceCommunicator>> make_nccl_communicator(Communicator& host, const NcclOptions& options = {});

// The TP all-reduce on device buffers: the contract and the bits of allreduce_bf16 /
// allreduce_add_rmsnorm_bf16 (k3/allreduce.hpp; same exact-sum code), two-shot over NCCL
// (rows split into size() shards: grouped send/recv to the shard owners, exact sum + epilogue
// on the owner, grouped send/recv of the results to every rank). residual may be null (no
// residual); residual_out may equal residual. Enqueued on `stream`; call synchronize() to wait.
Status allreduce_bf16_device(DeviceCommunicator& comm, const uint16_t* x, int64_t rows, int64_t cols, uint16_t* out,
                             void* stream);
Status allreduce_add_rmsnorm_bf16_device(DeviceCommunicator& comm, const uint16_t* x, const uint16_t* residual,
                                         const uint16_t* gamma, int64_t rows, int64_t cols, float eps, uint16_t* out,
                                         uint16_t* residual_out, void* stream);

}  // namespace k3::comm
