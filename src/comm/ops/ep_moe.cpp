// Expert-parallel dispatch / combine over a Communicator (k3/ep.hpp).
//
// Wire format. Dispatch: per (token, destination) one record = int32 ids[top_k] (the slot ids
// the destination owns, -1 elsewhere) followed by the BF16 row x[K]; records to one destination
// in token order. Combine: per received record, the FP32 y rows of its local slots in slot order.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "k3/cpu_moe.hpp"
#include "k3/ep.hpp"

namespace k3::comm {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string num(int64_t v) { return std::to_string(v); }

// Grow-only resize (+1 so that data() is never null for empty transfers).
template <typename T>
void grow(std::vector<T>& v, size_t n) {
  if (v.size() < n + 1) v.resize(n + 1);
}

Status check_dispatch_args(const Communicator& comm, const MoeShape& shape, const MoeInputsView& local) {
  K3_RETURN_IF_ERROR(validate_moe_shape(shape));
  if (shape.ep_size != comm.size() || shape.ep_rank != comm.rank()) {
    return invalid_argument("shape.ep_size = " + num(shape.ep_size) + ", ep_rank = " + num(shape.ep_rank) +
                            " must be the communicator's size " + num(comm.size()) + " and rank " + num(comm.rank()));
  }
  if (local.m < 0 || local.m > (int64_t{1} << 24)) {
    return invalid_argument("local.m = " + num(local.m) + " must be in [0, 2^24]");
  }
  if (local.x.size() != static_cast<size_t>(local.m * shape.hidden)) {
    return invalid_argument("local.x has " + num(static_cast<int64_t>(local.x.size())) + " elements, expected M*K = " +
                            num(local.m * shape.hidden));
  }
  if (local.topk_ids.size() != static_cast<size_t>(local.m * shape.top_k)) {
    return invalid_argument("local.topk_ids has " + num(static_cast<int64_t>(local.topk_ids.size())) +
                            " entries, expected M*top_k = " + num(local.m * shape.top_k));
  }
  for (size_t i = 0; i < local.topk_ids.size(); ++i) {
    const int32_t id = local.topk_ids[i];
    if (id < -1 || id >= shape.num_experts) {
      return invalid_argument("local.topk_ids[" + num(static_cast<int64_t>(i) / shape.top_k) + ", " +
                              num(static_cast<int64_t>(i) % shape.top_k) + "] = " + num(id) +
                              " must be -1 (masked) or a global expert id in [0, " + num(shape.num_experts) + ")");
    }
  }
  return Status::ok();
}

// The host plan of the contract's quantizer and finalize (threads only; no weights).
Result<cpu::MoePlan> host_plan(const MoeProblem& problem, int threads) {
  cpu::MoeOptions o;
  o.threads = threads;
  o.max_tokens = 1;
  return cpu::plan(problem, o);
}

}  // namespace

Status agree_on_partition(Communicator& comm, const MoeShape& shape, Recipe recipe) {
  constexpr int kFields = 7;
  static const char* const kNames[kFields] = {"hidden", "intermediate", "num_experts", "top_k", "ep_size", "ep_rank", "recipe"};
  const int64_t mine[kFields] = {shape.hidden, shape.intermediate, shape.num_experts, shape.top_k,
                                 shape.ep_size, shape.ep_rank, static_cast<int64_t>(recipe)};
  const int w = comm.size();
  std::vector<int64_t> all(static_cast<size_t>(w) * kFields);
  K3_RETURN_IF_ERROR(comm.allgather(mine, sizeof mine, all.data()));
  // Every rank sees the same table, so every rank reaches the same verdict without another message.
  auto field = [&](int q, int f) { return all[static_cast<size_t>(q) * kFields + static_cast<size_t>(f)]; };
  auto show = [&](int f, int64_t v) {
    return f == 6 ? std::string(recipe_name(static_cast<Recipe>(v))) : num(v);
  };
  for (int q = 0; q < w; ++q) {
    if (field(q, 4) != w || field(q, 5) != q) {
      return invalid_argument("rank " + num(q) + " of " + num(w) + ": shape.ep_size = " + num(field(q, 4)) +
                              ", ep_rank = " + num(field(q, 5)) + " must be the communicator's size " + num(w) +
                              " and rank " + num(q) + " (ranks disagree on the expert partition)");
    }
    for (int f = 0; f < kFields; ++f) {
      if (f == 5 || field(q, f) == field(0, f)) continue;
      return invalid_argument("rank " + num(q) + " of " + num(w) + ": " + kNames[f] + " = " + show(f, field(q, f)) +
                              " differs from rank 0's " + show(f, field(0, f)) +
                              " (ranks disagree on the layer or its expert partition)");
    }
  }
  return Status::ok();
}

