#include "paths.hpp"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "k3/harness/atomic_file.hpp"
#include "k3/safetensors.hpp"

namespace k3::tool {

namespace fs = std::filesystem;

std::vector<std::string> checkpoint_read_files(const std::string& checkpoint) {
  std::vector<std::string> files;
  std::error_code ec;
  const fs::path p(checkpoint);
  if (fs::is_directory(p, ec)) {
    files.push_back((p / "config.json").string());
    files.push_back((p / "model.safetensors.index.json").string());
    if (auto c = st::Checkpoint::open(checkpoint); c.is_ok()) {
      for (const auto& f : c->shard_files()) files.push_back((p / f).string());
    }
    for (fs::directory_iterator it(p, ec), end; !ec && it != end; it.increment(ec)) {
      if (it->path().extension() == ".safetensors") files.push_back(it->path().string());
    }
  } else {
    files.push_back(checkpoint);
    files.push_back(((p.has_parent_path() ? p.parent_path() : fs::path(".")) / "config.json").string());
  }
  return files;
}

Status check_checkpoint_arg(const std::string& label, const std::string& checkpoint) {
  if (checkpoint.empty()) return invalid_argument(label + ": the path is empty");
  struct stat st {};
  if (::stat(checkpoint.c_str(), &st) != 0) {
    return io_error(label + " " + checkpoint + ": cannot open: " + std::strerror(errno));
  }
  if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode)) {
    return invalid_argument(label + " " + checkpoint + " is " + file_kind_name(st.st_mode) +
                            ", neither a safetensors file nor a checkpoint directory");
  }
  return Status::ok();
}

Status check_output_not_checkpoint(const std::string& out_label, const std::string& out, const std::string& checkpoint) {
  for (const auto& f : checkpoint_read_files(checkpoint)) {
    K3_RETURN_IF_ERROR(check_output_not_input(out_label, out, "--checkpoint file", f));
  }
  return Status::ok();
}

}  // namespace k3::tool
