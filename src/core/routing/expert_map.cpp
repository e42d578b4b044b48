// Expert-parallel id mapping, the stable sort of token-slots by local expert, and block padding
// (k3/expert_map.hpp). A counting sort: O(M * top_k + E_local), stable by construction.
#include "k3/expert_map.hpp"

#include <algorithm>
#include <cstdio>
#include <string>

namespace k3 {

namespace {
std::string num(int64_t v) { return std::to_string(v); }

int64_t nearest_rank(const std::vector<int64_t>& sorted, int pct) {
  if (sorted.empty()) return 0;
  // Nearest-rank percentile: the smallest value with at least pct % of the values at or below it.
  const int64_t n = static_cast<int64_t>(sorted.size());
  int64_t rank = (pct * n + 99) / 100;
  if (rank < 1) rank = 1;
  return sorted[rank - 1];
}
}  // namespace

ExpertLoad expert_load(std::span<const int64_t> rows_per_expert) {
  ExpertLoad l;
  if (rows_per_expert.empty()) return l;
  std::vector<int64_t> v(rows_per_expert.begin(), rows_per_expert.end());
  std::sort(v.begin(), v.end());
  int64_t total = 0;
  for (int64_t r : v) {
    total += r;
    l.empty += r == 0;
  }
  l.mean = static_cast<double>(total) / static_cast<double>(v.size());
  l.p50 = nearest_rank(v, 50);
  l.p90 = nearest_rank(v, 90);
  l.max = v.back();
  return l;
}

std::string ExpertLoad::to_string() const {
  char buf[160];
  std::snprintf(buf, sizeof buf, "rows/expert mean %.2f p50 %lld p90 %lld max %lld empty %d", mean,
                static_cast<long long>(p50), static_cast<long long>(p90), static_cast<long long>(max), empty);
  return buf;
}

std::string EpMapping::to_string() const {
  return "EP" + num(ep_size) + " rank " + num(ep_rank) + ": experts [" + num(first_local) + ", " +
         num(first_local + local_experts) + ") of " + num(num_experts) + "; M " + num(m) + " x top-" + num(top_k) +
         ": " + num(local_slots) + " local, " + num(remote_slots) + " remote, " + num(masked_slots) + " masked slots; " +
         load().to_string();
}

Result<EpMapping> map_expert_parallel(const MoeShape& shape, int64_t m, std::span<const int32_t> ids) {
  K3_RETURN_IF_ERROR(validate_moe_shape(shape));
  if (m < 0) return invalid_argument("expert map: m = " + num(m) + " must be >= 0");
  if (static_cast<int64_t>(ids.size()) != m * shape.top_k) {
    return invalid_argument("expert map: ids [M, top_k] has " + num(static_cast<int64_t>(ids.size())) +
                            " elements, expected " + num(m * shape.top_k));
  }
  EpMapping r;
  r.num_experts = shape.num_experts;
  r.ep_size = shape.ep_size;
  r.ep_rank = shape.ep_rank;
  r.local_experts = shape.local_experts();
  r.first_local = shape.first_local_expert();
  r.m = m;
  r.top_k = shape.top_k;
  const int64_t slots = m * shape.top_k;
  r.local_ids.assign(slots, -1);
  r.rows_per_expert.assign(r.local_experts, 0);
  for (int64_t i = 0; i < slots; ++i) {
    const int32_t id = ids[i];
    if (id < -1 || id >= shape.num_experts) {
      return invalid_argument("expert map: ids[" + num(i / shape.top_k) + ", " + num(i % shape.top_k) + "] = " +
                              num(id) + " must be -1 (masked) or a global expert id in [0, " +
                              num(shape.num_experts) + ")");
    }
    if (id == -1) {
      ++r.masked_slots;
    } else if (id >= r.first_local && id < r.first_local + r.local_experts) {
      r.local_ids[i] = id - r.first_local;
      ++r.rows_per_expert[id - r.first_local];
      ++r.local_slots;
    } else {
      ++r.remote_slots;
    }
  }
  r.expert_offsets.assign(r.local_experts + 1, 0);
  std::vector<int32_t> slot_row(static_cast<size_t>(slots));
  K3_RETURN_IF_ERROR(sort_local_slots(ids, shape.top_k, r.first_local, r.local_experts, r.expert_offsets, slot_row, {}));
  r.sorted_slots.assign(r.local_slots, 0);
  r.slot_to_sorted.assign(slots, -1);
  for (int64_t i = 0; i < slots; ++i) {
    const int32_t row = slot_row[static_cast<size_t>(i)];
    if (row < 0) continue;
    r.sorted_slots[row] = i;
    r.slot_to_sorted[i] = row;
  }
  return r;
}

Status sort_local_slots(std::span<const int32_t> ids, int top_k, int first_local, int local_experts,
                        std::span<int64_t> offsets, std::span<int32_t> slot_row, std::span<int32_t> row_token) {
  if (top_k < 1 || local_experts < 0 || ids.size() % static_cast<size_t>(top_k) != 0) {
    return invalid_argument("sort_local_slots: ids has " + num(static_cast<int64_t>(ids.size())) +
                            " elements, not a multiple of top_k = " + num(top_k));
  }
  if (offsets.size() < static_cast<size_t>(local_experts) + 1 || slot_row.size() < ids.size()) {
    return invalid_argument("sort_local_slots: offsets has " + num(static_cast<int64_t>(offsets.size())) +
                            " elements (needs local_experts + 1 = " + num(local_experts + 1) + "), slot_row " +
                            num(static_cast<int64_t>(slot_row.size())) + " (needs " +
                            num(static_cast<int64_t>(ids.size())) + ")");
  }
  const int64_t slots = static_cast<int64_t>(ids.size());
  auto local = [&](int64_t i) -> int64_t {
    const int64_t e = static_cast<int64_t>(ids[static_cast<size_t>(i)]) - first_local;
    return e >= 0 && e < local_experts ? e : -1;
  };
  for (int64_t e = 0; e <= local_experts; ++e) offsets[static_cast<size_t>(e)] = 0;
  for (int64_t i = 0; i < slots; ++i) {
    if (const int64_t e = local(i); e >= 0) ++offsets[static_cast<size_t>(e + 1)];
  }
  for (int64_t e = 0; e < local_experts; ++e) offsets[static_cast<size_t>(e + 1)] += offsets[static_cast<size_t>(e)];
  const int64_t rows = offsets[static_cast<size_t>(local_experts)];
  if (!row_token.empty() && static_cast<int64_t>(row_token.size()) < rows) {
    return invalid_argument("sort_local_slots: row_token has " + num(static_cast<int64_t>(row_token.size())) +
                            " elements, the ids hold " + num(rows) + " local slots");
  }
  // offsets[e] serves as expert e's running cursor (ascending slot order: stable), then is shifted back.
  for (int64_t i = 0; i < slots; ++i) {
    const int64_t e = local(i);
    int32_t r = -1;
    if (e >= 0) {
      r = static_cast<int32_t>(offsets[static_cast<size_t>(e)]++);
      if (!row_token.empty()) row_token[static_cast<size_t>(r)] = static_cast<int32_t>(i / top_k);
    }
    slot_row[static_cast<size_t>(i)] = r;
  }
  for (int64_t e = local_experts; e > 0; --e) offsets[static_cast<size_t>(e)] = offsets[static_cast<size_t>(e - 1)];
  offsets[0] = 0;
  return Status::ok();
}

std::string PaddedLayout::to_string() const {
  char buf[160];
  std::snprintf(buf, sizeof buf, "block %d: %lld padded rows for %lld real, padding %.1f %%", block,
                static_cast<long long>(padded_rows), static_cast<long long>(real_rows), 100.0 * padding_fraction);
  return buf;
}

Result<PaddedLayout> pad_to_block(const EpMapping& map, int block) {
  if (std::find(std::begin(kRowBlocks), std::end(kRowBlocks), block) == std::end(kRowBlocks)) {
    return invalid_argument("row block = " + num(block) + " must be 8, 16, 32 or 64");
  }
  if (static_cast<int64_t>(map.rows_per_expert.size()) != map.local_experts ||
      static_cast<int64_t>(map.expert_offsets.size()) != map.local_experts + 1 ||
      static_cast<int64_t>(map.sorted_slots.size()) != map.local_slots) {
    return invalid_argument("pad_to_block: the EpMapping is inconsistent (use map_expert_parallel to build it)");
  }
  for (int e = 0; e < map.local_experts; ++e) {
    if (map.rows_per_expert[e] < 0 || map.expert_offsets[e] < 0 ||
        map.expert_offsets[e + 1] != map.expert_offsets[e] + map.rows_per_expert[e]) {
      return invalid_argument("pad_to_block: expert_offsets of local expert " + num(e) +
                              " do not match rows_per_expert (use map_expert_parallel to build the EpMapping)");
    }
  }
  if (map.expert_offsets[0] != 0 || map.expert_offsets.back() != map.local_slots) {
    return invalid_argument("pad_to_block: expert_offsets must run from 0 to local_slots = " + num(map.local_slots));
  }
  PaddedLayout p;
  p.block = block;
  p.padded_offsets.assign(map.local_experts + 1, 0);
  for (int e = 0; e < map.local_experts; ++e) {
    const int64_t rows = map.rows_per_expert[e];
    p.padded_offsets[e + 1] = p.padded_offsets[e] + (rows + block - 1) / block * block;
  }
  p.sorted_to_padded.assign(map.local_slots, 0);
  for (int e = 0; e < map.local_experts; ++e) {
    for (int64_t i = map.expert_offsets[e]; i < map.expert_offsets[e + 1]; ++i) {
      p.sorted_to_padded[i] = p.padded_offsets[e] + (i - map.expert_offsets[e]);
    }
  }
  p.real_rows = map.local_slots;
  p.padded_rows = p.padded_offsets.back();
  p.padding_fraction =
      p.padded_rows == 0 ? 0.0 : static_cast<double>(p.padded_rows - p.real_rows) / static_cast<double>(p.padded_rows);
  return p;
}

}  // namespace k3