std::string EpDispatch::to_string() const {
  std::string s = "rows " + num(rows) + " from [";
  for (size_t q = 0; q < rows_from.size(); ++q) {
    if (q > 0) s += ' ';
    s += num(rows_from[q]);
  }
  int64_t slots = 0;
  for (const int64_t v : slots_from) slots += v;
  s += "], slots " + num(slots) + ", sent " + num(static_cast<int64_t>(route.sent_tokens.size())) + " rows " +
       num((bytes_sent + 999) / 1000) + " KB";
  return s;
}

Result<EpDispatch> ep_dispatch(Communicator& comm, const MoeProblem& problem, const MoeInputsView& local,
                               const EpOptions& options, EpBuffers* buffers) {
  EpBuffers own;
  EpBuffers& b = buffers != nullptr ? *buffers : own;
  const MoeShape& shape = problem.shape;
  Result<cpu::MoePlan> plan = host_plan(problem, options.threads);
  Status args = check_dispatch_args(comm, shape, local);
  if (args.is_ok() && !plan.is_ok()) args = plan.status();
  // Which tokens go where with the ids each destination owns, and where each slot's y comes back.
  Result<EpRoute> route = args.is_ok() ? ep_route(shape, local.m, local.topk_ids) : Result<EpRoute>(args);
  if (args.is_ok() && !route.is_ok()) args = route.status();
  K3_RETURN_IF_ERROR(agree_on_status(comm, args));
  K3_RETURN_IF_ERROR(agree_on_partition(comm, shape, problem.recipe));
  const int w = comm.size();
  const int64_t k = shape.hidden, topk = shape.top_k, e_local = shape.local_experts();
  const size_t W = static_cast<size_t>(w);
  EpDispatch d;
  d.shape = shape;
  d.source_tokens = local.m;
  d.route = std::move(route.value());
  const EpRoute& sent = d.route;
  d.mxfp8 = options.mxfp8_wire && problem.recipe == Recipe::kW4A8;
  // W4A8: each token's row quantized once here (the experts' own quantizer), sent as codes + scales.
  std::vector<uint8_t>& codes = b.codes;
  std::vector<uint8_t>& scales = b.scales;
  if (d.mxfp8) {
    grow(codes, local.x.size());
    grow(scales, local.x.size() / 32);
    K3_RETURN_IF_ERROR(cpu::quantize_x_mxfp8(plan.value(), local.x, std::span<uint8_t>(codes.data(), local.x.size()),
                                             std::span<uint8_t>(scales.data(), local.x.size() / 32)));
  }
  const int64_t row_bytes = d.mxfp8 ? k + k / 32 : 2 * k;

  const int64_t record = 4 * topk + row_bytes;
  std::vector<int64_t> send_bytes(W), recv_bytes(W);
  for (size_t q = 0; q < W; ++q) send_bytes[q] = (sent.sent_offsets[q + 1] - sent.sent_offsets[q]) * record;
  const size_t send_total = static_cast<size_t>(sent.sent_offsets[W] * record);
  grow(b.send, send_total);
  uint8_t* p = b.send.data();
  for (int64_t i = 0; i < sent.sent_offsets[W]; ++i, p += record) {
    const int64_t t = sent.sent_tokens[static_cast<size_t>(i)];
    std::memcpy(p, sent.sent_ids.data() + i * topk, static_cast<size_t>(4 * topk));
    if (d.mxfp8) {
      std::memcpy(p + 4 * topk, codes.data() + t * k, static_cast<size_t>(k));
      std::memcpy(p + 4 * topk + k, scales.data() + t * (k / 32), static_cast<size_t>(k / 32));
    } else {
      std::memcpy(p + 4 * topk, local.x.data() + t * k, static_cast<size_t>(2 * k));
    }
  }
  K3_RETURN_IF_ERROR(comm.alltoall_counts(send_bytes, recv_bytes));
  int64_t total = 0;
  d.rows_from.resize(W);
  for (size_t q = 0; q < W; ++q) {
    if (recv_bytes[q] < 0 || recv_bytes[q] % record != 0) {
      return Status(StatusCode::kInternal, "ep_dispatch: rank " + num(static_cast<int64_t>(q)) + " announced " +
                                               num(recv_bytes[q]) + " bytes, not a multiple of the record size " +
                                               num(record) + " (ranks disagree on the shape?)");
    }
    d.rows_from[q] = recv_bytes[q] / record;
    total += recv_bytes[q];
  }
  grow(b.recv, static_cast<size_t>(total));
  K3_RETURN_IF_ERROR(comm.alltoallv(b.send.data(), send_bytes, b.recv.data(), recv_bytes));
  d.bytes_sent = static_cast<int64_t>(send_total);
  d.bytes_received = total;

  d.rows = total / record;
  if (d.mxfp8) {
    d.x_codes.resize(static_cast<size_t>(d.rows * k));
    d.x_scales.resize(static_cast<size_t>(d.rows * (k / 32)));
  } else {
    d.x.resize(static_cast<size_t>(d.rows * k));
  }
  d.topk_ids.resize(static_cast<size_t>(d.rows * topk));
  d.slots_from.assign(W, 0);
  const int64_t lo = shape.first_local_expert(), hi = lo + e_local;
  int64_t row = 0;
  for (size_t q = 0; q < W; ++q) {
    for (int64_t i = 0; i < d.rows_from[q]; ++i, ++row) {
      const uint8_t* r = b.recv.data() + row * record;
      int32_t* ids = d.topk_ids.data() + row * topk;
      std::memcpy(ids, r, static_cast<size_t>(4 * topk));
      for (int64_t s = 0; s < topk; ++s) {
        if (ids[s] == -1) continue;
        if (ids[s] < lo || ids[s] >= hi) {
          return Status(StatusCode::kInternal, "ep_dispatch: rank " + num(static_cast<int64_t>(q)) + " sent expert id " +
                                                   num(ids[s]) + ", which rank " + num(shape.ep_rank) + " does not hold");
        }
        ++d.slots_from[q];
      }
      if (d.mxfp8) {
        std::memcpy(d.x_codes.data() + row * k, r + 4 * topk, static_cast<size_t>(k));
        std::memcpy(d.x_scales.data() + row * (k / 32), r + 4 * topk + k, static_cast<size_t>(k / 32));
      } else {
        std::memcpy(d.x.data() + row * k, r + 4 * topk, static_cast<size_t>(2 * k));
      }
    }
  }
  return d;
}

