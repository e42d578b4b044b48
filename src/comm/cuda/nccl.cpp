// The NCCL transport and the device TP all-reduce (k3/comm_nccl.hpp): host code (the kernels
// are in allreduce_kernels.cu).
//
// Ran at world size 1 on an H200 (2026-12-04: tests/cuda/test_nccl.cpp passes in
// scripts/device-check.sh); never run across GPUs (see the header).
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "comm/cuda/allreduce_kernels.hpp"
#include "k3/comm_nccl.hpp"
#include "k3/formats.hpp"

namespace k3::comm {
namespace {

std::string num(int64_t v) { return std::to_string(v); }

// nvcc warns when the Status& of an assignment to a [[nodiscard]] Status is dropped.
void set(Status& dst, Status v) { static_cast<void>(dst = std::move(v)); }

// ---- NCCL, opened at run time ----------------------------------------------------------------
struct NcclApi {
  decltype(&::ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&::ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&::ncclCommDestroy) comm_destroy = nullptr;
  decltype(&::ncclCommAbort) comm_abort = nullptr;
  decltype(&::ncclCommGetAsyncError) get_async_error = nullptr;
  decltype(&::ncclGroupStart) group_start = nullptr;
  decltype(&::ncclGroupEnd) group_end = nullptr;
  decltype(&::ncclSend) send = nullptr;
  decltype(&::ncclRecv) recv = nullptr;
  decltype(&::ncclAllReduce) all_reduce = nullptr;
  decltype(&::ncclGetErrorString) error_string = nullptr;
};

Result<NcclApi> load_nccl() {
  static const Result<NcclApi> loaded = []() -> Result<NcclApi> {
    std::vector<std::string> names;
    if (const char* p = std::getenv("K3_NCCL_LIBRARY"); p != nullptr && *p != 0) names.emplace_back(p);
    names.emplace_back("libnccl.so.2");
    const char* dirs[] = {std::getenv("CUDA_HOME"), "/usr/local/cuda"};
    for (const char* dir : dirs) {
      if (dir != nullptr && *dir != 0) names.push_back(std::string(dir) + "/lib64/libnccl.so.2");
    }
    std::string tried;
    for (const auto& name : names) {
      void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib == nullptr) {
        tried += (tried.empty() ? "" : ", ") + name;
        continue;
      }
      NcclApi a;
      auto sym = [&](auto& f, const char* s) { f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(lib, s)); };
      sym(a.get_unique_id, "ncclGetUniqueId");
      sym(a.comm_init_rank, "ncclCommInitRank");
      sym(a.comm_destroy, "ncclCommDestroy");
      sym(a.comm_abort, "ncclCommAbort");
      sym(a.get_async_error, "ncclCommGetAsyncError");
      sym(a.group_start, "ncclGroupStart");
      sym(a.group_end, "ncclGroupEnd");
      sym(a.send, "ncclSend");
      sym(a.recv, "ncclRecv");
      sym(a.all_reduce, "ncclAllReduce");
      sym(a.error_string, "ncclGetErrorString");
      if (a.get_unique_id && a.comm_init_rank && a.comm_destroy && a.comm_abort && a.get_async_error && a.group_start &&
          a.group_end && a.send && a.recv && a.all_reduce && a.error_string) {
        return a;
      }
      dlclose(lib);
      tried += (tried.empty() ? "" : ", ") + name + " (symbols missing)";
    }
    return unavailable("NCCL could not be opened; tried " + tried +
                       " (put libnccl.so.2 on LD_LIBRARY_PATH or name it with K3_NCCL_LIBRARY)");
  }();
  return loaded;
}

Status from_nccl(const NcclApi& a, ncclResult_t r, const char* what, int rank) {
  if (r == ncclSuccess) return Status::ok();
  return unavailable("rank " + num(rank) + ": " + what + " failed: " + a.error_string(r));
}
Status from_cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok();
  return unavailable(std::string(what) + " failed: " + cudaGetErrorString(e));
}

