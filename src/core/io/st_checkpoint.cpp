// Checkpoint directories (k3/safetensors.hpp): model.safetensors.index.json with lazily opened
// shards, a folder of *.safetensors files, or one file.
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/io/json_guard.hpp"
#include "k3/harness/atomic_file.hpp"
#include "k3/safetensors.hpp"

namespace k3::st {

namespace fs = std::filesystem;

namespace {

constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr uintmax_t kMaxIndexBytes = 256u << 20;  // a 1M-tensor index is ~150 MB

// A shard named in the index must be a plain file name inside the checkpoint directory.
bool plain_file_name(const std::string& s) {
  return !s.empty() && s != "." && s != ".." && s.find('/') == std::string::npos &&
         s.find('\\') == std::string::npos && s.find('\0') == std::string::npos;
}

}  // namespace

struct Checkpoint::State {
  std::string directory;
  std::string description;                            // for errors: the index file, folder or file
  std::map<std::string, std::string> weight_map;      // tensor -> shard file (relative to directory)
  bool from_index = false;
  mutable std::mutex mu;                              // guards `files`
  mutable std::map<std::string, std::unique_ptr<File>> files;  // shard -> opened file

  Result<const File*> shard(const std::string& file) const {
    std::lock_guard<std::mutex> lock(mu);
    auto it = files.find(file);
    if (it != files.end()) return static_cast<const File*>(it->second.get());
    auto opened = File::open((fs::path(directory) / file).string());
    if (!opened) return opened.status();
    auto& slot = files[file];
    slot = std::make_unique<File>(std::move(opened.value()));
    return static_cast<const File*>(slot.get());
  }
};

Checkpoint::Checkpoint() : state_(std::make_unique<State>()) {}
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;
Checkpoint::~Checkpoint() = default;

namespace {

Status load_index(const fs::path& index_path, std::map<std::string, std::string>* map) {
  const std::string ip = index_path.string();
  K3_RETURN_IF_ERROR(check_input_file("", ip));  // stat before open: a FIFO is refused, not waited on
  std::error_code ec;
  const auto size = fs::file_size(index_path, ec);
  if (ec) return io_error(ip + ": cannot stat: " + ec.message());
  if (size > kMaxIndexBytes) {
    return io_error(ip + ": " + std::to_string(size) + " bytes exceeds the limit of " + std::to_string(kMaxIndexBytes));
  }
  std::ifstream in(index_path, std::ios::binary);
  if (!in) return io_error(ip + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  if (const int depth = detail::json_max_nesting(text); depth > detail::kMaxJsonDepth) {
    return io_error(ip + ": JSON nests " + std::to_string(depth) + " levels deep (limit " +
                    std::to_string(detail::kMaxJsonDepth) + ")");
  }
  nlohmann::json j;
  detail::StrictJsonError err;
  if (!detail::parse_strict_json(text, /*only_spaces=*/false, /*base=*/0, &j, &err)) {
    return io_error(ip + ": " + err.message);
  }
  if (!j.is_object()) return io_error(ip + ": must be a JSON object");
  const auto wm = j.find("weight_map");
  if (wm == j.end()) return io_error(ip + ": missing \"weight_map\"");
  if (!wm->is_object()) return io_error(ip + ": \"weight_map\" must be an object of tensor -> shard file");
  for (const auto& [name, file] : wm->items()) {
    if (!file.is_string() || !plain_file_name(file.get<std::string>())) {
      return io_error(ip + ": tensor '" + st::printable_name(name) + "': shard " + detail::json_quote(file) +
                      " must be a file name inside the checkpoint directory");
    }
    (*map)[name] = file.get<std::string>();
  }
  return Status::ok();
}

}  // namespace

Result<Checkpoint> Checkpoint::open(const std::string& path) {
  try {
    return open_impl(path);
  } catch (const std::exception& e) {  // std::bad_alloc; the filesystem calls here take error_codes
    return io_error(path + ": cannot open checkpoint: " + e.what());
  }
}

Result<Checkpoint> Checkpoint::open_impl(const std::string& path) {
  std::error_code ec;
  const fs::path p(path);
  const auto st = fs::status(p, ec);
  if (ec || !fs::exists(st)) return io_error(path + ": no such file or directory");
  Checkpoint c;
  State& s = *c.state_;

  if (fs::is_regular_file(st)) {
    auto f = File::open(path);
    if (!f) return f.status();
    s.directory = p.has_parent_path() ? p.parent_path().string() : ".";
    s.description = path;
    const std::string name = p.filename().string();
    for (const auto& t : f->tensors()) s.weight_map[t.name] = name;
    s.files[name] = std::make_unique<File>(std::move(f.value()));
    return c;
  }
  if (!fs::is_directory(st)) {
    struct stat ls {};
    const char* kind = ::stat(path.c_str(), &ls) == 0 ? file_kind_name(ls.st_mode) : "not a file";
    return io_error(path + ": is " + std::string(kind) + ", neither a safetensors file nor a checkpoint directory");
  }
  s.directory = path;

  const fs::path index = p / kIndexName;
  if (fs::exists(index, ec)) {
    s.from_index = true;
    s.description = index.string();
    K3_RETURN_IF_ERROR(load_index(index, &s.weight_map));
    std::map<std::string, size_t> per_shard;
    for (const auto& [name, file] : s.weight_map) ++per_shard[file];
    for (const auto& [file, count] : per_shard) {
      struct stat ss {};
      const std::string sp = (p / file).string();
      if (::stat(sp.c_str(), &ss) != 0) {
        return io_error(index.string() + ": shard '" + file + "' (holding " + std::to_string(count) +
                        " tensors) is missing from " + path);
      }
      if (!S_ISREG(ss.st_mode)) {
        return io_error(index.string() + ": shard " + sp + " (holding " + std::to_string(count) + " tensors) is " +
                        file_kind_name(ss.st_mode) + ", not a regular file");
      }
    }
    return c;
  }

  // No index: every *.safetensors file in the folder, opened now.
  std::vector<std::string> shards;
  for (fs::directory_iterator it(p, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().extension() != ".safetensors") continue;
    struct stat ss {};
    const std::string sp = it->path().string();
    if (::stat(sp.c_str(), &ss) == 0 && !S_ISREG(ss.st_mode)) {
      return io_error(path + ": " + sp + " is " + file_kind_name(ss.st_mode) +
                      ", not a regular safetensors file (remove it, or give the checkpoint an index)");
    }
    shards.push_back(it->path().filename().string());
  }
  if (ec) return io_error(path + ": cannot list: " + ec.message());
  if (shards.empty()) return io_error(path + ": holds neither " + kIndexName + " nor any *.safetensors file");
  std::sort(shards.begin(), shards.end());
  s.description = path;
  for (const auto& file : shards) {
    auto f = File::open((p / file).string());
    if (!f) return f.status();
    for (const auto& t : f->tensors()) {
      auto [it, inserted] = s.weight_map.emplace(t.name, file);
      if (!inserted) {
        return io_error(path + ": tensor '" + t.name + "' appears in both " + it->second + " and " + file);
      }
    }
    s.files[file] = std::make_unique<File>(std::move(f.value()));
  }
  return c;
}

Result<std::pair<const File*, const TensorInfo*>> Checkpoint::find(const std::string& name) const {
  const State& s = *state_;
  const auto it = s.weight_map.find(name);
  if (it == s.weight_map.end()) {
    return io_error("tensor '" + name + "' is not in checkpoint " + s.description + " (" +
                    std::to_string(s.weight_map.size()) + " tensors)");
  }
  auto f = s.shard(it->second);
  if (!f) return f.status();
  const TensorInfo* t = f.value()->find(name);
  if (t == nullptr) {
    return io_error("tensor '" + name + "': " + s.description + " maps it to shard '" + it->second +
                    "', which does not hold it");
  }
  return std::pair<const File*, const TensorInfo*>{f.value(), t};
}

bool Checkpoint::contains(const std::string& name) const { return state_->weight_map.count(name) != 0; }

std::vector<std::string> Checkpoint::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(state_->weight_map.size());
  for (const auto& [name, file] : state_->weight_map) names.push_back(name);
  return names;
}

const std::string& Checkpoint::directory() const { return state_->directory; }

std::vector<std::string> Checkpoint::shard_files() const {
  std::vector<std::string> files;
  for (const auto& [name, file] : state_->weight_map) files.push_back(file);
  std::sort(files.begin(), files.end());
  files.erase(std::unique(files.begin(), files.end()), files.end());
  return files;
}

}  // namespace k3::st
