// k3 — command-line tool of the k3 kernel library. Sub-commands live in tools/k3/cmd_*.cpp.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <functional>

#include "k3/atomic_file.hpp"
#include "k3/build_info.hpp"
#include "k3/system.hpp"
#include "command.hpp"

namespace k3::tool {
std::vector<CommandEntry>& command_registry() {
  static std::vector<CommandEntry> registry;
  return registry;
}
}  // namespace k3::tool

int main(int argc, char** argv) {
  // An interrupted run removes the temporary files of outputs being written (k3/atomic_file.hpp).
  k3::install_temp_file_cleanup_handlers();
  CLI::App app{"k3: MXFP4 / MXFP8 mixture-of-experts and Kimi Delta Attention kernels for Kimi-K3-class models"};
  app.set_version_flag("--version", std::string("k3 ") + k3::build::kVersion);
  app.require_subcommand(1);
  auto& registry = k3::tool::command_registry();
  std::sort(registry.begin(), registry.end(), [](const auto& a, const auto& b) { return a.order < b.order; });
  std::vector<std::pair<CLI::App*, std::function<int()>>> runners;
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
  for (auto& [sub, run] : runners) {
    if (sub->parsed()) {
      // A K3_ISA that is unknown or above what the CPU has is an error for every command: it must
      // never make the CPU backend silently unavailable (and `moe run` / `validate` fall back to
      // the slow reference backend).
      if (const auto isa = k3::active_isa_level(); !isa.is_ok()) {
        std::fprintf(stderr, "k3 %s: %s\n", sub->get_name().c_str(), isa.status().to_string().c_str());
        return 2;
      }
      try {
        return run();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "k3 %s: error: %s\n", sub->get_name().c_str(), e.what());
        return 2;
      }
    }
  }
  return 0;
}
