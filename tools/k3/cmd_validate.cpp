// `k3 validate [--op NAME|all] [--suite S] [--backend B] [--require CAP] [--output FILE]`: parses
// the flags, runs the correctness matrix of the harness (k3/harness/validate.hpp), prints it.
#include <cstdio>
#include <memory>

#include "backend_options.hpp"
#include "command.hpp"
#include "k3/harness/atomic_file.hpp"
#include "k3/harness/validate.hpp"
#include "paths.hpp"

namespace k3::tool {
namespace {

using harness::ValidateOptions;
using harness::ValidateRow;

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

Status run_validate(Args& a) {
  // The output path is checked before the (long) run; the write itself reports its errors.
  if (!a.output.empty()) {
    Status s = check_output_path("--output", a.output);
    if (s.is_ok() && !a.opts.checkpoint.empty()) s = check_output_not_checkpoint("--output", a.output, a.opts.checkpoint);
    K3_RETURN_IF_ERROR(s);
  }
  // The environment becomes options here (K3_NUM_THREADS, K3_ISA, K3_CUDA_MOE_PATH), and a refusal
  // of a value that came from it names the variable.
  a.opts.backend_options = backend_options("cuda");
  a.opts.explain = [](Status st, const BackendOptions& bo) { return with_path_source(with_thread_source(std::move(st), bo.threads)); };
  a.opts.progress = [](const std::string& what) { std::fprintf(stderr, "k3 validate %s\n", what.c_str()); };
  auto rows = harness::run_validation(a.op, a.opts);
  K3_RETURN_IF_ERROR(rows.status());
  print_table(rows.value());
  const auto n = harness::count_rows(rows.value());
  if (n.skipped == 0) {
    std::printf("\n%zu checks, %zu failed\n", n.checks, n.failed);
  } else {
    std::printf("\n%zu checks, %zu failed, %zu skipped\n", n.checks, n.failed, n.skipped);
  }
  if (!a.output.empty()) {
    K3_RETURN_IF_ERROR(write_file_atomic(a.output, harness::validation_json(rows.value(), a.opts), "--output"));
  }
  if (n.failed == 0) return Status::ok();
  return check_failed(std::to_string(n.failed) + " of " + std::to_string(n.checks) + " checks failed (FAIL rows above)");
}

const CommandRegistration kRegistration("validate", 10, [](CLI::App& app) -> CommandRun {
  auto* cmd = app.add_subcommand("validate", "Run the correctness matrix against the FP64/FP32 oracles");
  auto a = std::make_shared<Args>();
  std::string ops_help = "Op to validate: all";
  for (const auto& op : harness::validate_ops()) ops_help += ", " + std::string(op.name) + " (" + std::string(op.help) + ")";
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
