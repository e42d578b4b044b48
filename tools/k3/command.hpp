// Sub-command registry of the `k3` tool. Each tools/k3/cmd_*.cpp registers itself with a static
// CommandRegistration; main() builds the CLI11 app from the registry.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace k3::tool {

// Adds the sub-command to `app` and returns the callback that runs it (its exit code).
using CommandSetup = std::function<std::function<int()>(CLI::App& app)>;

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

}  // namespace k3::tool
