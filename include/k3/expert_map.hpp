// k3/expert_map.hpp — expert parallelism and the permute step of a fused MoE, as plain host
// functions (docs/moe.md: "Expert parallelism", "Execution facts"). The CPU and CUDA backends use
// these for their sort-by-expert / gather / scatter steps, and the benchmarks for the routing
// histogram.
//
// Slots are numbered token-major: slot = t * top_k + k. Rank r of ep_size holds the contiguous
// global experts [r * E_local, (r+1) * E_local); a slot is local when its id is in that range,
// remote when it is another valid id, masked when it is -1.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "k3/moe.hpp"
#include "k3/status.hpp"

namespace k3 {

// Rows per local expert: mean, nearest-rank p50 / p90, max, experts without a row.
struct ExpertLoad {
  double mean = 0;
  int64_t p50 = 0, p90 = 0, max = 0;
  int empty = 0;
  std::string to_string() const;  // "rows/expert mean 4.57 p50 4 p90 8 max 11 empty 2"
};
ExpertLoad expert_load(std::span<const int64_t> rows_per_expert);

struct EpMapping {
  int num_experts = 0, ep_size = 1, ep_rank = 0, local_experts = 0, first_local = 0;
  int64_t m = 0;
  int top_k = 0;
  std::vector<int32_t> local_ids;          // [M, top_k] local expert id, -1 for masked or remote slots
  std::vector<int64_t> rows_per_expert;    // [E_local] local slots routed to each local expert
  std::vector<int64_t> expert_offsets;     // [E_local + 1] rows of expert e in sorted order: [off[e], off[e+1])
  std::vector<int64_t> sorted_slots;       // [local slots] slot ids sorted by local expert, stable (slot order within an expert)
  std::vector<int64_t> slot_to_sorted;     // [M * top_k] inverse: position in sorted_slots, -1 if not local
  int64_t local_slots = 0, remote_slots = 0, masked_slots = 0;
  ExpertLoad load() const { return expert_load(rows_per_expert); }
  std::string to_string() const;  // summary (counts, load); not the arrays
};

// ids [M, top_k] global ids (-1 masked). Checks the shape (validate_moe_shape) and every id.
Result<EpMapping> map_expert_parallel(const MoeShape& shape, int64_t m, std::span<const int32_t> ids);

// The permutation itself, shared by map_expert_parallel and the CPU backend's permute step (which
// runs it on its workspace, per chunk of tokens): the local slots of `ids` ([tokens, top_k] global
// ids) sorted by local expert, stable (ascending slot order within an expert). Slots whose id is
// not one of this rank's [first_local, first_local + local_experts) — remote, masked (-1) or
// invalid — are not local. No allocation and no checks beyond the sizes:
//   offsets   [local_experts + 1]  rows of expert e are [offsets[e], offsets[e + 1])
//   slot_row  [tokens * top_k]     the sorted row of each slot, -1 if not local
//   row_token [local slots] or empty: the token of each sorted row
// Errors: a span shorter than stated above (INVALID_ARGUMENT naming it).
Status sort_local_slots(std::span<const int32_t> ids, int top_k, int first_local, int local_experts,
                        std::span<int64_t> offsets, std::span<int32_t> slot_row, std::span<int32_t> row_token);

inline constexpr int kRowBlocks[] = {8, 16, 32, 64};

// Each local expert's rows padded up to a multiple of `block` (8, 16, 32 or 64), as grouped GEMMs
// tile them (Marlin's moe_align_block_size). Experts without rows take no block.
struct PaddedLayout {
  int block = 0;
  std::vector<int64_t> padded_offsets;  // [E_local + 1] start row of each expert in the padded buffer
  std::vector<int64_t> sorted_to_padded;  // [local slots] padded row of each sorted position
  int64_t real_rows = 0, padded_rows = 0;
  double padding_fraction = 0;  // (padded_rows - real_rows) / padded_rows; 0 when padded_rows == 0
  std::string to_string() const;  // "block 16: 160 padded rows for 128 real, padding 20.0 %"
};
Result<PaddedLayout> pad_to_block(const EpMapping& map, int block);

}  // namespace k3
