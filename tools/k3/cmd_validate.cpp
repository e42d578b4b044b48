// `k3 validate [--op NAME|all] [--suite S] [--backend B] [--require CAP] [--output FILE]`
#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "command.hpp"
#include "k3/harness/atomic_file.hpp"
#include "k3/build_info.hpp"
#include "k3/system.hpp"
#include "paths.hpp"
#include "validate.hpp"

namespace k3::tool {

std::vector<ValidateOp>& validate_registry() {
  static std::vector<ValidateOp> registry;
  return registry;
}

namespace {

struct Args {
  std::string op = "all";
  std::string output;
  ValidateOptions opts;
};

void print_table(const std::vector<ValidateRow>& rows) {
  std::printf("%-8s %-44s %-9s %10s %10s %10s %-16s %s\n", "op", "case", "backend", "cosine", "nrmse", "max_abs",
              "digest", "result");
  for (const auto& r : rows) {
    std::printf("%-8s %-44s %-9s %10.6f %10.3e %10.3e %-16s %s%s%s\n", r.op.c_str(), r.case_name.c_str(),
                r.backend.c_str(), r.cosine, r.nrmse, r.max_abs, r.digest.substr(0, 16).c_str(),
                r.skipped ? "SKIP" : r.pass ? "PASS" : "FAIL", r.note.empty() ? "" : "  ", r.note.c_str());
  }
}

Status run_validate(const Args& a) {
  // The output path is checked before the (long) run; the write itself reports its errors.
  if (!a.output.empty()) {
    Status s = check_output_path("--output", a.output);
    if (s.is_ok() && !a.opts.checkpoint.empty()) s = check_output_not_checkpoint("--output", a.output, a.opts.checkpoint);
    K3_RETURN_IF_ERROR(s);
  }
  // Every op reads the suite: an unknown name is a usage error for all of them, before any work.
  static constexpr const char* kSuites[] = {"smoke", "real", "nonfinite", "determinism", "all"};
  if (std::find(std::begin(kSuites), std::end(kSuites), a.opts.suite) == std::end(kSuites)) {
    return invalid_argument("--suite '" + a.opts.suite +
                            "' is an unknown suite (known: smoke, real, nonfinite, determinism, all)");
  }
  std::vector<ValidateRow> rows;
  bool matched = false;
  for (const auto& op : validate_registry()) {
    if (a.op != "all" && a.op != op.name) continue;
    matched = true;
    auto r = op.run(a.opts);
    rows.insert(rows.end(), r.begin(), r.end());
  }
  if (!matched) {
    std::string names;
    for (const auto& op : validate_registry()) names += " " + op.name;
    return invalid_argument("--op " + a.op + " is not known (known:" + names + ", all)");
  }
  print_table(rows);
  const auto failed = std::count_if(rows.begin(), rows.end(), [](const ValidateRow& r) { return !r.pass; });
  const auto skipped = std::count_if(rows.begin(), rows.end(), [](const ValidateRow& r) { return r.skipped; });
  if (skipped == 0) {
    std::printf("\n%zu checks, %td failed\n", rows.size(), failed);
  } else {
    std::printf("\n%zu checks, %td failed, %td skipped\n", rows.size(), failed, skipped);
  }
  if (!a.output.empty()) {
    nlohmann::json j;
    j["k3_version"] = build::kVersion;
    j["build_type"] = build::kBuildType;
    j["cpu"] = cpu_info().model;
    j["seed"] = a.opts.seed;
    j["suite"] = a.opts.suite;
    for (const auto& r : rows) {
      j["records"].push_back({{"op", r.op}, {"case", r.case_name}, {"backend", r.backend}, {"cosine", r.cosine},
                              {"nrmse", r.nrmse}, {"max_abs", r.max_abs}, {"digest", r.digest},
                              {"pass", r.pass}, {"skipped", r.skipped}, {"note", r.note}});
    }
    K3_RETURN_IF_ERROR(write_file_atomic(a.output, j.dump(2) + "\n", "--output"));
  }
  if (failed == 0) return Status::ok();
  return check_failed(std::to_string(failed) + " of " + std::to_string(rows.size()) + " checks failed (FAIL rows above)");
}

const CommandRegistration kRegistration("validate", 10, [](CLI::App& app) -> CommandRun {
  auto* cmd = app.add_subcommand("validate", "Run the correctness matrix against the FP64/FP32 oracles");
  auto a = std::make_shared<Args>();
  std::string ops_help = "Op to validate: all";
  for (const auto& op : validate_registry()) ops_help += ", " + op.name + " (" + op.help + ")";
  cmd->add_option("--op", a->op, ops_help)->capture_default_str();
  cmd->add_option("--suite", a->opts.suite, "Suite within the op (smoke, real, nonfinite, determinism, all)")
      ->capture_default_str();
  cmd->add_option("--backend", a->opts.backend,
                  "Backend to check: all (moe: every usable one; kda: the default one), reference, cpu, cuda")
      ->capture_default_str();
  cmd->add_option("--require", a->opts.require, "Fail unless this capability is present (repeatable)");
  cmd->add_option("--seed", a->opts.seed, "Seed of the generated cases")->capture_default_str();
  cmd->add_option("--recipe", a->opts.recipe, "moe: w4a8 or w4a16 (default: both)");
  cmd->add_option("--activation", a->opts.activation, "moe: situ, swiglu or silu (default: all three)");
  cmd->add_option("--checkpoint", a->opts.checkpoint, "moe: validate on this checkpoint's expert weights");
  cmd->add_option("--layer", a->opts.layer, "moe: MoE layer of --checkpoint")->capture_default_str();
  cmd->add_option("--ep-size", a->opts.ep_size, "moe: expert-parallel ranks for --checkpoint")->capture_default_str();
  cmd->add_option("--ep-rank", a->opts.ep_rank, "moe: this rank for --checkpoint")->capture_default_str();
  cmd->add_option("--output", a->output, "Write the records as JSON to this file");
  return [a]() { return run_validate(*a); };
});

}  // namespace
}  // namespace k3::tool
