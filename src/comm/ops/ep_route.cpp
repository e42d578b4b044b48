// Host bookkeeping of expert-parallel dispatch / combine (k3/ep_route.hpp).
#include "k3/ep_route.hpp"

#include <limits>
#include <string>

namespace k3::comm {
namespace {
std::string num(int64_t v) { return std::to_string(v); }
}  // namespace

Result<EpRoute> ep_route(const MoeShape& shape, int64_t m, std::span<const int32_t> topk_ids) {
  K3_RETURN_IF_ERROR(validate_moe_shape(shape));
  const int64_t topk = shape.top_k;
  const size_t W = static_cast<size_t>(shape.ep_size);
  if (m < 0 || m > (int64_t{1} << 24)) return invalid_argument("ep_route: m = " + num(m) + " must be in [0, 2^24]");
  if (static_cast<int64_t>(topk_ids.size()) != m * topk) {
    return invalid_argument("ep_route: topk_ids has " + num(static_cast<int64_t>(topk_ids.size())) +
                            " entries, expected M*top_k = " + num(m * topk));
  }
  for (size_t i = 0; i < topk_ids.size(); ++i) {
    const int32_t id = topk_ids[i];
    if (id < -1 || id >= shape.num_experts) {
      return invalid_argument("topk_ids[" + num(static_cast<int64_t>(i) / topk) + ", " +
                              num(static_cast<int64_t>(i) % topk) + "] = " + num(id) +
                              " must be -1 (masked) or a global expert id in [0, " + num(shape.num_experts) + ")");
    }
  }
  EpRoute r;
  // Tokens per destination, token order.
  std::vector<std::vector<int32_t>> to(W);
  std::vector<int64_t> last(W, -1);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t s = 0; s < topk; ++s) {
      const int32_t id = topk_ids[static_cast<size_t>(t * topk + s)];
      if (id < 0) continue;
      const size_t q = static_cast<size_t>(shape.owner_of(id));
      if (last[q] != t) {
        last[q] = t;
        to[q].push_back(static_cast<int32_t>(t));
      }
    }
  }
  r.sent_offsets.assign(W + 1, 0);
  r.slots_to.assign(W, 0);
  for (size_t q = 0; q < W; ++q) {
    r.sent_offsets[q + 1] = r.sent_offsets[q] + static_cast<int64_t>(to[q].size());
    r.sent_tokens.insert(r.sent_tokens.end(), to[q].begin(), to[q].end());
  }
  r.sent_ids.assign(static_cast<size_t>(r.sent_offsets[W] * topk), -1);
  r.slot_row.assign(static_cast<size_t>(m * topk), -1);
  int64_t back = 0;  // rows of the combine's receive buffer, rank order, then row, then slot
  for (size_t q = 0; q < W; ++q) {
    const ExpertRange held = expert_range(shape.num_experts, shape.ep_size, static_cast<int>(q));
    const int64_t lo = held.first, hi = lo + held.count;
    for (int64_t i = r.sent_offsets[q]; i < r.sent_offsets[q + 1]; ++i) {
      const int64_t t = r.sent_tokens[static_cast<size_t>(i)];
      for (int64_t s = 0; s < topk; ++s) {
        const int32_t id = topk_ids[static_cast<size_t>(t * topk + s)];
        if (id >= lo && id < hi) {
          r.sent_ids[static_cast<size_t>(i * topk + s)] = id;
          r.slot_row[static_cast<size_t>(t * topk + s)] = static_cast<int32_t>(back++);
          ++r.slots_to[q];
        }
      }
    }
  }
  if (back > std::numeric_limits<int32_t>::max()) {
    return invalid_argument("ep_route: " + num(back) + " slots exceed the int32 row index of the combine");
  }
  return r;
}

Result<EpExpertSlots> ep_expert_slots(const MoeShape& shape, std::span<const int64_t> rows_from,
                                      std::span<const int32_t> ids, int64_t piece_rows) {
  K3_RETURN_IF_ERROR(validate_moe_shape(shape));
  const int64_t topk = shape.top_k;
  const size_t W = static_cast<size_t>(shape.ep_size);
  if (rows_from.size() != W) {
    return invalid_argument("ep_expert_slots: rows_from has " + num(static_cast<int64_t>(rows_from.size())) +
                            " entries, expected ep_size = " + num(shape.ep_size));
  }
  if (piece_rows < 1) return invalid_argument("ep_expert_slots: piece_rows = " + num(piece_rows) + " must be >= 1");
  int64_t rows = 0;
  for (size_t q = 0; q < W; ++q) {
    if (rows_from[q] < 0) {
      return invalid_argument("ep_expert_slots: rows_from[" + num(static_cast<int64_t>(q)) + "] = " + num(rows_from[q]) +
                              " must be >= 0");
    }
    rows += rows_from[q];
  }
  if (static_cast<int64_t>(ids.size()) != rows * topk) {
    return invalid_argument("ep_expert_slots: ids has " + num(static_cast<int64_t>(ids.size())) +
                            " entries, expected rows*top_k = " + num(rows) + "*" + num(topk));
  }
  const int64_t lo = shape.first_local_expert(), hi = lo + shape.local_experts();
  EpExpertSlots e;
  e.slots_from.assign(W, 0);
  e.piece_slot_offsets.push_back(0);
  int64_t row = 0;
  for (size_t q = 0; q < W; ++q) {
    for (int64_t i = 0; i < rows_from[q]; ++i, ++row) {
      if (row > 0 && row % piece_rows == 0) e.piece_slot_offsets.push_back(static_cast<int64_t>(e.piece_slot.size()));
      for (int64_t s = 0; s < topk; ++s) {
        const int32_t id = ids[static_cast<size_t>(row * topk + s)];
        if (id == -1) continue;
        if (id < lo || id >= hi) {
          return Status(StatusCode::kInternal, "ep_expert_slots: rank " + num(static_cast<int64_t>(q)) + " sent row " +
                                                   num(i) + " with expert id " + num(id) + ", which rank " +
                                                   num(shape.ep_rank) + " does not hold ([" + num(lo) + ", " +
                                                   num(hi) + "); ranks disagree on the shape?)");
        }
        e.piece_slot.push_back(static_cast<int32_t>((row % piece_rows) * topk + s));
        ++e.slots_from[q];
      }
    }
  }
  if (rows > 0) e.piece_slot_offsets.push_back(static_cast<int64_t>(e.piece_slot.size()));
  return e;
}

}  // namespace k3::comm
