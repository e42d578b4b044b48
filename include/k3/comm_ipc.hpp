// k3/comm_ipc.hpp — the one-shot TP all-reduce over CUDA peer-mapped (IPC) buffers for small
// messages, with the NCCL two-shot of k3/comm_nccl.hpp as the fallback (docs/distributed.md,
// "One-shot all-reduce over peer-mapped buffers").
//
// Ran at world size 1 on an H200 (2026-12-04): its world-size-1 test
// (tests/cuda/test_ipc_allreduce.cpp), the only one a single GPU can run, passes. Never run across
// GPUs: treat the multi-GPU path as unverified.
//
// An IpcAllreduceGroup is made collectively from a DeviceCommunicator: every rank cudaMalloc's
// one buffer (a flag header and two data slots of capacity_bytes each), the cudaIpcMemHandles
// are all-gathered over the host Communicator, each rank opens its peers' (its own pointer for
// itself). Same node only: every peer's device must be visible and peer-accessible
// (cudaDeviceCanAccessPeer); otherwise creation returns kUnsupported on EVERY rank, naming the
// reason, and the caller keeps using the NCCL two-shot (allreduce_*_auto does so when given null).
//
// One call (epoch e, data slot e % 2): copy x into this rank's slot; store e (release, system
// scope) into every peer's flag for this rank; spin (acquire loads, bounded by
// IpcOptions::timeout_s on the device clock) until every peer's flag for e arrived; then every
// rank reads all W slots and computes the exact sum itself, in rank order 0..W-1, with the SAME
// exact-sum code as the CPU and the NCCL all-reduce: the same bits on every rank and for every W.
// Two slots make one flag round per call enough: a rank that starts call e + 2 (overwriting slot
// e % 2) has seen every peer signal e + 1, which each did after finishing its reads of call e.
// A peer that never signals sets a sticky timeout in the group (the outputs are then not written);
// synchronize() reports it as kUnavailable and the group is unusable afterwards.
// Calls on one group must be ordered (one stream). Destroy a group only after every rank's last
// call has been synchronized (e.g. then a host barrier): peers read this rank's buffer until then.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "k3/comm.hpp"
#include "k3/comm_nccl.hpp"
#include "k3/status.hpp"

namespace k3::comm {

inline constexpr int kIpcMaxWorld = 8;                                   // one node's peer-mapped GPUs
inline constexpr int64_t kIpcMaxCapacityBytes = int64_t{256} << 20;      // per data slot

struct IpcOptions {
  int64_t capacity_bytes = int64_t{1} << 20;  // largest one-shot message (rows * cols * 2); a multiple of 256 in [256, 256 MiB]
  double timeout_s = 30;                      // the device spin's bound on a peer's flag; in (0, 3600]
};

// Checks the options alone (no device needed): kInvalidArgument naming the field, its value, the range.
Status check_ipc_options(const IpcOptions& options);

class IpcAllreduceGroup {
 public:
  struct Impl;
  explicit IpcAllreduceGroup(std::unique_ptr<Impl> impl);
  ~IpcAllreduceGroup();
  IpcAllreduceGroup(const IpcAllreduceGroup&) = delete;
  IpcAllreduceGroup& operator=(const IpcAllreduceGroup&) = delete;

  int rank() const;
  int size() const;
  int64_t capacity_bytes() const;
  DeviceCommunicator& comm();
  // Waits for `stream` (deadline: timeout_s + 10 s), then reads the group's timeout status:
  // kUnavailable naming this rank and the peer whose flag never came, after which every call fails.
  Status synchronize(void* stream);
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// ok when this build has the CUDA backend and a CUDA device exists; else why not.
Status ipc_available();

// Collective over comm.host() (every rank calls it). Errors are agreed: every rank gets the
// same Status (kInvalidArgument for bad options, kUnsupported when the ranks are not on one node,
// more than kIpcMaxWorld, or a peer's device is not visible / peer-accessible, kUnavailable for a
// CUDA failure), so all ranks fall back to NCCL together.
Result<std::unique_ptr<IpcAllreduceGroup>> make_ipc_allreduce_group(DeviceCommunicator& comm,
                                                                    const IpcOptions& options = {});

// The contract and the bits of allreduce_bf16_device / allreduce_add_rmsnorm_bf16_device
// (k3/comm_nccl.hpp), one-shot: rows * cols * 2 must be <= group.capacity_bytes()
// (kInvalidArgument otherwise, on every rank). Enqueued on `stream`; group.synchronize() waits.
Status allreduce_bf16_oneshot(IpcAllreduceGroup& group, const uint16_t* x, int64_t rows, int64_t cols, uint16_t* out,
                              void* stream);
Status allreduce_add_rmsnorm_bf16_oneshot(IpcAllreduceGroup& group, const uint16_t* x, const uint16_t* residual,
                                          const uint16_t* gamma, int64_t rows, int64_t cols, float eps, uint16_t* out,
                                          uint16_t* residual_out, void* stream);

enum class AllreducePath { kOneShotIpc, kTwoShotNccl };

inline const char* to_string(AllreducePath p) {
  return p == AllreducePath::kOneShotIpc ? "one-shot (CUDA IPC peer-mapped buffers)" : "two-shot (NCCL)";
}

// The dispatcher's rule, a pure function of the sizes (the same on every rank): one-shot when a
// group exists (ipc_capacity_bytes > 0) and the message rows * cols * 2 fits in it, else two-shot.
// Negative or overflowing shapes go to two-shot, whose argument check names them.
inline AllreducePath choose_allreduce_path(int64_t ipc_capacity_bytes, int64_t rows, int64_t cols) {
  if (ipc_capacity_bytes <= 0 || rows < 0 || cols < 0) return AllreducePath::kTwoShotNccl;
  if (cols != 0 && rows > ipc_capacity_bytes / 2 / cols) return AllreducePath::kTwoShotNccl;
  return AllreducePath::kOneShotIpc;
}

// Dispatchers: `ipc` may be null (no group: IPC unavailable) and then the NCCL two-shot runs.
// Return the path taken; errors as the chosen function's. After a one-shot call, wait with
// ipc->synchronize(stream); after a two-shot one, with comm.synchronize(stream).
Result<AllreducePath> allreduce_bf16_auto(DeviceCommunicator& comm, IpcAllreduceGroup* ipc, const uint16_t* x,
                                          int64_t rows, int64_t cols, uint16_t* out, void* stream);
Result<AllreducePath> allreduce_add_rmsnorm_bf16_auto(DeviceCommunicator& comm, IpcAllreduceGroup* ipc,
                                                      const uint16_t* x, const uint16_t* residual,
                                                      const uint16_t* gamma, int64_t rows, int64_t cols, float eps,
                                                      uint16_t* out, uint16_t* residual_out, void* stream);

}  // namespace k3::comm
