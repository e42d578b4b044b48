// The one-shot TP all-reduce over CUDA peer-mapped (IPC) buffers (k3/comm_ipc.hpp): the group
// (buffers, handles, flags) and its kernels.
//
// Ran at world size 1 on an H200 (2026-12-04: tests/cuda/test_ipc_allreduce.cpp passes, the only
// size one GPU can run); never run across GPUs.
//
// Buffer of rank r (cudaMalloc, exported with cudaIpcGetMemHandle):
//   [0, kHeaderBytes)            flags: uint32 flag[q] = the last epoch rank q signalled to r,
//                                then uint32 status (bit 0: timed out; bits 8..15: the peer);
//                                at byte 64: char* peer[kIpcMaxWorld], every rank's buffer as
//                                mapped in THIS process (read by this rank's kernels only)
//   [kHeaderBytes, + cap)        data slot 0 (odd epochs... slot = epoch % 2)
//   [kHeaderBytes + cap, + cap)  data slot 1
#include <cuda_runtime.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "comm/cuda/allreduce_kernels.hpp"
#include "comm/ops/exact_sum.hpp"
#include "k3/comm_ipc.hpp"
#include "k3/formats.hpp"

namespace k3::comm {
namespace {

constexpr int64_t kHeaderBytes = 256;  // kIpcMaxWorld flags + status, padded
constexpr int kStatusWord = kIpcMaxWorld;  // index of the status word in the header
constexpr int64_t kPeerTableOffset = 64;   // byte offset of the peer pointer table

std::string num(int64_t v) { return std::to_string(v); }
void set(Status& dst, Status v) { static_cast<void>(dst = std::move(v)); }
Status from_cuda(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return Status::ok();
  cudaGetLastError();
  return unavailable(what + " failed: " + cudaGetErrorString(e));
}

__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One thread: signal epoch e to every peer (its flag[rank] in the peer's buffer), then wait for
// every peer's flag[q] in this rank's buffer, at most timeout_ns. The data copy into this rank's
// slot precedes this kernel in stream order; the release store orders it before the flag, the
// acquire loads order the peers' data before this rank's reads (the reduce kernel follows).
// (The peer table is in global memory: a kernel-parameter array indexed by q would be copied to
// a local-memory frame.)
__global__ void signal_wait_kernel(uint32_t* mine, char* const* peers, int w, int rank, uint32_t epoch,
                                   uint64_t timeout_ns) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  if (load_acquire_sys(mine + kStatusWord) != 0) return;  // an earlier call timed out: stay failed
  __threadfence_system();
  for (int q = 0; q < w; ++q) {
    if (q != rank) store_release_sys(reinterpret_cast<uint32_t*>(peers[q]) + rank, epoch);
  }
  const uint64_t t0 = globaltimer_ns();
  for (int q = 0; q < w; ++q) {
    if (q == rank) continue;
    while (static_cast<int32_t>(load_acquire_sys(mine + q) - epoch) < 0) {
      if (globaltimer_ns() - t0 > timeout_ns) {
        store_release_sys(mine + kStatusWord, 1u | (static_cast<uint32_t>(q) << 8));
        return;
      }
      __nanosleep(100);
    }
  }
  __threadfence_system();
}

// One thread per element: gather the W contributions in rank order (into this thread's column
// of shared memory, stride kReduceThreads, so no local-memory array), the exact sum
// (exact_sum.hpp, the CPU's definition), the element-wise epilogue. Writes nothing after a timeout.
constexpr int kReduceThreads = 256;
__global__ void __launch_bounds__(kReduceThreads)
    oneshot_reduce_kernel(const uint32_t* mine, char* const* peers, int w, int64_t slot_offset, int64_t n,
                          const uint16_t* residual, bool norm, uint16_t* out, uint16_t* residual_out) {
  __shared__ uint32_t failed;
  __shared__ uint16_t gathered[kIpcMaxWorld * kReduceThreads];
  if (threadIdx.x == 0) failed = load_acquire_sys(mine + kStatusWord);
  __syncthreads();
  if (failed != 0) return;
  uint16_t* v = gathered + threadIdx.x;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    // __ldcg: L2 only (the peers' slots are rewritten every second call; no stale L1 line).
    for (int q = 0; q < w; ++q) v[q * kReduceThreads] = __ldcg(reinterpret_cast<const uint16_t*>(peers[q] + slot_offset) + i);
    const float sum = detail::exact_sum_bf16(v, kReduceThreads, w);
    if (!norm) {
      out[i] = bf16_from_f32(sum);
    } else {
      // __fadd_rn: one IEEE FP32 addition (never contracted), as on the CPU. residual_out may be
      // residual: each element is read before it is written, by the same thread.
      residual_out[i] = bf16_from_f32(residual != nullptr ? __fadd_rn(sum, bf16_to_f32(residual[i])) : sum);
    }
  }
}

}  // namespace

