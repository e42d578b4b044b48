// Atomic output files and path checks (k3/harness/atomic_file.hpp).
#include "k3/harness/atomic_file.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <random>

namespace k3 {

namespace {

std::string where_of(const std::string& label, const std::string& path) {
  return label.empty() ? path : label + " " + path;
}

std::string errno_text(int err) { return std::strerror(err); }

// Directory part of a path ("." for a bare name, "/" for "/name") and the last component.
struct SplitPath {
  std::string dir, base;
};

SplitPath split_path(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return {std::string(1, '.'), path};
  return {slash == 0 ? std::string(1, '/') : path.substr(0, slash), path.substr(slash + 1)};
}

// ---- signal-cleanup table ----------------------------------------------------------------------
// Slots hold the temporary paths of live AtomicFiles. state: 0 free, 1 being filled, 2 live. The
// handler only reads live slots and only calls unlink(2), signal(2) and raise(3).
constexpr int kSlots = 64;
constexpr size_t kSlotPathBytes = 4096;

struct Slot {
  std::atomic<int> state;
  char path[kSlotPathBytes];
};
Slot g_slots[kSlots];  // static storage: zero-initialized (all free)
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs lock-free atomics");

int track(const std::string& temp) {
  if (temp.size() >= kSlotPathBytes) return -1;
  for (int i = 0; i < kSlots; ++i) {
    int expected = 0;
    if (g_slots[i].state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
      std::memcpy(g_slots[i].path, temp.c_str(), temp.size() + 1);
      g_slots[i].state.store(2, std::memory_order_release);
      return i;
    }
  }
  return -1;  // table full: this file is still removed on every non-signal path
}

void untrack(int slot) {
  if (slot >= 0) g_slots[slot].state.store(0, std::memory_order_release);
}

extern "C" void k3_temp_cleanup_handler(int sig) {
  const int saved = errno;
  for (int i = 0; i < kSlots; ++i) {
    if (g_slots[i].state.load(std::memory_order_acquire) == 2) ::unlink(g_slots[i].path);
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);  // delivered with the default action once the handler returns
  errno = saved;
}

// ---- write(2) hook for tests -------------------------------------------------------------------
std::atomic<detail::WriteFn> g_write_hook{nullptr};

long do_write(int fd, const void* buf, size_t n) {
  if (const detail::WriteFn hook = g_write_hook.load(std::memory_order_acquire)) return hook(fd, buf, n);
  return static_cast<long>(::write(fd, buf, n));
}

// 12 hex digits from a per-thread generator seeded with the OS entropy source, pid and clock.
std::string random_suffix() {
  thread_local std::mt19937_64 rng = [] {
    std::random_device rd;
    const uint64_t t = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    std::seed_seq seq{rd(), rd(), static_cast<unsigned>(::getpid()), static_cast<unsigned>(t), static_cast<unsigned>(t >> 32)};
    return std::mt19937_64(seq);
  }();
  static const char kHex[] = "0123456789abcdef";
  uint64_t v = rng();
  std::string s(12, '0');
  for (char& c : s) {
    c = kHex[v & 15u];
    v >>= 4;
  }
  return s;
}

}  // namespace

const char* file_kind_name(unsigned mode) {
  const auto m = static_cast<mode_t>(mode);
  if (S_ISREG(m)) return "a regular file";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISLNK(m)) return "a symbolic link";
  return "a file of unknown type";
}

Status check_input_file(const std::string& label, const std::string& path) {
  if (path.empty()) return invalid_argument((label.empty() ? std::string("input") : label) + ": the path is empty");
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return io_error(where_of(label, path) + ": cannot open: " + errno_text(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    return invalid_argument(where_of(label, path) + " is " + file_kind_name(st.st_mode) + ", not a regular file");
  }
  return Status::ok();
}

Status check_output_path(const std::string& label, const std::string& path) {
  const std::string w = where_of(label, path);
  if (path.empty()) {
    return invalid_argument((label.empty() ? std::string("output") : label) + ": the path is empty; give a file to write");
  }
  if (path.back() == '/') {
    return invalid_argument(w + " ends in '/', which names a directory; give a file path");
  }
  const auto [dir, base] = split_path(path);
  if (base == "." || base == "..") return invalid_argument(w + " names a directory; give a file path");
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode)) {
      return invalid_argument(w + " exists and is " + std::string(file_kind_name(st.st_mode)) +
                              ", not a regular file; k3 only replaces regular files");
    }
    return Status::ok();
  }
  const int err = errno;
  if (err != ENOENT) return io_error(w + ": cannot stat: " + errno_text(err));
  struct stat ds {};
  if (::stat(dir.c_str(), &ds) != 0) {
    return io_error(w + ": cannot create a file there: directory " + dir + ": " + errno_text(errno));
  }
  if (!S_ISDIR(ds.st_mode)) {
    return invalid_argument(w + ": cannot create a file there: " + dir + " is " + file_kind_name(ds.st_mode) +
                            ", not a directory");
  }
  return Status::ok();
}