class NcclCommunicator final : public DeviceCommunicator {
 public:
  NcclCommunicator(NcclApi api, ncclComm_t c, Communicator& host, int device, double timeout)
      : api_(api), comm_(c), host_(host), device_(device), timeout_s_(timeout) {}
  ~NcclCommunicator() override {
    if (comm_ != nullptr) {
      if (aborted_) api_.comm_abort(comm_);
      else api_.comm_destroy(comm_);
    }
  }
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  int device() const override { return device_; }
  Communicator& host() override { return host_; }

  Status alltoallv(const void* send, std::span<const int64_t> send_bytes, void* recv,
                   std::span<const int64_t> recv_bytes, void* stream) override {
    K3_RETURN_IF_ERROR(usable());
    const size_t w = static_cast<size_t>(size());
    if (send_bytes.size() != w || recv_bytes.size() != w) {
      return invalid_argument("alltoallv: count arrays have " + num(static_cast<int64_t>(send_bytes.size())) + " and " +
                              num(static_cast<int64_t>(recv_bytes.size())) + " entries, expected size() = " +
                              num(static_cast<int64_t>(w)));
    }
    auto* st = static_cast<cudaStream_t>(stream);
    K3_RETURN_IF_ERROR(from_nccl(api_, api_.group_start(), "ncclGroupStart", rank()));
    int64_t so = 0, ro = 0;
    Status s = Status::ok();
    for (size_t q = 0; q < w && s.is_ok(); ++q) {
      if (send_bytes[q] < 0 || recv_bytes[q] < 0) {
        set(s, invalid_argument("alltoallv: negative byte count for rank " + num(static_cast<int64_t>(q))));
        break;
      }
      if (send_bytes[q] > 0) {
        set(s, from_nccl(api_, api_.send(static_cast<const char*>(send) + so, static_cast<size_t>(send_bytes[q]),
                                         ncclUint8, static_cast<int>(q), comm_, st), "ncclSend", rank()));
      }
      if (s.is_ok() && recv_bytes[q] > 0) {
        set(s, from_nccl(api_, api_.recv(static_cast<char*>(recv) + ro, static_cast<size_t>(recv_bytes[q]), ncclUint8,
                                         static_cast<int>(q), comm_, st), "ncclRecv", rank()));
      }
      so += send_bytes[q];
      ro += recv_bytes[q];
    }
    const Status e = from_nccl(api_, api_.group_end(), "ncclGroupEnd", rank());
    return s.is_ok() ? e : s;
  }

  Status native_allreduce_sum_f32(float* data, int64_t count, void* stream) override {
    K3_RETURN_IF_ERROR(usable());
    if (count < 0) return invalid_argument("native_allreduce_sum_f32: count = " + num(count) + " must be >= 0");
    return from_nccl(api_, api_.all_reduce(data, data, static_cast<size_t>(count), ncclFloat32, ncclSum, comm_,
                                           static_cast<cudaStream_t>(stream)), "ncclAllReduce", rank());
  }

