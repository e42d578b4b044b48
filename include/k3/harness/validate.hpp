// The correctness matrix (docs/validation.md): each op's seeded cases, its oracle -> compare ->
// tolerance checks and its suites, as a library. `k3 validate` parses flags and prints what this
// returns; Python's k3.validate calls it directly; the same JSON schema serves both.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "k3/backend.hpp"
#include "k3/status.hpp"

namespace k3::harness {

struct ValidateOptions {
  std::string suite = "all";            // smoke | real | nonfinite | determinism | all
  std::string backend = "all";          // all | reference | cpu | cuda
  std::vector<std::string> require;     // capabilities that must be present
  uint64_t seed = 20261129;
  // The options every backend run gets (threads, SIMD level, the cuda kernel path). The caller
  // fills them: the `k3` tool from K3_NUM_THREADS / K3_ISA / K3_CUDA_MOE_PATH, Python from its
  // arguments. The determinism suites override `threads` (1, 2, 3) themselves.
  BackendOptions backend_options;
  // Rewrites a backend's error before it lands in a row (the tool names the environment variable
  // an option came from). Identity when empty.
  std::function<Status(Status, const BackendOptions&)> explain;
  // Told what is about to run ("moe: smoke m1 uniform w4a8 situ") before each long check; the
  // tool prints it on stderr. Nothing when empty.
  std::function<void(const std::string&)> progress;
  // --op moe
  std::string recipe;      // "" = both, or w4a8 | w4a16
  std::string activation;  // "" = all three, or situ | swiglu | silu
  std::string checkpoint;  // validate on this checkpoint's weights (with layer, ep_size, ep_rank)
  int layer = 1;
  int ep_size = 1;
  int ep_rank = 0;

  // The options for one backend: `backend_options`, with the kernel path only for cuda (the
  // other backends have none).
  BackendOptions options_for(std::string_view backend_name) const;
  Status explained(Status st, const BackendOptions& o) const { return explain ? explain(std::move(st), o) : st; }
  void report(const std::string& what) const {
    if (progress) progress(what);
  }
};

struct ValidateRow {
  std::string op;
  std::string case_name;
  std::string backend;
  double cosine = 1.0;
  double nrmse = 0.0;
  double max_abs = 0.0;
  std::string digest;  // SHA-256 (hex) of the output bytes, or ""
  bool pass = false;
  std::string note;      // what was checked / why it failed / why it was skipped
  bool skipped = false;  // not run (e.g. the backend has no such entry): SKIP, not counted as failed
};

using ValidateOpFn = std::vector<ValidateRow> (*)(const ValidateOptions&);

struct ValidateOp {
  std::string_view name;
  std::string_view help;
  ValidateOpFn run;
};

// formats, kda, linear, moe: in the order `--op all` runs them.
const std::vector<ValidateOp>& validate_ops();

inline constexpr std::string_view kValidateSuites[] = {"smoke", "real", "nonfinite", "determinism", "all"};

// Runs `op` (a name of validate_ops(), or "all"). Refuses an unknown op or suite (naming the
// known ones) before any work; a failed check is a FAIL row, not an error.
Result<std::vector<ValidateRow>> run_validation(std::string_view op, const ValidateOptions& o);

// The records as the JSON document `k3 validate --output` writes (k3_version, build_type, cpu,
// seed, suite, records[]).
std::string validation_json(const std::vector<ValidateRow>& rows, const ValidateOptions& o);

// Counts of FAIL (not skipped) and SKIP rows.
struct ValidateCounts {
  size_t checks = 0, failed = 0, skipped = 0;
};
ValidateCounts count_rows(const std::vector<ValidateRow>& rows);

// The per-op entry points (validate_ops() lists them).
std::vector<ValidateRow> validate_formats(const ValidateOptions& o);
std::vector<ValidateRow> validate_moe(const ValidateOptions& o);
std::vector<ValidateRow> validate_kda(const ValidateOptions& o);
std::vector<ValidateRow> validate_linear(const ValidateOptions& o);

}  // namespace k3::harness