struct IpcAllreduceGroup::Impl {
  DeviceCommunicator* comm = nullptr;
  int rank = 0, size = 1, device = 0;
  int64_t capacity = 0;
  double timeout_s = 30;
  char* own = nullptr;                 // this rank's cudaMalloc'd buffer
  char* peers[kIpcMaxWorld] = {};      // opened handles (own pointer at [rank]); copied to the header
  std::vector<char*> opened;           // to cudaIpcCloseMemHandle
  uint32_t epoch = 0;
  bool failed = false;
  std::string failure;

  ~Impl() {
    for (char* p : opened) cudaIpcCloseMemHandle(p);
    if (own != nullptr) cudaFree(own);
  }
};

IpcAllreduceGroup::IpcAllreduceGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
IpcAllreduceGroup::~IpcAllreduceGroup() = default;
int IpcAllreduceGroup::rank() const { return impl_->rank; }
int IpcAllreduceGroup::size() const { return impl_->size; }
int64_t IpcAllreduceGroup::capacity_bytes() const { return impl_->capacity; }
DeviceCommunicator& IpcAllreduceGroup::comm() { return *impl_->comm; }

Status IpcAllreduceGroup::synchronize(void* stream) {
  Impl& g = *impl_;
  if (g.failed) return unavailable(g.failure);
  auto* st = static_cast<cudaStream_t>(stream);
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t q = cudaStreamQuery(st);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) return from_cuda(q, "rank " + num(g.rank) + ": cudaStreamQuery");
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > g.timeout_s + 10) {
      g.failed = true;
      g.failure = "rank " + num(g.rank) + " of " + num(g.size) + ": the one-shot all-reduce's stream did not finish within " +
                  num(static_cast<int64_t>(g.timeout_s + 10)) + " s; the IPC group is unusable";
      return unavailable(g.failure);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  uint32_t status = 0;
  K3_RETURN_IF_ERROR(from_cuda(cudaMemcpy(&status, g.own + kStatusWord * 4, 4, cudaMemcpyDeviceToHost),
                               "rank " + num(g.rank) + ": cudaMemcpy of the IPC status word"));
  if (status != 0) {
    g.failed = true;
    g.failure = "rank " + num(g.rank) + " of " + num(g.size) + ": rank " + num((status >> 8) & 0xFF) +
                " did not signal its one-shot all-reduce data within IpcOptions.timeout_s = " +
                std::to_string(g.timeout_s) + " s (a peer exited, crashed, hangs or called a different op); "
                "the outputs were not written and the IPC group is unusable";
    return unavailable(g.failure);
  }
  return Status::ok();
}

Status ipc_available() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();
    return unavailable(std::string("no CUDA device for the one-shot IPC all-reduce (") +
                       (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices") + ")");
  }
  return Status::ok();
}