Status check_output_not_input(const std::string& out_label, const std::string& out, const std::string& in_label,
                              const std::string& in) {
  struct stat so {}, si {};
  if (out.empty() || in.empty() || ::stat(out.c_str(), &so) != 0 || ::stat(in.c_str(), &si) != 0) {
    return Status::ok();  // an output that does not exist yet cannot be an input
  }
  if (so.st_dev != si.st_dev || so.st_ino != si.st_ino) return Status::ok();
  std::string resolved = in;
  if (char* r = ::realpath(in.c_str(), nullptr)) {
    resolved = r;
    std::free(r);
  }
  return invalid_argument(where_of(out_label, out) + " is the same file as " + where_of(in_label, in) + " (" +
                          resolved + "); writing it would destroy the input, choose another output path");
}

// ---- AtomicFile --------------------------------------------------------------------------------

Result<AtomicFile> AtomicFile::create(const std::string& path, const std::string& label) {
  K3_RETURN_IF_ERROR(check_output_path(label, path));
  const auto [dir, base] = split_path(path);
  // Keep the temporary name within NAME_MAX (255): "." + base + ".k3tmp-" + 12 hex digits.
  const std::string stem = base.size() > 200 ? base.substr(0, 200) : base;
  AtomicFile f;
  f.path_ = path;
  f.label_ = label;
  for (int attempt = 0; attempt < 100; ++attempt) {
    const std::string temp = (dir == "/" ? std::string("/") : dir + "/") + "." + stem + ".k3tmp-" + random_suffix();
    const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0) {
      f.fd_ = fd;
      f.temp_ = temp;
      f.slot_ = track(temp);
      return f;
    }
    if (errno != EEXIST) {
      return io_error(where_of(label, path) + ": cannot create a temporary file in " + dir + ": " + errno_text(errno));
    }
  }
  return io_error(where_of(label, path) + ": cannot create a temporary file in " + dir +
                  ": 100 unique names were all taken");
}

AtomicFile::AtomicFile(AtomicFile&& other) noexcept { *this = std::move(other); }

AtomicFile& AtomicFile::operator=(AtomicFile&& other) noexcept {
  if (this != &other) {
    discard();
    path_ = std::move(other.path_);
    temp_ = std::move(other.temp_);
    label_ = std::move(other.label_);
    fd_ = other.fd_;
    slot_ = other.slot_;
    written_ = other.written_;
    error_ = std::move(other.error_);
    other.temp_.clear();
    other.fd_ = -1;
    other.slot_ = -1;
  }
  return *this;
}

AtomicFile::~AtomicFile() { discard(); }

std::string AtomicFile::where() const { return where_of(label_, path_); }

void AtomicFile::discard() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!temp_.empty()) ::unlink(temp_.c_str());
  temp_.clear();
  untrack(slot_);
  slot_ = -1;
}

Status AtomicFile::fail(const std::string& what, int err) {
  const std::string temp = temp_;
  discard();
  error_ = io_error(where() + ": " + what + " (temporary file " + temp + ", removed): " + errno_text(err));
  return error_;
}

Status AtomicFile::write(std::span<const uint8_t> bytes) {
  if (!error_.is_ok()) return error_;
  if (fd_ < 0) return io_error(where() + ": write after the file was committed or discarded");
  const uint8_t* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    const long n = do_write(fd_, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      return fail("write failed after " + std::to_string(written_) + " bytes", err);
    }
    if (n == 0) return fail("write made no progress after " + std::to_string(written_) + " bytes", EIO);
    p += n;
    left -= static_cast<size_t>(n);
    written_ += n;
  }
  return Status::ok();
}

Status AtomicFile::write(std::string_view text) {
  return write(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

Status AtomicFile::commit() {
  if (!error_.is_ok()) return error_;
  if (fd_ < 0) return io_error(where() + ": commit after the file was committed or discarded");
  if (::fsync(fd_) != 0) return fail("fsync failed", errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return fail("close failed", errno);
  // The destination may have changed since create(): never rename over a non-regular file.
  struct stat st {};
  if (::stat(path_.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    const std::string temp = temp_;
    discard();
    error_ = invalid_argument(where() + " now exists and is " + std::string(file_kind_name(st.st_mode)) +
                              ", not a regular file; k3 only replaces regular files (temporary file " + temp +
                              ", removed)");
    return error_;
  }
  if (::rename(temp_.c_str(), path_.c_str()) != 0) return fail("cannot rename the temporary file onto it", errno);
  temp_.clear();
  untrack(slot_);
  slot_ = -1;
  // Make the rename durable; some file systems refuse fsync on a directory, which is harmless.
  const std::string dir = split_path(path_).dir;
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
  return Status::ok();
}

Status write_file_atomic(const std::string& path, std::span<const uint8_t> bytes, const std::string& label) {
  auto f = AtomicFile::create(path, label);
  if (!f.is_ok()) return f.status();
  K3_RETURN_IF_ERROR(f->write(bytes));
  return f->commit();
}

Status write_file_atomic(const std::string& path, std::string_view text, const std::string& label) {
  return write_file_atomic(path, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()),
                           label);
}

void install_temp_file_cleanup_handlers() {
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction old {};
    if (::sigaction(sig, nullptr, &old) != 0) continue;
    if (old.sa_handler == SIG_IGN) continue;  // e.g. under nohup: keep ignoring
    struct sigaction sa {};
    sa.sa_handler = k3_temp_cleanup_handler;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;
    ::sigaction(sig, &sa, nullptr);
  }
}

namespace detail {
void set_atomic_file_write_for_testing(WriteFn fn) { g_write_hook.store(fn, std::memory_order_release); }
}  // namespace detail

}  // namespace k3
