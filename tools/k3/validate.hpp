// `k3 validate`: runs the correctness checks of one or more ops and reports a table / JSON.
// Each op (formats, moe, kda, ...) registers a ValidateOp from its own tools/k3/validate_*.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace k3::tool {

struct ValidateOptions {
  std::string suite = "all";
  std::string backend = "all";          // all | reference | cpu | cuda
  std::vector<std::string> require;     // capabilities that must be present
  uint64_t seed = 20261129;
  // --op moe
  std::string recipe;      // "" = both, or w4a8 | w4a16
  std::string activation;  // "" = all three, or situ | swiglu | silu
  std::string checkpoint;  // validate on this checkpoint's weights (with layer, ep_size, ep_rank)
  int layer = 1;
  int ep_size = 1;
  int ep_rank = 0;
};

struct ValidateRow {
  std::string op;
  std::string case_name;
  std::string backend;
  double cosine = 1.0;
  double nrmse = 0.0;
  double max_abs = 0.0;
  std::string digest;  // SHA-256 (hex, first 16 chars shown) of the output bytes, or ""
  bool pass = false;
  std::string note;      // what was checked / why it failed / why it was skipped
  bool skipped = false;  // not run (e.g. the backend has no such entry): SKIP, not counted as failed
};

using ValidateOpFn = std::function<std::vector<ValidateRow>(const ValidateOptions&)>;

struct ValidateOp {
  std::string name;
  std::string help;
  ValidateOpFn run;
};

std::vector<ValidateOp>& validate_registry();

struct ValidateRegistration {
  ValidateRegistration(std::string name, std::string help, ValidateOpFn fn) {
    validate_registry().push_back({std::move(name), std::move(help), std::move(fn)});
  }
};

}  // namespace k3::tool
