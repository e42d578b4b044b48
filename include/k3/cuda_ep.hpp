// k3/cuda_ep.hpp — expert parallelism on GPU buffers over NCCL: the device counterpart of
// k3/ep.hpp's dispatch / experts / combine (docs/distributed.md, "GPU (NCCL) expert parallelism").
//
// Ran at world size 1 on an H200 (2026-12-04: tests/cuda/test_cuda_ep.cpp passes); never run
// across GPUs, so treat the multi-GPU path as unverified. Its argument checks and its host
// bookkeeping (k3/ep_route.hpp) are tested on machines without a GPU.
//
// Same contract as the CPU path: rank r of W holds the experts of k3/moe.hpp's expert_range (any
// W from 1 to E; the first E mod W ranks one expert more); each rank
// brings its own tokens (0 included) with global top-k ids; a token's BF16 row goes once to each
// rank holding one of its slots, masked slots (-1) are never sent; every local slot's FP32 y comes
// back to the token's source, which sums the slots in slot order with the same finalize kernel as
// cuda::run. The output is therefore the single-process layer's bits (cuda::run, ep_size 1) for
// every world size, provided each y row is (as for the CPU backend) independent of the other rows
// of its call.
//
// The wire carries BF16 rows, also for W4A8: the CUDA MoE quantizes x itself (prep_x) and has no
// entry point taking MXFP8 codes + scales on its BF16-operand path, so the MXFP8 wire of the CPU
// path (half the bytes) is not used here.
//
// Synchronization (this path is NOT graph-capturable): the bookkeeping is host code, so
//   * ep_dispatch_device waits for `stream` once (the top-k ids come to the host) and exchanges
//     counts and ids over the host communicator (blocking);
//   * ep_experts_device waits for `stream` once at the end (the kernels' error bits);
//   * ep_combine_device exchanges counts over the host communicator (blocking), then enqueues the
//     NCCL transfer and the finalize and returns without waiting.
// Buffers grow with cudaMalloc (after a device synchronize) when a call needs more than the last.
// Every rank calls each function in the same order; a bad argument on one rank makes every rank
// return an error (agreed over the host communicator before any transfer), never a hang.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "k3/comm_nccl.hpp"
#include "k3/cuda_moe.hpp"
#include "k3/ep_route.hpp"
#include "k3/moe.hpp"
#include "k3/status.hpp"

namespace k3::comm {

// Device buffers kept between calls (they only grow). Give the same object to every call of a
// serving loop. A DeviceEpDispatch points into it: valid until the next ep_dispatch_device on it.
class DeviceEpBuffers {
 public:
  DeviceEpBuffers();
  ~DeviceEpBuffers();
  DeviceEpBuffers(DeviceEpBuffers&&) noexcept;
  DeviceEpBuffers& operator=(DeviceEpBuffers&&) noexcept;
  struct Impl;
  Impl* impl() const { return impl_.get(); }

 private:
  std::unique_ptr<Impl> impl_;
};

struct DeviceEpDispatch {
  MoeShape shape;                     // this rank's (ep_size = W, ep_rank = rank)
  int64_t source_tokens = 0;          // this rank's own tokens
  int64_t rows = 0;                   // rows received, grouped by source rank, each in its token order
  const uint16_t* x = nullptr;        // device [rows, K] BF16 (in the buffers)
  const int32_t* topk_ids = nullptr;  // device [rows, top_k]: this rank's expert ids, -1 elsewhere
  std::vector<int32_t> topk_ids_host; // the same ids on the host
  std::vector<int64_t> rows_from;     // [W]
  EpRoute route;                      // this rank's tokens as sent, and where their y rows come back
  EpExpertSlots slots;                // the local slots of the received rows (pieces of plan.max_tokens)
  int64_t bytes_sent = 0, bytes_received = 0;
};

// Sends this rank's m tokens (x: device [m, K] BF16, topk_ids: device [m, top_k] global ids) to the
// experts' ranks. plan: this rank's (problem.shape.ep_size = comm.size(), ep_rank = comm.rank());
// its max_tokens sets the pieces the experts run in. Waits for `stream` (the ids come to the host).
Result<DeviceEpDispatch> ep_dispatch_device(DeviceCommunicator& comm, const cuda::MoePlan& plan, int64_t m,
                                            const uint16_t* x, const int32_t* topk_ids, DeviceEpBuffers& buffers,
                                            void* stream);

// Runs cuda::run_experts on d's rows in pieces of at most plan.max_tokens and gathers every local
// slot's y row into the buffers: [sum of d.slots.slots_from, K] FP32, per source in rank order,
// (row, slot) order within. Waits for `stream` at the end and returns kInexact when a kernel set an
// error bit (as cuda::run_host does). workspace: plan.workspace_bytes, 256-byte aligned.
// Local only: ep_moe_run_device agrees on its status before the combine.
Result<const float*> ep_experts_device(const cuda::MoePlan& plan, const cuda::DeviceWeights& w,
                                       const DeviceEpDispatch& d, void* workspace, DeviceEpBuffers& buffers,
                                       void* stream);

// Returns every slot's y (y: the rows of ep_experts_device) to its source and writes
// out [d.source_tokens, K] (plan's output dtype) with cuda::finalize(topk_weights [M, top_k]).
// d.source_tokens must be <= plan.max_tokens. Enqueued on `stream`; comm.synchronize() waits.
Status ep_combine_device(DeviceCommunicator& comm, const DeviceEpDispatch& d, const cuda::MoePlan& plan,
                         const float* y, const float* topk_weights, void* out, DeviceEpBuffers& buffers,
                         void* stream);

// dispatch -> experts -> (agree) -> combine. out: device [m, K] of the plan's output dtype.
Status ep_moe_run_device(DeviceCommunicator& comm, const cuda::MoePlan& plan, const cuda::DeviceWeights& w,
                         int64_t m, const uint16_t* x, const int32_t* topk_ids, const float* topk_weights, void* out,
                         void* workspace, DeviceEpBuffers& buffers, void* stream);

}  // namespace k3::comm
