// prepack(): checkpoint layout -> the tiled layout of layout.hpp. Moves nibbles, never re-quantizes.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <string>
#include <vector>

#include "cpu/moe/layout.hpp"
#include "k3/cpu_moe.hpp"
#include "k3/mx.hpp"

namespace k3::cpu {
namespace {

using detail::kBlock;
using detail::kLanes;
using detail::kPairs;

// One matrix of one expert: q [rows_out, red/2] packed E2M1, s [rows_out, red/32] E8M0.
struct Matrix {
  const uint8_t* q;
  const uint8_t* s;
  int64_t red;  // reduction length
};

// The scale codes the kernels cannot turn into an exact FP32 factor: 0xFF (NaN) always, and
// 0x00 (2^-127, an FP32 subnormal) under nonzero elements (an all-zero block is exactly zero).
Status check_scale(const char* what, int64_t expert, int64_t row, int64_t block, uint8_t scale, const uint8_t* q) {
  bool nonzero = false;
  for (int i = 0; i < kBlock / 2; ++i) nonzero = nonzero || (q[i] & 0x77) != 0;
  if (scale == kE8M0Nan || (scale == 0 && nonzero)) {
    return invalid_argument(std::string(what) + " local expert " + std::to_string(expert) + " row " +
                            std::to_string(row) + " block " + std::to_string(block) + ": E8M0 scale code " +
                            std::to_string(scale) +
                            (scale == kE8M0Nan ? " (NaN)" : " (2^-127) with nonzero elements") +
                            " is outside the codes the cpu backend computes exactly (1..254, or 0 for a zero block)");
  }
  return Status::ok();
}

// Packs one tile (G groups; row_of(g) = first checkpoint row of group g) into records.
template <typename RowOf>
Status pack_tile(const char* what, int64_t expert, const Matrix& m, int groups, RowOf row_of, uint8_t* dst) {
  const int64_t blocks = m.red / kBlock, rec = detail::record_bytes(groups);
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* r = dst + b * rec;
    for (int p = 0; p < groups / 2; ++p) {
      for (int lane = 0; lane < kLanes; ++lane) {
        const int64_t row_lo = row_of(2 * p) + lane, row_hi = row_of(2 * p + 1) + lane;
        const uint8_t* q_lo = m.q + row_lo * (m.red / 2) + b * kPairs;
        const uint8_t* q_hi = m.q + row_hi * (m.red / 2) + b * kPairs;
        for (int kp = 0; kp < kPairs; ++kp) {
          uint8_t* out = r + (int64_t{kp} * (groups / 2) + p) * 32 + 2 * lane;
          out[0] = static_cast<uint8_t>((q_lo[kp] & 0xF) | ((q_hi[kp] & 0xF) << 4));
          out[1] = static_cast<uint8_t>((q_lo[kp] >> 4) | (q_hi[kp] & 0xF0));
        }
      }
    }
    for (int g = 0; g < groups; ++g) {
      for (int lane = 0; lane < kLanes; ++lane) {
        const int64_t row = row_of(g) + lane;
        const uint8_t sc = m.s[row * (m.red / kBlock) + b];
        K3_RETURN_IF_ERROR(check_scale(what, expert, row, b, sc, m.q + row * (m.red / 2) + b * kPairs));
        r[detail::record_code_bytes(groups) + g * kLanes + lane] = sc;
      }
    }
  }
  return Status::ok();
}

// The FP32 dequantization of an E2M1 element overflows only under scale codes 253 and 254.
constexpr uint8_t kFirstOverflowScale = 253;

// Appends the blocks of one matrix of one expert that hold elements whose exact FP32 value is
// +-Inf; place(row) gives the row's (tile, column) in the tiled layout.
template <typename Place>
void find_inf_blocks(const Matrix& m, int64_t rows, int64_t expert, Place place,
                     std::vector<PackedWeights::InfBlock>& out) {
  const int64_t blocks = m.red / kBlock;
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t sc = m.s[row * blocks + b];
      if (sc < kFirstOverflowScale) continue;
      const uint8_t* q = m.q + row * (m.red / 2) + b * kPairs;
      uint32_t inf = 0, neg = 0;
      for (int el = 0; el < kBlock; ++el) {
        const uint8_t code = el & 1 ? fp4_high(q[el / 2]) : fp4_low(q[el / 2]);
        if (std::isinf(mx_decode_element(code, sc, MxElement::kE2M1))) {
          inf |= 1u << el;
          if (code & 0x8) neg |= 1u << el;
        }
      }
      if (inf == 0) continue;
      const auto [tile, column] = place(row);
      out.push_back({static_cast<int32_t>(expert), static_cast<int32_t>(tile), static_cast<int32_t>(b),
                     static_cast<int32_t>(column), inf, neg});
    }
  }
}

