// Memory-mapped safetensors reader (k3/safetensors.hpp): POSIX open + fstat + mmap, read-only and
// private; every tensor view is a span into the mapping (zero copy).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "k3/harness/atomic_file.hpp"
#include "k3/safetensors.hpp"

namespace k3::st {

namespace {

// Closes a descriptor on every return path of File::open.
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

Result<File> File::open(const std::string& path) {
  // stat first and open with O_NONBLOCK: a FIFO (or a device) is refused at once, never waited on.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return io_error(path + ": cannot open: " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) {
    return io_error(path + ": is " + file_kind_name(st.st_mode) + ", not a regular file");
  }
  FdGuard fd{::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY)};
  if (fd.fd < 0) return io_error(path + ": cannot open: " + std::strerror(errno));
  if (::fstat(fd.fd, &st) != 0) return io_error(path + ": cannot stat: " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) {  // replaced between stat and open
    return io_error(path + ": is " + file_kind_name(st.st_mode) + ", not a regular file");
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    return io_error(path + ": file is " + std::to_string(size) +
                    " bytes, too short for the 8-byte header length (truncated?)");
  }
  void* map = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_PRIVATE, fd.fd, 0);
  if (map == MAP_FAILED) return io_error(path + ": mmap of " + std::to_string(size) + " bytes failed: " + std::strerror(errno));

  File f;
  f.path_ = path;
  f.map_ = static_cast<const uint8_t*>(map);
  f.owns_map_ = true;
  f.size_ = size;
  K3_RETURN_IF_ERROR(f.index_image());  // on error f's destructor unmaps
  return f;
}

Result<File> File::view(std::span<const uint8_t> image, const std::string& source) {
  if (image.size() < 8) {
    return io_error(source + ": file is " + std::to_string(image.size()) +
                    " bytes, too short for the 8-byte header length (truncated?)");
  }
  File f;
  f.path_ = source;
  f.map_ = image.data();
  f.owns_map_ = false;
  f.size_ = image.size();
  K3_RETURN_IF_ERROR(f.index_image());
  return f;
}

Status File::index_image() {
  auto parsed = parse_header(std::span<const uint8_t>(map_, static_cast<size_t>(size_)), path_, &metadata_);
  if (!parsed) return parsed.status();
  tensors_ = std::move(parsed.value());
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | map_[i];
  data_start_ = 8 + header_len;
  for (size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  return Status::ok();
}

File::File(File&& other) noexcept { *this = std::move(other); }

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    map_ = other.map_;
    owns_map_ = other.owns_map_;
    size_ = other.size_;
    data_start_ = other.data_start_;
    tensors_ = std::move(other.tensors_);
    index_ = std::move(other.index_);
    metadata_ = std::move(other.metadata_);
    other.map_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

File::~File() { release(); }

void File::release() {
  if (map_ != nullptr && owns_map_) ::munmap(const_cast<uint8_t*>(map_), static_cast<size_t>(size_));
  map_ = nullptr;
  owns_map_ = false;
  size_ = 0;
}

const TensorInfo* File::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::span<const uint8_t> File::bytes(const TensorInfo& t) const {
  // Offsets were validated against the file size at open; re-check so that a TensorInfo from
  // another file can never produce an out-of-bounds view.
  if (map_ == nullptr || t.begin < 0 || t.end < t.begin ||
      data_start_ + static_cast<uint64_t>(t.end) > size_) {
    return {};
  }
  return {map_ + data_start_ + static_cast<uint64_t>(t.begin), static_cast<size_t>(t.end - t.begin)};
}

}  // namespace k3::st
