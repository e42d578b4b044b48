// Expert-parallel dispatch / experts / combine on GPU buffers over NCCL (k3/cuda_ep.hpp).
//
// Ran at world size 1 on an H200 (2026-12-04: tests/cuda/test_cuda_ep.cpp passes); never run across
// GPUs. The host bookkeeping it uses (k3/ep_route.hpp) is unit-tested, its argument checks are
// tested without a device.
//
// Transfers: counts and the per-row slot ids over the host communicator (small: 4 * top_k bytes
// per row), the BF16 rows and the FP32 y rows over NCCL (grouped send / recv, stream-ordered).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/common.cuh"
#include "k3/cuda_ep.hpp"

namespace k3::comm {
namespace {

std::string num(int64_t v) { return std::to_string(v); }
void set(Status& dst, Status v) { static_cast<void>(dst = std::move(v)); }

constexpr int kGatherBadRow = 1 << 8;  // error bit of the gather: a slot without a y row (a bug)

// dst[i, :] = src[row, :] with row = map ? map[idx[i]] : idx[i]; rows of `words` 32-bit words.
// A negative row (never expected) writes nothing and sets kGatherBadRow in *err.
__global__ void gather_rows_kernel(const uint32_t* __restrict__ src, int64_t words, const int32_t* __restrict__ idx,
                                   const int32_t* __restrict__ map, int64_t n, uint32_t* __restrict__ dst,
                                   int* __restrict__ err) {
  for (int64_t i = blockIdx.y; i < n; i += gridDim.y) {
    int32_t row = idx[i];
    if (map != nullptr && row >= 0) row = map[row];
    if (row < 0) {
      if (threadIdx.x == 0 && blockIdx.x == 0 && err != nullptr) atomicOr(err, kGatherBadRow);
      continue;
    }
    const uint32_t* s = src + static_cast<int64_t>(row) * words;
    uint32_t* d = dst + i * words;
    for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < words;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      d[c] = s[c];
    }
  }
}

Status gather_rows(const void* src, int64_t row_bytes, const int32_t* idx, const int32_t* map, int64_t n, void* dst,
                   int* err, cudaStream_t s) {
  if (n == 0) return Status::ok();
  const int64_t words = row_bytes / 4;
  const unsigned threads = 256;
  const auto gx = static_cast<unsigned>(std::min<int64_t>((words + threads - 1) / threads, 64));
  const auto gy = static_cast<unsigned>(std::min<int64_t>(n, 65535));
  gather_rows_kernel<<<dim3(gx, gy, 1), threads, 0, s>>>(static_cast<const uint32_t*>(src), words, idx, map, n,
                                                        static_cast<uint32_t*>(dst), err);
  return cuda::detail::from_cuda(cudaGetLastError(), "ep gather_rows launch");
}

// A grow-only device allocation (at least 256 bytes, so that pointers are never null).
struct Grow {
  void* p = nullptr;
  size_t bytes = 0;
  Grow() = default;
  Grow(const Grow&) = delete;
  Grow& operator=(const Grow&) = delete;
  ~Grow() {
    if (p != nullptr) cudaFree(p);
  }
  Status reserve(size_t n, const char* what) {
    n = std::max<size_t>(n, 256);
    if (n <= bytes) return Status::ok();
    if (p != nullptr) {
      // Earlier enqueued work may still read the old buffer.
      K3_CUDA_TRY(cudaDeviceSynchronize(), "ep buffers: synchronize before growing");
      cudaFree(p);
      p = nullptr;
      bytes = 0;
    }
    K3_CUDA_TRY(cudaMalloc(&p, n), what);
    bytes = n;
    return Status::ok();
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

template <typename T>
Status upload_async(Grow& g, const std::vector<T>& v, const char* what, cudaStream_t s) {
  K3_RETURN_IF_ERROR(g.reserve(v.size() * sizeof(T), what));
  if (v.empty()) return Status::ok();
  // Pageable source: cudaMemcpyAsync returns once the bytes are staged, so `v` may go away after.
  K3_CUDA_TRY(cudaMemcpyAsync(g.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, s), what);
  return Status::ok();
}

}  // namespace

struct DeviceEpBuffers::Impl {
  Grow ids_down;   // dispatch: the source's top-k ids (device copy of the caller's, not used)
  Grow tokens;     // dispatch: sent_tokens
  Grow send_x, recv_x, recv_ids;
  Grow piece_m, piece_slot, status;  // experts
  Grow y;          // experts: gathered y rows (the combine's send buffer)
  Grow back, slot_row;               // combine: received y rows, [M * top_k] map then M
};

DeviceEpBuffers::DeviceEpBuffers() : impl_(std::make_unique<Impl>()) {}
DeviceEpBuffers::~DeviceEpBuffers() = default;
DeviceEpBuffers::DeviceEpBuffers(DeviceEpBuffers&&) noexcept = default;
DeviceEpBuffers& DeviceEpBuffers::operator=(DeviceEpBuffers&&) noexcept = default;

Result<DeviceEpDispatch> ep_dispatch_device(DeviceCommunicator& comm, const cuda::MoePlan& plan, int64_t m,
                                            const uint16_t* x, const int32_t* topk_ids, DeviceEpBuffers& buffers,
                                            void* stream) {
  const MoeShape& shape = plan.problem.shape;
  Status local = validate_moe_shape(shape);
  if (local.is_ok() && (shape.ep_size != comm.size() || shape.ep_rank != comm.rank())) {
    set(local, invalid_argument("ep_dispatch_device: plan shape ep_size = " + num(shape.ep_size) + ", ep_rank = " +
                                num(shape.ep_rank) + " must be the communicator's size " + num(comm.size()) +
                                " and rank " + num(comm.rank())));
  } else if (local.is_ok() && (m < 0 || m > (int64_t{1} << 24))) {
    set(local, invalid_argument("ep_dispatch_device: m = " + num(m) + " must be in [0, 2^24]"));
  } else if (local.is_ok() && m > 0 && (x == nullptr || topk_ids == nullptr)) {
    set(local, invalid_argument("ep_dispatch_device: x and topk_ids must be device pointers (null given) for m = " +
                                num(m)));
  } else if (local.is_ok() && buffers.impl() == nullptr) {
    set(local, invalid_argument("ep_dispatch_device: buffers were moved from"));
  }
  K3_RETURN_IF_ERROR(agree_on_status(comm.host(), local));
  K3_RETURN_IF_ERROR(check_same_on_all_ranks(comm.host(), "ep_dispatch_device K x N x E x top_k",
                                             num(shape.hidden) + " x " + num(shape.intermediate) + " x " +
                                                 num(shape.num_experts) + " x " + num(shape.top_k)));
  auto& b = *buffers.impl();
  auto* st = static_cast<cudaStream_t>(stream);
  const int64_t k = shape.hidden, topk = shape.top_k;
  const size_t W = static_cast<size_t>(comm.size());

  // The ids to the host (sync point 1), then the routing on the host.
  std::vector<int32_t> ids(static_cast<size_t>(m * topk));
  if (m > 0) {
    set(local, cuda::detail::from_cuda(cudaMemcpyAsync(ids.data(), topk_ids, ids.size() * 4, cudaMemcpyDeviceToHost, st),
                                 "ep_dispatch_device: copy topk_ids"));
    if (local.is_ok()) set(local, comm.synchronize(stream));
  }
  Result<EpRoute> route = local.is_ok() ? ep_route(shape, m, ids) : Result<EpRoute>(local);
  K3_RETURN_IF_ERROR(agree_on_status(comm.host(), route.status()));
  DeviceEpDispatch d;
  d.shape = shape;
  d.source_tokens = m;
  d.route = std::move(route).value();

  // Counts (rows per destination), then the rows' slot ids, over the host communicator.
  std::vector<int64_t> send_rows(W), recv_rows(W), send_id_bytes(W), recv_id_bytes(W);
  for (size_t q = 0; q < W; ++q) {
    send_rows[q] = d.route.sent_offsets[q + 1] - d.route.sent_offsets[q];
    send_id_bytes[q] = send_rows[q] * topk * 4;
  }
  K3_RETURN_IF_ERROR(comm.host().alltoall_counts(send_rows, recv_rows));
  int64_t rows = 0;
  for (size_t q = 0; q < W; ++q) {
    if (recv_rows[q] < 0) {
      return Status(StatusCode::kInternal, "ep_dispatch_device: rank " + num(static_cast<int64_t>(q)) + " announced " +
                                               num(recv_rows[q]) + " rows");
    }
    recv_id_bytes[q] = recv_rows[q] * topk * 4;
    rows += recv_rows[q];
  }
  d.rows = rows;
  d.rows_from = recv_rows;
  d.topk_ids_host.assign(static_cast<size_t>(rows * topk) + 1, -1);  // +1: data() is never null
  std::vector<int32_t> sent_ids(d.route.sent_ids);
  sent_ids.push_back(-1);  // data() is never null
  K3_RETURN_IF_ERROR(comm.host().alltoallv(sent_ids.data(), send_id_bytes, d.topk_ids_host.data(), recv_id_bytes));
  d.topk_ids_host.pop_back();
  auto slots = ep_expert_slots(shape, d.rows_from, d.topk_ids_host, plan.max_tokens);
  K3_RETURN_IF_ERROR(agree_on_status(comm.host(), slots.status()));
  d.slots = std::move(slots).value();

  // The rows: gather this rank's sent tokens, then NCCL all-to-all-v.
  const int64_t row_bytes = 2 * k;
  const int64_t sent = d.route.sent_offsets[W];
  set(local, upload_async(b.tokens, d.route.sent_tokens, "ep_dispatch_device: upload sent tokens", st));
  if (local.is_ok()) set(local, b.send_x.reserve(static_cast<size_t>(sent * row_bytes), "ep_dispatch_device: send buffer"));
  if (local.is_ok()) set(local, b.recv_x.reserve(static_cast<size_t>(rows * row_bytes), "ep_dispatch_device: receive buffer"));
  if (local.is_ok()) set(local, upload_async(b.recv_ids, d.topk_ids_host, "ep_dispatch_device: upload ids", st));
  if (local.is_ok()) set(local, gather_rows(x, row_bytes, b.tokens.as<int32_t>(), nullptr, sent, b.send_x.p, nullptr, st));
  K3_RETURN_IF_ERROR(agree_on_status(comm.host(), local));
  std::vector<int64_t> sb(W), rb(W);
  for (size_t q = 0; q < W; ++q) {
    sb[q] = send_rows[q] * row_bytes;
    rb[q] = recv_rows[q] * row_bytes;
  }
  K3_RETURN_IF_ERROR(comm.alltoallv(b.send_x.p, sb, b.recv_x.p, rb, stream));
  d.x = b.recv_x.as<uint16_t>();
  d.topk_ids = b.recv_ids.as<int32_t>();
  d.bytes_sent = sent * (row_bytes + 4 * topk);
  d.bytes_received = rows * (row_bytes + 4 * topk);
  return d;
}

Result<const float*> ep_experts_device(const cuda::MoePlan& plan, const cuda::DeviceWeights& w,
                                       const DeviceEpDispatch& d, void* workspace, DeviceEpBuffers& buffers,
                                       void* stream) {
  const MoeShape& ps = plan.problem.shape;
  if (buffers.impl() == nullptr) return invalid_argument("ep_experts_device: buffers were moved from");
  if (ps.hidden != d.shape.hidden || ps.top_k != d.shape.top_k || ps.num_experts != d.shape.num_experts ||
      ps.ep_size != d.shape.ep_size || ps.ep_rank != d.shape.ep_rank) {
    return invalid_argument("ep_experts_device: the plan's shape (K " + num(ps.hidden) + ", top_k " + num(ps.top_k) +
                            ", E " + num(ps.num_experts) + ", ep " + num(ps.ep_rank) + "/" + num(ps.ep_size) +
                            ") differs from the dispatch's (K " + num(d.shape.hidden) + ", top_k " +
                            num(d.shape.top_k) + ", E " + num(d.shape.num_experts) + ", ep " + num(d.shape.ep_rank) +
                            "/" + num(d.shape.ep_size) + ")");
  }
  const int64_t pieces = static_cast<int64_t>(d.slots.piece_slot_offsets.size()) - 1;
  if (pieces != (d.rows + plan.max_tokens - 1) / plan.max_tokens) {
    return invalid_argument("ep_experts_device: the dispatch was made for pieces of another max_tokens (" +
                            num(pieces) + " pieces for " + num(d.rows) + " rows, plan max_tokens " +
                            num(plan.max_tokens) + ")");
  }
  auto& b = *buffers.impl();
  auto* st = static_cast<cudaStream_t>(stream);
  const int64_t k = ps.hidden, topk = ps.top_k;
  const int64_t slots = d.slots.piece_slot_offsets.back();
  K3_RETURN_IF_ERROR(b.y.reserve(static_cast<size_t>(slots * k * 4), "ep_experts_device: y rows"));
  if (pieces == 0) return b.y.as<const float>();
  std::vector<int32_t> piece_m(static_cast<size_t>(pieces));
  for (int64_t p = 0; p < pieces; ++p) {
    piece_m[static_cast<size_t>(p)] = static_cast<int32_t>(std::min(plan.max_tokens, d.rows - p * plan.max_tokens));
  }
  K3_RETURN_IF_ERROR(upload_async(b.piece_m, piece_m, "ep_experts_device: upload piece sizes", st));
  K3_RETURN_IF_ERROR(upload_async(b.piece_slot, d.slots.piece_slot, "ep_experts_device: upload slot indices", st));
  K3_RETURN_IF_ERROR(b.status.reserve(static_cast<size_t>(pieces) * 4, "ep_experts_device: status"));
  K3_CUDA_TRY(cudaMemsetAsync(b.status.p, 0, static_cast<size_t>(pieces) * 4, st), "ep_experts_device: clear status");
  int* status = b.status.as<int>();
  for (int64_t p = 0; p < pieces; ++p) {
    const int64_t r0 = p * plan.max_tokens;
    const cuda::DeviceInputs in{b.piece_m.as<int32_t>() + p, d.x + r0 * k, d.topk_ids + r0 * topk, nullptr, nullptr};
    K3_ASSIGN_OR_RETURN(cuda::ExpertRows rows, cuda::run_experts(plan, w, in, workspace, stream));
    // The piece's error bits (run_experts clears them on its next call).
    K3_CUDA_TRY(cudaMemcpyAsync(status + p, static_cast<char*>(workspace) + plan.ws_status, 4, cudaMemcpyDeviceToDevice,
                                st),
                "ep_experts_device: copy status");
    const int64_t j0 = d.slots.piece_slot_offsets[static_cast<size_t>(p)];
    const int64_t n = d.slots.piece_slot_offsets[static_cast<size_t>(p) + 1] - j0;
    K3_RETURN_IF_ERROR(gather_rows(rows.y, k * 4, b.piece_slot.as<int32_t>() + j0, rows.slot_row, n,
                                   b.y.as<float>() + j0 * k, status + p, st));
  }
  // Sync point 2: the kernels' error bits.
  std::vector<int> bits(static_cast<size_t>(pieces));
  K3_CUDA_TRY(cudaMemcpyAsync(bits.data(), status, bits.size() * 4, cudaMemcpyDeviceToHost, st),
              "ep_experts_device: copy status");
  K3_CUDA_TRY(cudaStreamSynchronize(st), "ep_experts_device: experts");
  int any = 0;
  for (const int v : bits) any |= v;
  if (any & kGatherBadRow) {
    return Status(StatusCode::kInternal, "ep_experts_device: a local slot had no expert output row (slot -> row map)");
  }
  if (any != 0) {
    return Status(StatusCode::kInexact, "ep_experts_device: the W4A8 operands (x or the activation output) hold an "
                                        "MXFP8 block with values in or below BF16's subnormal range; the CUDA path "
                                        "would round them. Use --backend cpu");
  }
  return b.y.as<const float>();
}

Status ep_combine_device(DeviceCommunicator& comm, const DeviceEpDispatch& d, const cuda::MoePlan& plan,
                         const float* y, const float* topk_weights, void* out, DeviceEpBuffers& buffers,
                         void* stream) {
  const MoeShape& ps = plan.problem.shape;
  const size_t W = static_cast<size_t>(comm.size());
  const int64_t k = d.shape.hidden, topk = d.shape.top_k, m = d.source_tokens;
  Status local = Status::ok();
  int64_t slots = 0;
  for (const int64_t v : d.slots.slots_from) slots += v;
  if (d.rows_from.size() != W || d.slots.slots_from.size() != W || d.route.slots_to.size() != W) {
    set(local, invalid_argument("ep_combine_device: the dispatch was made on a communicator of " +
                                num(static_cast<int64_t>(d.rows_from.size())) + " ranks, this one has " +
                                num(static_cast<int64_t>(W))));
  } else if (ps.hidden != k || ps.top_k != topk || ps.num_experts != d.shape.num_experts) {
    set(local, invalid_argument("ep_combine_device: plan shape (K " + num(ps.hidden) + ", top_k " + num(ps.top_k) +
                                ", E " + num(ps.num_experts) + ") differs from the dispatch's (K " + num(k) +
                                ", top_k " + num(topk) + ", E " + num(d.shape.num_experts) + ")"));
  } else if (m > plan.max_tokens) {
    set(local, invalid_argument("ep_combine_device: this rank's tokens M = " + num(m) + " exceed plan.max_tokens = " +
                                num(plan.max_tokens) + " (the finalize covers at most max_tokens rows)"));
  } else if (slots > 0 && y == nullptr) {
    set(local, invalid_argument("ep_combine_device: y must be a device pointer (null given) for " + num(slots) +
                                " local slots"));
  } else if (m > 0 && (topk_weights == nullptr || out == nullptr)) {
    set(local, invalid_argument("ep_combine_device: topk_weights and out must be device pointers (null given) for M = " +
                                num(m)));
  } else if (buffers.impl() == nullptr) {
    set(local, invalid_argument("ep_combine_device: buffers were moved from"));
  }
  K3_RETURN_IF_ERROR(agree_on_status(comm.host(), local));
  auto& b = *buffers.impl();
  auto* st = static_cast<cudaStream_t>(stream);

  // Counts: y bytes to each source (contiguous per source: rows are grouped by source).
  std::vector<int64_t> send_bytes(W), recv_bytes(W);
  for (size_t q = 0; q < W; ++q) send_bytes[q] = d.slots.slots_from[q] * k * 4;
  K3_RETURN_IF_ERROR(comm.host().alltoall_counts(send_bytes, recv_bytes));
  int64_t back = 0;
  for (size_t q = 0; q < W && local.is_ok(); ++q) {
    if (recv_bytes[q] != d.route.slots_to[q] * k * 4) {
      set(local, Status(StatusCode::kInternal, "ep_combine_device: rank " + num(static_cast<int64_t>(q)) + " returns " +
                                                   num(recv_bytes[q]) + " bytes, expected " +
                                                   num(d.route.slots_to[q] * k * 4)));
    }
    back += d.route.slots_to[q];
  }
  if (local.is_ok()) set(local, b.back.reserve(static_cast<size_t>(back * k * 4), "ep_combine_device: receive buffer"));
  // The source's slot -> received row map, then M (the finalize's m_device).
  std::vector<int32_t> map(d.route.slot_row);
  map.push_back(static_cast<int32_t>(m));
  if (local.is_ok()) set(local, upload_async(b.slot_row, map, "ep_combine_device: upload slot map", st));
  K3_RETURN_IF_ERROR(agree_on_status(comm.host(), local));
  K3_RETURN_IF_ERROR(comm.alltoallv(y, send_bytes, b.back.p, recv_bytes, stream));
  if (m == 0) return Status::ok();
  const cuda::ExpertRows rows{b.back.as<const float>(), b.slot_row.as<const int32_t>()};
  return cuda::finalize(plan, b.slot_row.as<const int32_t>() + m * topk, rows, topk_weights, out, stream);
}

Status ep_moe_run_device(DeviceCommunicator& comm, const cuda::MoePlan& plan, const cuda::DeviceWeights& w,
                         int64_t m, const uint16_t* x, const int32_t* topk_ids, const float* topk_weights, void* out,
                         void* workspace, DeviceEpBuffers& buffers, void* stream) {
  K3_ASSIGN_OR_RETURN(DeviceEpDispatch d, ep_dispatch_device(comm, plan, m, x, topk_ids, buffers, stream));
  auto y = ep_experts_device(plan, w, d, workspace, buffers, stream);
  // A failure on one rank (e.g. kInexact data) must not leave the others waiting in combine.
  K3_RETURN_IF_ERROR(agree_on_status(comm.host(), y.status()));
  return ep_combine_device(comm, d, plan, y.value(), topk_weights, out, buffers, stream);
}

}  // namespace k3::comm