  Status synchronize(void* stream) override {
    K3_RETURN_IF_ERROR(usable());
    auto* st = static_cast<cudaStream_t>(stream);
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      const cudaError_t q = cudaStreamQuery(st);
      if (q == cudaSuccess) return Status::ok();
      if (q != cudaErrorNotReady) return from_cuda(q, "cudaStreamQuery");
      ncclResult_t async = ncclSuccess;
      api_.get_async_error(comm_, &async);
      if (async != ncclSuccess) {
        aborted_ = true;
        return unavailable("rank " + num(rank()) + ": NCCL reported " + api_.error_string(async) +
                           "; the communicator is aborted");
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (s > timeout_s_) {
        aborted_ = true;
        return unavailable("rank " + num(rank()) + " of " + num(size()) + ": the NCCL stream did not finish within " +
                           num(static_cast<int64_t>(timeout_s_)) + " s: a peer rank has exited, crashed or hangs");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  Status usable() const {
    if (aborted_) return unavailable("rank " + num(rank()) + ": this NCCL communicator was aborted after an earlier failure");
    return Status::ok();
  }
  NcclApi api_;
  ncclComm_t comm_;
  Communicator& host_;
  int device_;
  double timeout_s_;
  bool aborted_ = false;
};

// Rows of shard q of W over `rows` rows: [row0(q), row0(q + 1)).
int64_t row0(int64_t rows, int w, int q) { return rows * q / w; }

Status device_allreduce(DeviceCommunicator& comm, const uint16_t* x, const uint16_t* residual, const uint16_t* gamma,
                        int64_t rows, int64_t cols, float eps, uint16_t* out, uint16_t* residual_out, bool norm,
                        void* stream) {
  const char* fn = norm ? "allreduce_add_rmsnorm_bf16_device" : "allreduce_bf16_device";
  Status local = Status::ok();
  if (rows < 0 || cols < 0 || rows > (int64_t{1} << 31) || cols > (int64_t{1} << 24)) {
    set(local, invalid_argument(std::string(fn) + ": rows = " + num(rows) + ", cols = " + num(cols) +
                                " must be in [0, 2^31] x [0, 2^24]"));
  } else if (rows * cols > 0 && (x == nullptr || out == nullptr || (norm && (gamma == nullptr || residual_out == nullptr)))) {
    set(local, invalid_argument(std::string(fn) + ": x, out" + (norm ? ", gamma and residual_out" : "") +
                                " must be device pointers (null given)"));
  } else if (norm && !(eps > 0.0f && eps < 3.4e38f)) {
    set(local, invalid_argument(std::string(fn) + ": eps = " + std::to_string(eps) + " must be > 0 and finite"));
  }
  K3_RETURN_IF_ERROR(agree_on_status(comm.host(), local));
  // Every rank must pass the same shape (a mismatch would make the transfers disagree).
  K3_RETURN_IF_ERROR(check_same_on_all_ranks(comm.host(), std::string(fn) + " rows x cols x eps",
                                             num(rows) + " x " + num(cols) + " x " + std::to_string(eps)));
  if (rows * cols == 0) return Status::ok();
  const int w = comm.size(), r = comm.rank();
  const int64_t my0 = row0(rows, w, r), mine = row0(rows, w, r + 1) - my0;
  auto* st = static_cast<cudaStream_t>(stream);
  uint16_t* recv = nullptr;
  uint16_t* stage = nullptr;
  const size_t plane_bytes = static_cast<size_t>(mine * cols) * 2;
  K3_RETURN_IF_ERROR(from_cuda(cudaMallocAsync(reinterpret_cast<void**>(&recv), plane_bytes * w + 2, st), "cudaMallocAsync"));
  Status s = from_cuda(cudaMallocAsync(reinterpret_cast<void**>(&stage), plane_bytes * 2 + 2, st), "cudaMallocAsync");
  if (s.is_ok()) {
    // Phase 1: rows of shard q to rank q; plane q of recv from rank q.
    std::vector<int64_t> sb(static_cast<size_t>(w)), rb(static_cast<size_t>(w), static_cast<int64_t>(plane_bytes));
    for (int q = 0; q < w; ++q) sb[static_cast<size_t>(q)] = (row0(rows, w, q + 1) - row0(rows, w, q)) * cols * 2;
    set(s, comm.alltoallv(x, sb, recv, rb, stream));
  }
  uint16_t* out_stage = stage;
  uint16_t* res_stage = stage + mine * cols;
  if (s.is_ok() && mine > 0) {
    set(s, from_cuda(detail::launch_allreduce_rows(recv, w, mine, cols,
                                                   residual != nullptr ? residual + my0 * cols : nullptr, norm, gamma,
                                                   eps, out_stage, res_stage, st),
                     "all-reduce kernels"));
  }
  // Phase 2: every rank gets every shard (out, then residual_out). Counts: mine to each peer.
  if (s.is_ok()) {
    std::vector<int64_t> rb(static_cast<size_t>(w));
    for (int q = 0; q < w; ++q) rb[static_cast<size_t>(q)] = (row0(rows, w, q + 1) - row0(rows, w, q)) * cols * 2;
    // The same staged rows go to every peer: W rounds of one send + one receive each (shifted
    // pairs, so every round matches), receiving straight into the destination shard.
    for (int q = 0; q < w && s.is_ok(); ++q) {
      std::vector<int64_t> one_s(static_cast<size_t>(w), 0), one_r(static_cast<size_t>(w), 0);
      // Round q: rank r sends its shard to rank (r + q) % w and receives from (r - q) % w.
      const int to = (r + q) % w, from = (r - q + w) % w;
      one_s[static_cast<size_t>(to)] = mine * cols * 2;
      one_r[static_cast<size_t>(from)] = rb[static_cast<size_t>(from)];
      // Receive buffer offset: alltoallv places `from`'s bytes at sum(one_r[..from]) = 0, so
      // pass the destination already offset to shard `from`.
      set(s, comm.alltoallv(out_stage, one_s, out + row0(rows, w, from) * cols, one_r, stream));
      if (s.is_ok() && norm) set(s, comm.alltoallv(res_stage, one_s, residual_out + row0(rows, w, from) * cols, one_r, stream));
    }
  }
  cudaFreeAsync(recv, st);
  if (stage != nullptr) cudaFreeAsync(stage, st);
  return s;
}

}  // namespace

Status nccl_available() {
  // The device first: on a machine without one, NCCL (a 200 MB library) is not even opened.
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();
    return unavailable(std::string("no CUDA device for the NCCL transport (") +
                       (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices") + ")");
  }
  auto api = load_nccl();
  return api.is_ok() ? Status::ok() : api.status();
}

Result<std::unique_ptr<DeviceCommunicator>> make_nccl_communicator(Communicator& host, const NcclOptions& options) {
  Status local = nccl_available();
  if (local.is_ok() && (!(options.timeout_s > 0) || options.timeout_s > 86400)) {
    set(local, invalid_argument("NcclOptions.timeout_s = " + std::to_string(options.timeout_s) + " must be in (0, 86400]"));
  }
  int device = options.device;
  if (local.is_ok()) {
    if (device < 0) set(local, from_cuda(cudaGetDevice(&device), "cudaGetDevice"));
    else set(local, from_cuda(cudaSetDevice(device), "cudaSetDevice"));
  }
  K3_RETURN_IF_ERROR(agree_on_status(host, local));
  const NcclApi api = load_nccl().value();
  ncclUniqueId id{};
  Status idst = host.rank() == 0 ? from_nccl(api, api.get_unique_id(&id), "ncclGetUniqueId", 0) : Status::ok();
  K3_RETURN_IF_ERROR(agree_on_status(host, idst));
  std::vector<ncclUniqueId> all(static_cast<size_t>(host.size()));
  K3_RETURN_IF_ERROR(host.allgather(&id, sizeof id, all.data()));
  ncclComm_t c = nullptr;
  const Status init = from_nccl(api, api.comm_init_rank(&c, host.size(), all[0], host.rank()), "ncclCommInitRank",
                                host.rank());
  K3_RETURN_IF_ERROR(agree_on_status(host, init));
  return std::unique_ptr<DeviceCommunicator>(std::make_unique<NcclCommunicator>(api, c, host, device, options.timeout_s));
}

Status allreduce_bf16_device(DeviceCommunicator& comm, const uint16_t* x, int64_t rows, int64_t cols, uint16_t* out,
                             void* stream) {
  return device_allreduce(comm, x, nullptr, nullptr, rows, cols, 1.0f, out, nullptr, false, stream);
}

Status allreduce_add_rmsnorm_bf16_device(DeviceCommunicator& comm, const uint16_t* x, const uint16_t* residual,
                                         const uint16_t* gamma, int64_t rows, int64_t cols, float eps, uint16_t* out,
                                         uint16_t* residual_out, void* stream) {
  return device_allreduce(comm, x, residual, gamma, rows, cols, eps, out, residual_out, true, stream);
}

}  // namespace k3::comm
