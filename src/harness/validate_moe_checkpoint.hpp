// `k3 validate --op moe --checkpoint PATH --layer L --ep-size S --ep-rank R`: the correctness
// checks on a checkpoint's expert weights (activation and routing from its config.json).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "k3/moe.hpp"
#include "k3/harness/moe_case.hpp"
#include "k3/harness/validate.hpp"

namespace k3::harness {

// Runs `check(name, case, seed_rows)` for each recipe at M = 1 and 8 (suite smoke), 1 and 128
// (real), or all three (all). Load or config errors become FAIL rows.
using MoeCheckFn = std::function<void(const std::string& name, MoeCase& c, bool seed)>;
void validate_on_checkpoint(const ValidateOptions& o, const std::vector<Recipe>& recipes, const MoeCheckFn& check,
                            std::vector<ValidateRow>& rows);

}  // namespace k3::harness