Status ep_combine(Communicator& comm, const EpDispatch& d, const MoeProblem& problem, std::span<const float> y,
                  std::span<const float> topk_weights, std::span<uint8_t> out, EpBuffers* buffers,
                  const EpOptions& options) {
  EpBuffers own;
  EpBuffers& b = buffers != nullptr ? *buffers : own;
  const MoeShape& shape = d.shape;
  const int64_t k = shape.hidden, topk = shape.top_k;
  const size_t W = static_cast<size_t>(comm.size());
  int64_t slots = 0;
  for (const int64_t v : d.slots_from) slots += v;
  Status local = Status::ok();
  const MoeShape& ps = problem.shape;
  Result<cpu::MoePlan> plan = host_plan(problem, options.threads);
  if (!plan.is_ok()) {
    local = plan.status();
  } else if (d.rows_from.size() != W || d.route.sent_offsets.size() != W + 1) {
    local = invalid_argument("ep_combine: the dispatch was made on a communicator of " + num(static_cast<int64_t>(d.rows_from.size())) +
                             " ranks, this one has " + num(static_cast<int64_t>(W)));
  } else if (ps.hidden != k || ps.top_k != topk || ps.num_experts != shape.num_experts) {
    local = invalid_argument("ep_combine: problem shape (K " + num(ps.hidden) + ", top_k " + num(ps.top_k) + ", E " +
                             num(ps.num_experts) + ") differs from the dispatch's (K " + num(k) + ", top_k " + num(topk) +
                             ", E " + num(shape.num_experts) + ")");
  } else if (y.size() != static_cast<size_t>(slots * k)) {
    local = invalid_argument("ep_combine: y has " + num(static_cast<int64_t>(y.size())) + " floats, expected local slots * K = " +
                             num(slots) + " * " + num(k));
  } else if (topk_weights.size() != static_cast<size_t>(d.source_tokens * topk)) {
    local = invalid_argument("ep_combine: topk_weights has " + num(static_cast<int64_t>(topk_weights.size())) +
                             " entries, expected M*top_k = " + num(d.source_tokens * topk));
  } else if (out.size() != static_cast<size_t>(d.source_tokens * k * out_dtype_size(problem.out_dtype))) {
    local = invalid_argument("ep_combine: out has " + num(static_cast<int64_t>(out.size())) + " bytes, expected M*K*" +
                             num(out_dtype_size(problem.out_dtype)) + " = " +
                             num(d.source_tokens * k * out_dtype_size(problem.out_dtype)));
  }
  K3_RETURN_IF_ERROR(agree_on_status(comm, local));

  // Send each source its slots' y rows (contiguous per source: rows are grouped by source).
  std::vector<int64_t> send_bytes(W), recv_bytes(W);
  for (size_t q = 0; q < W; ++q) send_bytes[q] = d.slots_from[q] * k * 4;
  K3_RETURN_IF_ERROR(comm.alltoall_counts(send_bytes, recv_bytes));
  // What this rank expects back from q: the slots q computes for it.
  for (size_t q = 0; q < W; ++q) {
    if (recv_bytes[q] != d.route.slots_to[q] * k * 4) {
      return Status(StatusCode::kInternal, "ep_combine: rank " + num(static_cast<int64_t>(q)) + " returns " +
                                               num(recv_bytes[q]) + " bytes, expected " + num(d.route.slots_to[q] * k * 4));
    }
  }
  int64_t total = 0;
  for (const int64_t n : recv_bytes) total += n;
  grow(b.back, static_cast<size_t>(total / 4));
  K3_RETURN_IF_ERROR(comm.alltoallv(y.data(), send_bytes, b.back.data(), recv_bytes));

  // Each slot's y row, then the finalize of the single-process run.
  std::vector<const float*> slot_y(static_cast<size_t>(d.source_tokens * topk), nullptr);
  for (size_t i = 0; i < slot_y.size(); ++i) {
    const int32_t row = d.route.slot_row[i];
    if (row >= 0) slot_y[i] = b.back.data() + static_cast<int64_t>(row) * k;
  }
  std::vector<float> scratch(static_cast<size_t>(k));
  return cpu::finalize(plan.value(), d.source_tokens, topk_weights, slot_y, scratch, out);
}

