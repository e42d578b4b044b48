// k3/ep_route.hpp — the host bookkeeping of expert-parallel dispatch / combine: which token goes
// to which rank with which slot ids, which y rows come back in which order, and where each slot's
// y lands at the source. Pure host logic (no transport, no device), shared by the GPU path
// (k3/cuda_ep.hpp) and unit-tested on machines without a GPU.
//
// Order (the same as the CPU path, k3/ep.hpp): a source sends its tokens to destination q in
// token order, destinations in rank order; a destination groups the rows it receives by source
// rank, each source's rows in that source's token order; it returns, per source, the y rows of
// the local slots of those rows in (row, slot) order. The source therefore knows at dispatch time
// where every slot's y row will be in its combine receive buffer (EpRoute::slot_row).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "k3/moe.hpp"
#include "k3/status.hpp"

namespace k3::comm {

// The source side, from this rank's global top-k ids.
struct EpRoute {
  std::vector<int32_t> sent_tokens;   // tokens sent to q: sent_tokens[sent_offsets[q] .. [q + 1])
  std::vector<int64_t> sent_offsets;  // [W + 1]
  std::vector<int32_t> sent_ids;      // [sent rows, top_k]: the ids q owns, -1 elsewhere (per sent row)
  std::vector<int64_t> slots_to;      // [W] slots q computes for this rank (the y rows q returns)
  // [M, top_k] row of the combine's receive buffer (all sources' y rows, rank order) holding the y
  // of slot (t, s); -1 for a masked slot. Every non-masked slot has exactly one row.
  std::vector<int32_t> slot_row;
};

// shape: this rank's (shape.ep_size = W). topk_ids: [m, top_k] global ids, -1 masked. Errors name
// the first id outside [-1, num_experts) and a size mismatch.
Result<EpRoute> ep_route(const MoeShape& shape, int64_t m, std::span<const int32_t> topk_ids);

// The destination side, from the ids received ([rows, top_k], grouped by source as above) and the
// rows each source sent (rows_from, [W]).
struct EpExpertSlots {
  std::vector<int64_t> slots_from;  // [W] local slots among each source's rows (y rows returned to it)
  // The experts run on pieces of at most `piece_rows` rows (the CUDA plan's max_tokens): piece p
  // covers rows [p * piece_rows, ...) and owns the local slots [piece_slot_offsets[p], [p + 1]).
  std::vector<int64_t> piece_slot_offsets;  // [pieces + 1]
  // For every local slot in (row, slot) order: its (token, slot) index within its piece,
  // (row - first row of the piece) * top_k + s (the index into run_experts' slot -> row map).
  std::vector<int32_t> piece_slot;
};

// shape: this rank's (ep_size W, ep_rank r). Every id must be -1 or one of rank r's experts; else
// kInternal naming the source rank, the row and the id (ranks disagreeing on the shape).
Result<EpExpertSlots> ep_expert_slots(const MoeShape& shape, std::span<const int64_t> rows_from,
                                      std::span<const int32_t> ids, int64_t piece_rows);

}  // namespace k3::comm
