// k3/harness/moe_compare.hpp — comparing a backend's fused-MoE output (bytes of the output dtype) with the
// FP64 oracles of k3/moe_ref.hpp, and the named tolerances of `k3 validate --op moe` (docs/moe.md,
// "Tolerances"). Backend tests use the same functions, so a unit test and the CLI judge alike.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "k3/moe.hpp"
#include "k3/status.hpp"

namespace k3 {

struct MoeMetrics {
  double cosine = 1.0;
  double nrmse = 0.0;     // RMS(out - ref) / RMS(ref) over the positions where both are finite
  double max_abs = 0.0;   // max |out - ref| over the same positions
  double ref_max = 0.0;   // max |ref| over finite positions
  int64_t nonfinite = 0;          // non-finite outputs
  int64_t nonfinite_mismatch = 0;  // positions whose NaN / +Inf / -Inf class differs from the rounded oracle
  int64_t zero_row_violations = 0;  // elements of rows without a local slot that are not +0.0
  int64_t exact = 0;      // outputs bit-identical to the oracle rounded once to the dtype
  int64_t total = 0;      // outputs compared (rows beyond FP32 range excluded)
  int64_t rows_beyond_fp32 = 0;  // rows not compared: beyond what the oracle predicts for FP32
  std::string summary() const;  // "exact 99.2%, nonfinite 0"
};

// out: M*K values of `dtype` (little-endian bytes); ref: M*K FP64 (before rounding);
// zero_rows: [M] true for rows that must be exactly +0.0 (no local slot); may be empty.
// rows_beyond_fp32: [M] rows the oracle marked (moe_oracle's rows_beyond_fp32): skipped entirely
// and counted in MoeMetrics::rows_beyond_fp32; may be empty.
// Errors: out.size() != ref.size() * dtype size, or ref.size() not a multiple of the size of
// zero_rows or rows_beyond_fp32.
Result<MoeMetrics> compare_moe_output(std::span<const uint8_t> out, OutDType dtype, std::span<const double> ref,
                                      const std::vector<bool>& zero_rows,
                                      const std::vector<bool>& rows_beyond_fp32 = {});

// Contract tolerances: what a correct FP32-accumulating backend can differ from the FP64 oracle
// (output rounding plus rare flips of the MXFP8 / BF16 rounding of the intermediate).
struct MoeTolerance {
  const char* name;
  double max_nrmse;
  double max_abs_rel;  // max_abs <= max_abs_rel * ref_max
  double min_cosine;
};
MoeTolerance contract_tolerance(OutDType d);
// Sanity bounds for the seed metrics against the BF16 reference (recipe noise, an order of
// magnitude above the seeds' NRMSE 2.75 % / cosine 0.99962).
MoeTolerance seed_tolerance(Recipe r);

// Pass/fail of metrics under a tolerance; `why` gets the first violated bound.
bool within(const MoeMetrics& m, const MoeTolerance& t, std::string* why);

// Rows of a problem that hold no local slot (EP-remote or masked only): they must be +0.0.
// Reads at most topk_ids.size() ids; a shape failing validate_moe_shape reports every row.
std::vector<bool> rows_without_local_slot(const MoeShape& shape, const MoeInputsView& in);

}  // namespace k3
