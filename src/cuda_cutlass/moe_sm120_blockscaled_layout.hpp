// Layouts of the sm_120a block-scaled grouped GEMM (moe_sm120_blockscaled.cu): where each MXFP8
// activation code / MXFP4 weight code and each UE8M0 scale lives in the buffers that CUTLASS's
// sm120 block-scaled collective reads. Host + device code without CUDA or CUTLASS headers, so the
// very functions the device kernels call are unit-tested on the host
// (tests/core/test_sm120_blockscaled_layout.cpp) and compared offset by offset with CUTLASS's own
// layout functions (tests/cuda/test_sm120_sf_layout.cu). The GEMM is NOT YET RUN ON A GPU.
//
// Scale factors (SF): CUTLASS's Sm1xxBlkScaledConfig<32> tiles an [rows, k/32] scale matrix with
// 128 x 4 atoms (rows padded to 128, scale columns to 4), K-tiles fastest; inside an atom row r
// and scale column c sit at (r % 32) * 16 + (r % 128 / 32) * 4 + c % 4. That is exactly
// k3::swizzled_scale_offset (k3/mx.hpp), which this header reuses rather than restating.
//
// Codes: A (activations) row-major [rows, k] one E4M3 byte per element; B (weights) K-major
// [n_out, k] E2M1 packed two per byte, element 2i in the low nibble of byte i: the checkpoint's
// own packing (k3/mx.hpp), which is also CUTLASS's sub-byte order for float_e2m1_t.
//
// Groups: group g's rows start at a multiple of 128 in A, D and the A scale buffer, so one SF
// buffer laid out for all padded rows serves every group (group g's SF pointer is
// sf + row_start_g * k_blocks_padded, and inside it CUTLASS's layout for rows_g rows applies).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "k3/config.hpp"
#include "k3/mx.hpp"
#include "k3/status.hpp"

