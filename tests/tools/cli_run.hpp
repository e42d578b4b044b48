// Runs the `k3` binary under test (K3_CLI_PATH) and captures its exit code and output.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace k3::test {

struct CliRun {
  int code;         // exit status
  std::string out;  // stdout, and stderr unless with_stderr is false
};

// Runs a shell command line, stdout and stderr together.
inline CliRun run_sh(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed: " + cmd};
  std::string out;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int status = pclose(p);
  return {WEXITSTATUS(status), out};
}

inline CliRun run_cli(const std::string& args, bool with_stderr = true) {
  const std::string cli = std::string(K3_CLI_PATH) + " " + args;
  return run_sh(with_stderr ? cli : "{ " + cli + " 2>/dev/null; }");  // the inner redirection wins
}

}  // namespace k3::test