Result<std::unique_ptr<IpcAllreduceGroup>> make_ipc_allreduce_group(DeviceCommunicator& comm, const IpcOptions& options) {
  Communicator& host = comm.host();
  const int w = host.size(), r = host.rank();
  Status local = check_ipc_options(options);
  if (local.is_ok()) set(local, ipc_available());
  if (local.is_ok() && w > kIpcMaxWorld) {
    set(local, unsupported("make_ipc_allreduce_group: world size " + num(w) + " exceeds kIpcMaxWorld = " +
                           num(kIpcMaxWorld) + " (one node's peer-mapped GPUs); use the NCCL two-shot"));
  }
  if (local.is_ok()) set(local, from_cuda(cudaSetDevice(comm.device()), "cudaSetDevice(" + num(comm.device()) + ")"));
  K3_RETURN_IF_ERROR(agree_on_status(host, local));
  K3_RETURN_IF_ERROR(check_same_on_all_ranks(host, "IpcOptions capacity_bytes x timeout_s",
                                             num(options.capacity_bytes) + " x " + std::to_string(options.timeout_s)));

  // Same node, and every peer's device visible here and peer-accessible.
  struct Identity {
    char host[64];
    char bus[32];
  } me{};
  gethostname(me.host, sizeof me.host - 1);
  set(local, from_cuda(cudaDeviceGetPCIBusId(me.bus, sizeof me.bus - 1, comm.device()), "cudaDeviceGetPCIBusId"));
  K3_RETURN_IF_ERROR(agree_on_status(host, local));
  std::vector<Identity> ids(static_cast<size_t>(w));
  K3_RETURN_IF_ERROR(host.allgather(&me, sizeof me, ids.data()));
  for (int q = 0; q < w && local.is_ok(); ++q) {
    const Identity& p = ids[static_cast<size_t>(q)];
    if (std::strncmp(p.host, me.host, sizeof me.host) != 0) {
      set(local, unsupported("make_ipc_allreduce_group: rank " + num(q) + " runs on host '" + p.host + "', this rank on '" +
                             me.host + "': peer-mapped buffers need all ranks on one node; use the NCCL two-shot"));
      break;
    }
    int dev = -1;
    if (cudaDeviceGetByPCIBusId(&dev, p.bus) != cudaSuccess) {
      cudaGetLastError();
      set(local, unsupported("make_ipc_allreduce_group: rank " + num(q) + "'s GPU (PCI bus id " + p.bus +
                             ") is not visible to this process (CUDA_VISIBLE_DEVICES?), so it cannot be peer-mapped; "
                             "use the NCCL two-shot"));
      break;
    }
    if (dev == comm.device()) continue;  // the same GPU (rank q is this rank, or shares the device)
    int can = 0;
    set(local, from_cuda(cudaDeviceCanAccessPeer(&can, comm.device(), dev), "cudaDeviceCanAccessPeer"));
    if (local.is_ok() && can == 0) {
      set(local, unsupported("make_ipc_allreduce_group: device " + num(comm.device()) + " cannot access rank " + num(q) +
                             "'s device " + num(dev) + " (" + p.bus +
                             ") as a peer (cudaDeviceCanAccessPeer = 0: no NVLink / P2P); use the NCCL two-shot"));
    }
  }
  K3_RETURN_IF_ERROR(agree_on_status(host, local));

  auto impl = std::make_unique<IpcAllreduceGroup::Impl>();
  impl->comm = &comm;
  impl->rank = r;
  impl->size = w;
  impl->device = comm.device();
  impl->capacity = options.capacity_bytes;
  impl->timeout_s = options.timeout_s;
  const size_t bytes = static_cast<size_t>(kHeaderBytes + 2 * options.capacity_bytes);
  cudaIpcMemHandle_t handle{};
  set(local, from_cuda(cudaMalloc(reinterpret_cast<void**>(&impl->own), bytes), "cudaMalloc of the IPC buffer (" +
                                                                                   num(static_cast<int64_t>(bytes)) + " bytes)"));
  if (local.is_ok()) set(local, from_cuda(cudaMemset(impl->own, 0, bytes), "cudaMemset of the IPC buffer"));
  if (local.is_ok()) set(local, from_cuda(cudaIpcGetMemHandle(&handle, impl->own), "cudaIpcGetMemHandle"));
  K3_RETURN_IF_ERROR(agree_on_status(host, local));
  std::vector<cudaIpcMemHandle_t> handles(static_cast<size_t>(w));
  K3_RETURN_IF_ERROR(host.allgather(&handle, sizeof handle, handles.data()));
  for (int q = 0; q < w && local.is_ok(); ++q) {
    if (q == r) {
      impl->peers[q] = impl->own;
      continue;
    }
    void* p = nullptr;
    set(local, from_cuda(cudaIpcOpenMemHandle(&p, handles[static_cast<size_t>(q)], cudaIpcMemLazyEnablePeerAccess),
                         "cudaIpcOpenMemHandle of rank " + num(q) + "'s buffer"));
    if (local.is_ok()) {
      impl->peers[q] = static_cast<char*>(p);
      impl->opened.push_back(static_cast<char*>(p));
    }
  }
  if (local.is_ok()) {
    set(local, from_cuda(cudaMemcpy(impl->own + kPeerTableOffset, impl->peers, sizeof impl->peers, cudaMemcpyHostToDevice),
                         "cudaMemcpy of the IPC peer table"));
  }
  if (local.is_ok()) set(local, from_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
  K3_RETURN_IF_ERROR(agree_on_status(host, local));
  // Every rank's flags are zero before any rank can signal into them.
  K3_RETURN_IF_ERROR(host.barrier());
  return std::make_unique<IpcAllreduceGroup>(std::move(impl));
}

namespace {

Status oneshot(IpcAllreduceGroup& group, const uint16_t* x, const uint16_t* residual, const uint16_t* gamma,
               int64_t rows, int64_t cols, float eps, uint16_t* out, uint16_t* residual_out, bool norm, void* stream) {
  IpcAllreduceGroup::Impl& g = group.impl();
  const char* fn = norm ? "allreduce_add_rmsnorm_bf16_oneshot" : "allreduce_bf16_oneshot";
  Status local = Status::ok();
  if (g.failed) {
    set(local, unavailable(g.failure));
  } else if (rows < 0 || cols < 0 || rows > (int64_t{1} << 31) || cols > (int64_t{1} << 24)) {
    set(local, invalid_argument(std::string(fn) + ": rows = " + num(rows) + ", cols = " + num(cols) +
                                " must be in [0, 2^31] x [0, 2^24]"));
  } else if (choose_allreduce_path(g.capacity, rows, cols) != AllreducePath::kOneShotIpc) {
    set(local, invalid_argument(std::string(fn) + ": the message rows x cols x 2 = " + num(rows) + " x " + num(cols) +
                                " x 2 = " + num(rows * cols * 2) + " bytes exceeds the IPC buffer's capacity_bytes = " +
                                num(g.capacity) + " (use the _auto dispatcher: NCCL two-shot above it)"));
  } else if (rows * cols > 0 &&
             (x == nullptr || out == nullptr || (norm && (gamma == nullptr || residual_out == nullptr)))) {
    set(local, invalid_argument(std::string(fn) + ": x, out" + (norm ? ", gamma and residual_out" : "") +
                                " must be device pointers (null given)"));
  } else if (norm && !(eps > 0.0f && eps < 3.4e38f)) {
    set(local, invalid_argument(std::string(fn) + ": eps = " + std::to_string(eps) + " must be > 0 and finite"));
  }
  Communicator& host = g.comm->host();
  K3_RETURN_IF_ERROR(agree_on_status(host, local));
  K3_RETURN_IF_ERROR(check_same_on_all_ranks(host, std::string(fn) + " rows x cols x eps",
                                             num(rows) + " x " + num(cols) + " x " + std::to_string(eps)));
  if (rows * cols == 0) return Status::ok();
  auto* st = static_cast<cudaStream_t>(stream);
  const uint32_t epoch = ++g.epoch;
  const int64_t slot_offset = kHeaderBytes + static_cast<int64_t>(epoch % 2) * g.capacity;
  const int64_t n = rows * cols;
  Status s = from_cuda(cudaMemcpyAsync(g.own + slot_offset, x, static_cast<size_t>(n) * 2, cudaMemcpyDeviceToDevice, st),
                       "cudaMemcpyAsync into the IPC slot");
  if (s.is_ok()) {
    auto* mine = reinterpret_cast<uint32_t*>(g.own);
    auto* const* peers = reinterpret_cast<char* const*>(g.own + kPeerTableOffset);
    signal_wait_kernel<<<1, 32, 0, st>>>(mine, peers, g.size, g.rank, epoch, static_cast<uint64_t>(g.timeout_s * 1e9));
    const int64_t want = (n + kReduceThreads - 1) / kReduceThreads;
    const int blocks = static_cast<int>(want < 4096 ? want : 4096);
    oneshot_reduce_kernel<<<blocks, kReduceThreads, 0, st>>>(mine, peers, g.size, slot_offset, n, residual, norm, out,
                                                             residual_out);
    set(s, from_cuda(cudaGetLastError(), std::string(fn) + " kernels"));
  }
  if (s.is_ok() && norm) {
    set(s, from_cuda(detail::launch_rmsnorm_rows(residual_out, gamma, rows, cols, eps, out, st),
                     std::string(fn) + " RMSNorm kernel"));
  }
  if (!s.is_ok()) {
    // The peers may now wait for a flag this rank never stores: the group is out of step.
    g.failed = true;
    g.failure = "rank " + num(g.rank) + ": an earlier one-shot call failed to enqueue (" + s.message() +
                "); the IPC group is unusable";
  }
  return s;
}

}  // namespace

Status allreduce_bf16_oneshot(IpcAllreduceGroup& group, const uint16_t* x, int64_t rows, int64_t cols, uint16_t* out,
                              void* stream) {
  return oneshot(group, x, nullptr, nullptr, rows, cols, 1.0f, out, nullptr, false, stream);
}

Status allreduce_add_rmsnorm_bf16_oneshot(IpcAllreduceGroup& group, const uint16_t* x, const uint16_t* residual,
                                          const uint16_t* gamma, int64_t rows, int64_t cols, float eps, uint16_t* out,
                                          uint16_t* residual_out, void* stream) {
  return oneshot(group, x, residual, gamma, rows, cols, eps, out, residual_out, true, stream);
}

}  // namespace k3::comm
