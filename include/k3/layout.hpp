// k3/layout.hpp — row layouts of the gated FC1 weight [E, 2N, K] (MXFP4 codes and E8M0 scales):
//   kGateUp      [gate; up]  rows 0..N-1 gate, N..2N-1 up      Kimi-K3 after loading w1, w3 ("w13")
//   kUpGate      [up; gate]                                     CUTLASS / FlashInfer fused MoE ("w31")
//   kInterleaved gate0, up0, gate1, up1, ...                    GPT-OSS checkpoints
// A conversion moves whole rows (packed code bytes and their scale row together); it never
// decodes or re-quantizes, so every value is preserved bit for bit and conversions compose.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "k3/status.hpp"

namespace k3 {

enum class GatedLayout : uint8_t { kGateUp, kUpGate, kInterleaved };

const char* gated_layout_name(GatedLayout l);  // "gate_up" / "up_gate" / "interleaved"
// Accepts the names above and the aliases "w13", "w31", "gpt_oss".
Result<GatedLayout> parse_gated_layout(const std::string& s);

// Row of (half, i) in layout `l`, half 0 = gate, 1 = up, i in [0, n).
constexpr int64_t gated_row(GatedLayout l, int half, int64_t i, int64_t n) {
  switch (l) {
    case GatedLayout::kGateUp: return half * n + i;
    case GatedLayout::kUpGate: return (1 - half) * n + i;
    case GatedLayout::kInterleaved: return 2 * i + half;
  }
  return 0;
}

// Rearranges rows of `experts` matrices of 2n rows x row_bytes bytes each from layout `from` to
// `to`. src and dst hold experts * 2n * row_bytes bytes and must not overlap.
Status convert_gated_rows(std::span<const uint8_t> src, std::span<uint8_t> dst, int64_t experts, int64_t n,
                          int64_t row_bytes, GatedLayout from, GatedLayout to);

// FC1 of `experts` experts, intermediate n, hidden k (a multiple of 32):
//   q     [experts, 2n, k/2]  packed E2M1        scale     [experts, 2n, k/32]  E8M0
//   q_out [experts, 2n, k/2]                     scale_out [experts, 2n, k/32]
// Codes and scales are moved together by the same row permutation.
Status convert_fc1_layout(std::span<const uint8_t> q, std::span<const uint8_t> scale, int64_t experts, int64_t n,
                          int64_t k, GatedLayout from, GatedLayout to, std::span<uint8_t> q_out,
                          std::span<uint8_t> scale_out);

}  // namespace k3
