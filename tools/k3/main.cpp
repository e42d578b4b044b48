// k3 — command-line tool of the k3 kernel library. Sub-commands live in tools/k3/cmd_*.cpp.
// Every command returns a Status; this file prints an error and maps it to the exit code, once.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <functional>

#include "k3/harness/atomic_file.hpp"
#include "k3/build_info.hpp"
#include "k3/system.hpp"
#include "command.hpp"

namespace k3::tool {
namespace {
bool g_reports_errors = true;
}  // namespace

std::vector<CommandEntry>& command_registry() {
  static std::vector<CommandEntry> registry;
  return registry;
}

void set_reports_errors(bool on) { g_reports_errors = on; }
bool reports_errors() { return g_reports_errors; }

Status run_parsed(const std::vector<std::pair<CLI::App*, CommandRun>>& runners) {
  for (const auto& [sub, run] : runners) {
    if (sub->parsed()) return run();
  }
  return invalid_argument("no sub-command was given (see --help)");
}

}  // namespace k3::tool

namespace {

// "bench moe" for `k3 bench moe ...`: the chain of parsed sub-commands under `app`.
std::string command_path(const CLI::App& app) {
  std::string path;
  const CLI::App* at = &app;
  for (;;) {
    const CLI::App* next = nullptr;
    for (const CLI::App* sub : at->get_subcommands()) {
      if (sub->parsed()) next = sub;
    }
    if (next == nullptr) return path;
    path += (path.empty() ? "" : " ") + next->get_name();
    at = next;
  }
}

}  // namespace

int main(int argc, char** argv) {
  // An interrupted run removes the temporary files of outputs being written (k3/harness/atomic_file.hpp).
  k3::install_temp_file_cleanup_handlers();
  CLI::App app{"k3: MXFP4 / MXFP8 mixture-of-experts and Kimi Delta Attention kernels for Kimi-K3-class models"};
  app.set_version_flag("--version", std::string("k3 ") + k3::build::kVersion);
  app.require_subcommand(1);
  auto& registry = k3::tool::command_registry();
  std::sort(registry.begin(), registry.end(), [](const auto& a, const auto& b) { return a.order < b.order; });
  std::vector<std::pair<CLI::App*, k3::tool::CommandRun>> runners;
  for (auto& entry : registry) {
    const size_t before = app.get_subcommands({}).size();
    auto run = entry.setup(app);
    auto subs = app.get_subcommands({});
    if (subs.size() > before) runners.emplace_back(subs.back(), std::move(run));
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  k3::Status status;
  try {
    // A K3_ISA that is unknown or above what the CPU has is an error for every command: it must
    // never make the CPU backend silently unavailable (and `moe run` / `validate` fall back to
    // the slow reference backend).
    // So is a K3_NUM_THREADS that is not a plain count in range (never silently reinterpreted).
    const auto isa = k3::active_isa_level();
    status = !isa.is_ok() ? isa.status() : k3::check_thread_env();
    if (status.is_ok()) status = k3::tool::run_parsed(runners);
  } catch (const std::exception& e) {
    status = k3::Status(k3::StatusCode::kInternal, std::string("uncaught exception: ") + e.what());
  }
  if (!status.is_ok() && k3::tool::reports_errors()) {
    std::fflush(stdout);
    std::fprintf(stderr, "k3 %s: %s\n", command_path(app).c_str(), status.to_string().c_str());
  }
  return k3::tool::exit_code(status);
}