bool inf_block_less(const PackedWeights::InfBlock& a, const PackedWeights::InfBlock& b) {
  if (a.expert != b.expert) return a.expert < b.expert;
  if (a.tile != b.tile) return a.tile < b.tile;
  if (a.block != b.block) return a.block < b.block;
  return a.column < b.column;
}

Status need(const char* name, size_t have, int64_t want) {
  if (static_cast<int64_t>(have) != want) {
    return invalid_argument(std::string(name) + " has " + std::to_string(have) + " elements, expected " +
                            std::to_string(want));
  }
  return Status::ok();
}

}  // namespace

Result<PackedWeights> prepack(const MoePlan& plan, const MoeWeightsView& w) {
  const MoeShape& sh = plan.problem.shape;
  K3_RETURN_IF_ERROR(validate_moe_shape(sh));
  const int64_t e_local = sh.local_experts(), k = sh.hidden, n = sh.intermediate;
  K3_RETURN_IF_ERROR(need("fc1_q [E_local, 2N, K/2]", w.fc1_q.size(), e_local * 2 * n * k / 2));
  K3_RETURN_IF_ERROR(need("fc1_scale [E_local, 2N, K/32]", w.fc1_scale.size(), e_local * 2 * n * k / 32));
  K3_RETURN_IF_ERROR(need("fc2_q [E_local, K, N/2]", w.fc2_q.size(), e_local * k * n / 2));
  K3_RETURN_IF_ERROR(need("fc2_scale [E_local, K, N/32]", w.fc2_scale.size(), e_local * k * n / 32));
  if (!w.situ_beta.empty()) K3_RETURN_IF_ERROR(need("situ_beta [E_local]", w.situ_beta.size(), e_local));
  if (!w.situ_linear_beta.empty()) {
    K3_RETURN_IF_ERROR(need("situ_linear_beta [E_local]", w.situ_linear_beta.size(), e_local));
  }
  PackedWeights out;
  out.shape_ = sh;
  const int64_t tiles1 = n / kBlock, tiles2 = k / kBlock;
  const int64_t tile1_bytes = (k / kBlock) * detail::record_bytes(detail::kFc1Groups);
  const int64_t tile2_bytes = (n / kBlock) * detail::record_bytes(detail::kFc2Groups);
  out.fc1_expert_bytes_ = tiles1 * tile1_bytes;
  out.fc2_expert_bytes_ = tiles2 * tile2_bytes;
  out.fc1_.resize(static_cast<size_t>(e_local * out.fc1_expert_bytes_));
  out.fc2_.resize(static_cast<size_t>(e_local * out.fc2_expert_bytes_));
  for (int64_t e = 0; e < e_local; ++e) {
    const float b = w.situ_beta.empty() ? plan.problem.activation.situ_beta : w.situ_beta[static_cast<size_t>(e)];
    const float lb = w.situ_linear_beta.empty() ? plan.problem.activation.situ_linear_beta
                                                : w.situ_linear_beta[static_cast<size_t>(e)];
    if (plan.problem.activation.kind == ActivationKind::kSiTU && !(b > 0.f && lb > 0.f)) {
      return invalid_argument("local expert " + std::to_string(e) + ": situ_beta = " + std::to_string(b) +
                              " and situ_linear_beta = " + std::to_string(lb) + " must be > 0");
    }
    out.situ_beta_.push_back(b);
    out.situ_linear_beta_.push_back(lb);
  }
  // Tasks: (expert, tile) of FC1, then of FC2; dst = nullptr packs into the weights.
  const int64_t tasks1 = e_local * tiles1, tasks = tasks1 + e_local * tiles2;
  auto pack_task = [&](int64_t t, uint8_t* dst) {
    if (t < tasks1) {
      const int64_t e = t / tiles1, j = t % tiles1;
      const Matrix m{w.fc1_q.data() + e * 2 * n * (k / 2), w.fc1_scale.data() + e * 2 * n * (k / kBlock), k};
      // groups: gate 32j, gate 32j+16, up 32j, up 32j+16 (up rows start at N)
      auto row_of = [n, j](int g) { return (g >= 2 ? n : 0) + j * kBlock + (g & 1) * kLanes; };
      return pack_tile("fc1", e, m, detail::kFc1Groups, row_of,
                       dst ? dst : out.fc1_.data() + e * out.fc1_expert_bytes_ + j * tile1_bytes);
    }
    const int64_t e = (t - tasks1) / tiles2, j = (t - tasks1) % tiles2;
    const Matrix m{w.fc2_q.data() + e * k * (n / 2), w.fc2_scale.data() + e * k * (n / kBlock), n};
    auto row_of = [j](int g) { return j * kBlock + g * kLanes; };
    return pack_tile("fc2", e, m, detail::kFc2Groups, row_of,
                     dst ? dst : out.fc2_.data() + e * out.fc2_expert_bytes_ + j * tile2_bytes);
  };
  int64_t first_bad = tasks;
#pragma omp parallel for num_threads(plan.threads) schedule(dynamic, 4) reduction(min : first_bad)
  for (int64_t t = 0; t < tasks; ++t) {
    if (!pack_task(t, nullptr).is_ok()) first_bad = t < first_bad ? t : first_bad;
  }
  if (first_bad < tasks) {
    // The failing task with the lowest index, re-run alone for its message (deterministic).
    std::vector<uint8_t> scratch(static_cast<size_t>(std::max(tile1_bytes, tile2_bytes)));
    return pack_task(first_bad, scratch.data());
  }
  // Blocks with overflowing elements (rare: only scale codes 253 / 254), per expert, then merged
  // in expert order.
  std::vector<std::vector<PackedWeights::InfBlock>> inf1(static_cast<size_t>(e_local)), inf2(inf1.size());
#pragma omp parallel for num_threads(plan.threads) schedule(dynamic, 1)
  for (int64_t e = 0; e < e_local; ++e) {
    auto& a = inf1[static_cast<size_t>(e)];
    auto& b = inf2[static_cast<size_t>(e)];
    find_inf_blocks(Matrix{w.fc1_q.data() + e * 2 * n * (k / 2), w.fc1_scale.data() + e * 2 * n * (k / kBlock), k},
                    2 * n, e,
                    [n](int64_t row) {
                      const int64_t r = row < n ? row : row - n;
                      return std::pair<int64_t, int64_t>{r / kBlock, (row < n ? 0 : kBlock) + r % kBlock};
                    },
                    a);
    find_inf_blocks(Matrix{w.fc2_q.data() + e * k * (n / 2), w.fc2_scale.data() + e * k * (n / kBlock), n}, k, e,
                    [](int64_t row) { return std::pair<int64_t, int64_t>{row / kBlock, row % kBlock}; }, b);
    std::sort(a.begin(), a.end(), inf_block_less);
    std::sort(b.begin(), b.end(), inf_block_less);
  }
  for (int64_t e = 0; e < e_local; ++e) {
    out.fc1_inf_.insert(out.fc1_inf_.end(), inf1[static_cast<size_t>(e)].begin(), inf1[static_cast<size_t>(e)].end());
    out.fc2_inf_.insert(out.fc2_inf_.end(), inf2[static_cast<size_t>(e)].begin(), inf2[static_cast<size_t>(e)].end());
  }
  return out;
}

std::span<const PackedWeights::InfBlock> PackedWeights::inf_blocks(int matrix, int64_t expert, int64_t tile) const {
  const std::vector<InfBlock>& v = matrix == 1 ? fc1_inf_ : fc2_inf_;
  if (v.empty()) return {};
  const InfBlock key{static_cast<int32_t>(expert), static_cast<int32_t>(tile), 0, 0, 0, 0};
  auto tile_less = [](const InfBlock& a, const InfBlock& b) {
    return a.expert != b.expert ? a.expert < b.expert : a.tile < b.tile;
  };
  const auto [lo, hi] = std::equal_range(v.begin(), v.end(), key, tile_less);
  return {v.data() + (lo - v.begin()), static_cast<size_t>(hi - lo)};
}

}  // namespace k3::cpu
