// safetensors writer (k3/safetensors.hpp): header JSON in insertion order, padded with spaces to a
// multiple of 8, then the tensors back to back. Written through k3::AtomicFile (a unique
// temporary file in the destination directory, fsync'ed, then renamed).
#include <nlohmann/json.hpp>
#include <string_view>

#include "k3/harness/atomic_file.hpp"
#include "k3/safetensors.hpp"

namespace k3::st {

namespace {

// Fixed-size chunks for deferred tensors keep memory bounded for multi-GB files.
constexpr int64_t kChunkCap = int64_t{1} << 30;

// The header is JSON: names and metadata must be valid UTF-8 (nlohmann's dump would throw).
bool valid_utf8(const std::string& s) {
  try {
    (void)nlohmann::json(s).dump();
    return true;
  } catch (const nlohmann::json::exception&) {
    return false;
  }
}

}  // namespace

Status Writer::check_new(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                         int64_t* nbytes) const {
  if (name.empty()) return invalid_argument("safetensors writer: tensor name must not be empty");
  if (name == "__metadata__") return invalid_argument("safetensors writer: '__metadata__' is reserved");
  if (names_.count(name)) return invalid_argument("safetensors writer: tensor '" + printable_name(name) + "' added twice");
  if (!valid_utf8(name)) return invalid_argument("safetensors writer: a tensor name is not valid UTF-8");
  int64_t n = dtype_size(dtype);
  if (n == 0) return invalid_argument("safetensors writer: tensor '" + printable_name(name) + "': unknown dtype");
  for (const int64_t d : shape) {
    if (d < 0) {
      return invalid_argument("safetensors writer: tensor '" + printable_name(name) + "': shape " + shape_string(shape) +
                              " has a negative dim");
    }
    if (__builtin_mul_overflow(n, d, &n)) {
      return invalid_argument("safetensors writer: tensor '" + printable_name(name) + "': shape " + shape_string(shape) +
                              " overflows 64-bit byte counts");
    }
  }
  *nbytes = n;
  return Status::ok();
}

Status Writer::add(const std::string& name, DType dtype, std::vector<int64_t> shape, std::span<const uint8_t> bytes) {
  int64_t nbytes = 0;
  K3_RETURN_IF_ERROR(check_new(name, dtype, shape, &nbytes));
  if (static_cast<int64_t>(bytes.size()) != nbytes) {
    return invalid_argument("safetensors writer: tensor '" + printable_name(name) + "': shape " + shape_string(shape) + " x " +
                            dtype_name(dtype) + " needs " + std::to_string(nbytes) + " bytes, got " +
                            std::to_string(bytes.size()));
  }
  entries_.push_back({name, dtype, std::move(shape), nbytes, std::vector<uint8_t>(bytes.begin(), bytes.end()), {}});
  names_.insert(name);
  return Status::ok();
}

Status Writer::add_deferred(const std::string& name, DType dtype, std::vector<int64_t> shape, Fill fill) {
  int64_t nbytes = 0;
  K3_RETURN_IF_ERROR(check_new(name, dtype, shape, &nbytes));
  if (!fill) return invalid_argument("safetensors writer: tensor '" + printable_name(name) + "': empty fill function");
  if (nbytes > kChunkCap) {
    return invalid_argument("safetensors writer: deferred tensor '" + printable_name(name) + "' of " + std::to_string(nbytes) +
                            " bytes exceeds the " + std::to_string(kChunkCap) + "-byte limit of one fill");
  }
  entries_.push_back({name, dtype, std::move(shape), nbytes, {}, std::move(fill)});
  names_.insert(name);
  return Status::ok();
}

int64_t Writer::data_bytes() const {
  int64_t total = 0;
  for (const auto& e : entries_) total += e.nbytes;
  return total;
}

Status Writer::write(const std::string& path, const std::string& label) const {
  try {
    return write_unchecked(path, label);
  } catch (const std::exception& e) {  // std::bad_alloc and the like; nothing crosses the API
    // (an AtomicFile being unwound removes its temporary file)
    return io_error((label.empty() ? path : label + " " + path) + ": write failed: " + e.what());
  }
}

Status Writer::write_unchecked(const std::string& path, const std::string& label) const {
  for (const auto& [k, v] : metadata_) {
    if (!valid_utf8(k) || !valid_utf8(v)) return invalid_argument("safetensors writer: metadata is not valid UTF-8");
  }
  // Header: keys in insertion order (ordered_json), "__metadata__" first when present.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  int64_t offset = 0;
  for (const auto& e : entries_) {
    header[e.name] = {{"dtype", dtype_name(e.dtype)}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.nbytes}}};
    offset += e.nbytes;
  }
  std::string text = header.dump();
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');  // data section starts 8-byte aligned
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));

  auto file = AtomicFile::create(path, label);
  if (!file.is_ok()) return file.status();
  AtomicFile& f = file.value();  // removes its temporary file on every early return
  K3_RETURN_IF_ERROR(f.write(std::span<const uint8_t>(len, 8)));
  K3_RETURN_IF_ERROR(f.write(std::string_view(text)));
  std::vector<uint8_t> chunk;
  for (const auto& e : entries_) {
    if (!e.fill) {
      K3_RETURN_IF_ERROR(f.write(std::span<const uint8_t>(e.bytes)));
      continue;
    }
    chunk.assign(static_cast<size_t>(e.nbytes), 0);
    K3_RETURN_IF_ERROR(e.fill(chunk));
    K3_RETURN_IF_ERROR(f.write(std::span<const uint8_t>(chunk)));
  }
  return f.commit();
}

}  // namespace k3::st