Status ep_moe_run(Communicator& comm, const PreparedMoe& layer, const MoeInputsView& local,
                  std::span<uint8_t> workspace, std::span<uint8_t> out, EpRunStats* stats, const EpOptions& options,
                  EpBuffers* buffers) {
  EpBuffers own;
  EpBuffers& b = buffers != nullptr ? *buffers : own;
  const MoeProblem& problem = layer.problem();
  // Every rank learns that a backend has no seam before any data moves.
  K3_RETURN_IF_ERROR(agree_on_status(comm, layer.expert_parallel()));
  const auto t0 = Clock::now();
  K3_ASSIGN_OR_RETURN(EpDispatch d, ep_dispatch(comm, problem, local, options, &b));
  const auto t1 = Clock::now();
  const int64_t k = problem.shape.hidden, topk = problem.shape.top_k, max_rows = layer.max_tokens();
  int64_t slots = 0;
  for (const int64_t v : d.slots_from) slots += v;
  grow(b.y, static_cast<size_t>(slots * k));
  const std::span<float> y(b.y.data(), static_cast<size_t>(slots * k));
  Status local_st = Status::ok();
  int64_t done_slots = 0;
  for (int64_t r0 = 0; r0 < d.rows && local_st.is_ok(); r0 += max_rows) {
    const int64_t n = std::min(max_rows, d.rows - r0);
    const std::span<const int32_t> ids(d.topk_ids.data() + r0 * topk, static_cast<size_t>(n * topk));
    const int64_t piece = cpu::local_slot_count(problem.shape, ids);
    const std::span<float> y_piece(y.data() + done_slots * k, static_cast<size_t>(piece * k));
    if (d.mxfp8) {
      const MoeInputsView in{n, {}, ids, {}};
      const Mxfp8Rows xq{std::span<const uint8_t>(d.x_codes.data() + r0 * k, static_cast<size_t>(n * k)),
                         std::span<const uint8_t>(d.x_scales.data() + r0 * (k / 32), static_cast<size_t>(n * k / 32))};
      local_st = layer.run_experts(in, workspace, y_piece, xq);
    } else {
      const MoeInputsView in{n, std::span<const uint16_t>(d.x.data() + r0 * k, static_cast<size_t>(n * k)), ids, {}};
      local_st = layer.run_experts(in, workspace, y_piece);
    }
    done_slots += piece;
  }
  // A failure on one rank (e.g. kInexact data) must not leave the others waiting in combine.
  K3_RETURN_IF_ERROR(agree_on_status(comm, local_st));
  const auto t2 = Clock::now();
  K3_RETURN_IF_ERROR(ep_combine(comm, d, problem, y, local.topk_weights, out, &b, options));
  if (stats != nullptr) {
    stats->rows_received = d.rows;
    stats->slots_computed = slots;
    stats->dispatch_bytes_sent = d.bytes_sent;
    stats->combine_bytes_sent = slots * k * 4;
    stats->dispatch_s = std::chrono::duration<double>(t1 - t0).count();
    stats->experts_s = std::chrono::duration<double>(t2 - t1).count();
    stats->combine_s = seconds_since(t2);
  }
  return Status::ok();
}

}  // namespace k3::comm