namespace k3::cuda::sm120_bs {

inline constexpr int kSfRowTile = 128;     // rows of one SF atom
inline constexpr int kSfColTile = 4;       // scale columns (32-element k-blocks) of one SF atom
inline constexpr int kRowAlign = 128;      // group starts in A / D / SFA are multiples of this
inline constexpr int kKAlign = 128;        // k: 4 scale columns (SF atom) and CUTLASS's E2M1 TMA alignment
inline constexpr int kNAlign = 32;         // n_out: whole MX blocks in a later FC2; FP32 D rows stay 16-byte aligned
inline constexpr int kMaxGroups = 4096;    // the setup kernel holds per-group counts in shared memory

K3_HOST_DEVICE constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Scale columns of a k-long row, padded to the SF atom.
K3_HOST_DEVICE constexpr int64_t sf_cols_padded(int64_t k) { return round_up(k / kMxBlock, kSfColTile); }

// Offset of the scale of (row, k-block) in the SF buffer of a [rows, k] operand.
K3_HOST_DEVICE constexpr int64_t sf_offset(int64_t row, int64_t k_block, int64_t k) {
  return swizzled_scale_offset(row, k_block, k / kMxBlock);
}

// Bytes of the SF buffer of a [rows, k] operand (rows padded to 128, scale columns to 4).
K3_HOST_DEVICE constexpr int64_t sf_bytes(int64_t rows, int64_t k) {
  return round_up(rows, kSfRowTile) * sf_cols_padded(k);
}

// Rows a group of `rows` occupies in A / D / SFA.
K3_HOST_DEVICE constexpr int64_t padded_rows(int64_t rows) { return round_up(rows, kRowAlign); }

// Rows A / D / SFA must hold so that any split of up to `max_rows_total` rows over `groups`
// groups fits with every group padded to 128 rows: sum ceil128(r_g) <= sum r_g + 127 * groups.
K3_HOST_DEVICE constexpr int64_t row_capacity(int64_t max_rows_total, int64_t groups) {
  return round_up(max_rows_total + (kRowAlign - 1) * groups, kRowAlign);
}

// Offset of group g's scales in the A SF buffer when its rows start at `row_start` (a multiple
// of 128): the group's own CUTLASS layout, for its own row count, starts there.
K3_HOST_DEVICE constexpr int64_t group_sf_offset(int64_t row_start, int64_t k) { return row_start * sf_cols_padded(k); }

// Weight (B) buffers: expert g's codes at g * n_out * k / 2, its scales at g * sf_bytes(n_out, k).
K3_HOST_DEVICE constexpr int64_t weight_code_bytes(int64_t n_out, int64_t k) { return n_out * k / 2; }
K3_HOST_DEVICE constexpr int64_t weight_sf_bytes(int64_t n_out, int64_t k) { return sf_bytes(n_out, k); }

// Group placement computed from per-group row counts, as the setup kernel does on the device
// (one thread, groups in order: deterministic). A negative count acts as 0; a group that would
// end past `capacity` rows is given 0 rows and sets *overflow (its compact rows are skipped, the
// later groups' compact starts still follow the counts). Writes groups + 1 starts each.
K3_HOST_DEVICE inline void place_groups(const int32_t* counts, int groups, int64_t capacity, int32_t* rows,
                                        int64_t* padded_start, int64_t* compact_start, bool* overflow) {
  int64_t p = 0, c = 0;
  *overflow = false;
  for (int g = 0; g < groups; ++g) {
    const int64_t count = counts[g] < 0 ? 0 : counts[g];
    int64_t r = count;
    if (p + padded_rows(r) > capacity) {
      *overflow = true;
      r = 0;
    }
    rows[g] = static_cast<int32_t>(r);
    padded_start[g] = p;
    compact_start[g] = c;
    p += padded_rows(r);
    c += count;
  }
  padded_start[groups] = p;
  compact_start[groups] = c;
}

// Checks the GEMM's fixed shape; the message names the argument, the rule and the value.
inline Status check_shape(int64_t groups, int64_t n_out, int64_t k) {
  if (groups < 1 || groups > kMaxGroups) {
    return invalid_argument("sm120 block-scaled GEMM: groups = " + std::to_string(groups) + " must be in [1, " +
                            std::to_string(kMaxGroups) + "]");
  }
  if (n_out < kNAlign || n_out % kNAlign != 0) {
    return invalid_argument("sm120 block-scaled GEMM: n_out = " + std::to_string(n_out) +
                            " must be a positive multiple of " + std::to_string(kNAlign));
  }
  if (k < kKAlign || k % kKAlign != 0) {
    return invalid_argument("sm120 block-scaled GEMM: k = " + std::to_string(k) + " must be a positive multiple of " +
                            std::to_string(kKAlign) + " (4 scale columns per SF atom, CUTLASS's E2M1 alignment)");
  }
  return Status::ok();
}

// Host weight prepack: checkpoint MXFP4 weights of `groups` experts, codes [groups][n_out][k/2]
// (k3/mx.hpp packing) and linear scales [groups][n_out][k/32], to the buffers the GEMM reads:
// codes unchanged (already K-major, low nibble first) and scales in the SF layout, padding 0.
struct PrepackedWeights {
  std::vector<uint8_t> codes;  // groups * weight_code_bytes(n_out, k)
  std::vector<uint8_t> sf;     // groups * weight_sf_bytes(n_out, k)
};

inline Result<PrepackedWeights> prepack_weights(std::span<const uint8_t> q, std::span<const uint8_t> scales,
                                                int64_t groups, int64_t n_out, int64_t k) {
  K3_RETURN_IF_ERROR(check_shape(groups, n_out, k));
  const int64_t code_bytes = weight_code_bytes(n_out, k), kb = k / kMxBlock;
  if (static_cast<int64_t>(q.size()) != groups * code_bytes) {
    return invalid_argument("sm120 prepack: q has " + std::to_string(q.size()) + " bytes, expected groups x n_out x k/2 = " +
                            std::to_string(groups * code_bytes));
  }
  if (static_cast<int64_t>(scales.size()) != groups * n_out * kb) {
    return invalid_argument("sm120 prepack: scales has " + std::to_string(scales.size()) +
                            " bytes, expected groups x n_out x k/32 = " + std::to_string(groups * n_out * kb));
  }
  PrepackedWeights w;
  w.codes.assign(q.begin(), q.end());
  const int64_t sfb = weight_sf_bytes(n_out, k);
  w.sf.assign(static_cast<size_t>(groups * sfb), 0);
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < n_out; ++r) {
      for (int64_t b = 0; b < kb; ++b) {
        w.sf[static_cast<size_t>(g * sfb + sf_offset(r, b, k))] = scales[static_cast<size_t>((g * n_out + r) * kb + b)];
      }
    }
  }
  return w;
}

}  // namespace k3::cuda::sm120_bs
