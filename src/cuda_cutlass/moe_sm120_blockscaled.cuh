// The sm_120a W4A8 grouped GEMM building block on CUTLASS 4.2's sm120 block-scaled collective
// (moe_sm120_blockscaled.cu). No CUTLASS or CUDA type here: callers need neither.
//
// One group per local expert g:  D[g] (FP32, row-major [rows_g, n_out]) =
//     A[g] (MXFP8 E4M3, [rows_g, k], K-major, UE8M0 scale per 32 k)
//   x B[g]^T (MXFP4 E2M1, [n_out, k], K-major, UE8M0 scale per 32 k).
// Layouts: moe_sm120_blockscaled_layout.hpp. Group g's rows start at padded_start[g] (a multiple
// of 128) in A, SFA and D; the row counts are read on the device only (graph-safe).
//
// STATUS: compiled for sm_120a only, NEVER RUN ON ANY GPU (no sm_120 machine exists here).
// Opt-in building block; nothing in k3's default paths calls it.
#pragma once

#include <cstdint>
#include <memory>

#include "k3/status.hpp"

namespace k3::cuda::sm120_bs {

// Whether this build contains it: k3::cuda::has_sm120_blockscaled_gemm() (k3/cuda_sm120.hpp).

struct GemmShape {
  int groups = 0;              // local experts, [1, kMaxGroups]
  int64_t n_out = 0;           // multiple of 32
  int64_t k = 0;               // multiple of 128
  int64_t row_capacity = 0;    // rows A / SFA / D hold: row_capacity(max_rows_total, groups)
  int sm_count = 0;            // persistent grid size (the device's SM count)
};

// Device buffers, fixed for the life of the GEMM object (the kernel parameters are built once).
struct GemmOperands {
  const int32_t* counts = nullptr;  // [groups] rows per group, device memory, read on the device
  uint8_t* a_codes = nullptr;       // [row_capacity, k] E4M3 codes
  uint8_t* a_sf = nullptr;          // sf_bytes(row_capacity, k) UE8M0, SF layout
  const uint8_t* b_codes = nullptr; // [groups][n_out][k/2] E2M1 (prepack_weights)
  const uint8_t* b_sf = nullptr;    // [groups] x weight_sf_bytes(n_out, k) (prepack_weights)
  float* d = nullptr;               // [row_capacity, n_out] FP32
};

// Status bit written by the setup kernel: a group did not fit in row_capacity and got 0 rows.
inline constexpr int kStatusRowOverflow = 1;

class GroupedGemm {
 public:
  struct Impl;
  GroupedGemm();
  GroupedGemm(GroupedGemm&&) noexcept;
  GroupedGemm& operator=(GroupedGemm&&) noexcept;
  ~GroupedGemm();

  // Checks the shape and the device (must be sm_120 with this TU built for sm_120a), allocates the
  // per-group argument arrays and CUTLASS's workspace, builds the kernel parameters.
  static Result<GroupedGemm> create(const GemmShape& shape, const GemmOperands& ops);

  // Enqueue on `stream` (cudaStream_t); fixed grids, no host synchronization, no allocation:
  // setup() writes the per-group placement and CUTLASS's per-group arrays from the counts;
  // quantize_a() writes A and SFA from FP32 rows stored compactly in group order ([sum rows, k],
  // group g from compact_start[g]), padding rows zero; gemm() runs the grouped GEMM.
  Status setup(void* stream) const;
  Status quantize_a(const float* x_compact, void* stream) const;
  Status gemm(void* stream) const;

  // Device arrays written by setup(): [groups + 1] row starts (int64) and the status int.
  const int64_t* padded_start() const;
  const int64_t* compact_start() const;
  const int32_t* status() const;

 private:
  explicit GroupedGemm(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace k3::cuda::sm120_bs
