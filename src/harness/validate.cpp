#include "k3/harness/validate.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "k3/build_info.hpp"
#include "k3/system.hpp"

namespace k3::harness {

BackendOptions ValidateOptions::options_for(std::string_view backend_name) const {
  BackendOptions o = backend_options;
  if (backend_name != "cuda") o.path.clear();
  return o;
}

const std::vector<ValidateOp>& validate_ops() {
  static const std::vector<ValidateOp> ops = {
      {"formats", "MX codecs, scale rules, layouts", validate_formats},
      {"kda", "Kimi Delta Attention: a backend's prefill/decode/verify, CPU variants, ops", validate_kda},
      {"linear", "dense MXFP8 linear vs its FP64 oracle and contract", validate_linear},
      {"moe", "fused MoE vs the FP64 contract oracle and the BF16 reference", validate_moe},
  };
  return ops;
}

Result<std::vector<ValidateRow>> run_validation(std::string_view op, const ValidateOptions& o) {
  // Every op reads the suite: an unknown name is a usage error for all of them, before any work.
  if (std::find(std::begin(kValidateSuites), std::end(kValidateSuites), o.suite) == std::end(kValidateSuites)) {
    return invalid_argument("--suite '" + o.suite + "' is an unknown suite (known: smoke, real, nonfinite, determinism, all)");
  }
  const auto& ops = validate_ops();
  if (op != "all" && std::none_of(ops.begin(), ops.end(), [&](const ValidateOp& v) { return v.name == op; })) {
    std::string msg = "--op ";
    msg.append(op).append(" is not known (known:");
    for (const auto& v : ops) msg.append(" ").append(v.name);
    return invalid_argument(msg + ", all)");
  }
  std::vector<ValidateRow> rows;
  for (const auto& v : ops) {
    if (op != "all" && op != v.name) continue;
    auto r = v.run(o);
    rows.insert(rows.end(), r.begin(), r.end());
  }
  return rows;
}

std::string validation_json(const std::vector<ValidateRow>& rows, const ValidateOptions& o) {
  nlohmann::json j;
  j["k3_version"] = build::kVersion;
  j["build_type"] = build::kBuildType;
  j["cpu"] = cpu_info().model;
  j["seed"] = o.seed;
  j["suite"] = o.suite;
  j["records"] = nlohmann::json::array();
  for (const auto& r : rows) {
    j["records"].push_back({{"op", r.op}, {"case", r.case_name}, {"backend", r.backend}, {"cosine", r.cosine},
                            {"nrmse", r.nrmse}, {"max_abs", r.max_abs}, {"digest", r.digest}, {"pass", r.pass},
                            {"skipped", r.skipped}, {"note", r.note}});
  }
  return j.dump(2) + "\n";
}

ValidateCounts count_rows(const std::vector<ValidateRow>& rows) {
  ValidateCounts c;
  c.checks = rows.size();
  for (const auto& r : rows) {
    if (!r.pass) ++c.failed;
    if (r.skipped) ++c.skipped;
  }
  return c;
}

}  // namespace k3::harness
