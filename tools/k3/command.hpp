// Sub-command registry of the `k3` tool. Each tools/k3/cmd_*.cpp registers itself with a static
// CommandRegistration; main() builds the CLI11 app from the registry.
//
// A command parses, calls the library and prints its results; it returns a Status and never
// prints its own error or picks an exit code: main() does both, once (exit_code below).
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

#include "k3/status.hpp"

namespace k3::tool {

// The callback that runs a parsed command.
using CommandRun = std::function<Status()>;
// Adds the sub-command to `app` and returns its CommandRun.
using CommandSetup = std::function<CommandRun(CLI::App& app)>;

struct CommandEntry {
  std::string name;
  int order;  // position in --help
  CommandSetup setup;
};

std::vector<CommandEntry>& command_registry();

struct CommandRegistration {
  CommandRegistration(std::string name, int order, CommandSetup setup) {
    command_registry().push_back({std::move(name), order, std::move(setup)});
  }
};

// The exit code of a command's Status: 0 ok, 1 a check ran and failed (kCheckFailed: `k3 validate`
// found a mismatch), 2 any other error (bad arguments, unreadable files, a backend that is not
// usable). CLI11's own parse errors keep CLI11's codes (100 and above).
inline int exit_code(const Status& s) {
  if (s.is_ok()) return 0;
  return s.code() == StatusCode::kCheckFailed ? 1 : 2;
}

// Multi-rank commands: only rank 0 reports errors (every rank returns the agreed Status).
void set_reports_errors(bool on);
bool reports_errors();

// Runs the parsed one of `runners` (sub-commands of one parent); an error if none was parsed.
Status run_parsed(const std::vector<std::pair<CLI::App*, CommandRun>>& runners);

}  // namespace k3::tool
