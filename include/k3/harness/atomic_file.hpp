// k3/harness/atomic_file.hpp — the one way k3 writes an output file, and the checks on the paths it
// reads and writes.
//
// Write rules (docs/checkpoints.md, "Output files"):
//   * the output path must be non-empty, must not end in '/', its directory must exist, and if it
//     exists it must be a regular file (a FIFO, device node, directory or socket is refused);
//   * the bytes go to a new temporary file in the destination directory with an unpredictable
//     name (".NAME.k3tmp-XXXXXXXXXXXX", created with O_CREAT | O_EXCL | O_NOFOLLOW, mode 0644
//     minus the umask), so a planted file or symlink can never redirect the write;
//   * every write is checked (short writes are continued, ENOSPC / EIO are errors naming the
//     path and the reason), the file is fsync'ed and rename(2)d onto the path: the rename is the
//     only visible step, so readers and concurrent writers see either the old or one complete new
//     file, never a mix;
//   * on any error, and on SIGINT / SIGTERM / SIGHUP once install_temp_file_cleanup_handlers() ran,
//     the temporary file is removed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "k3/status.hpp"

namespace k3 {

// "a regular file", "a directory", "a FIFO (named pipe)", "a character device", "a block device",
// "a socket", "a symbolic link" for a POSIX st_mode value.
const char* file_kind_name(unsigned mode);

// An input path, checked with stat(2) before anything opens it (so a FIFO never blocks): it must
// exist and be a regular file. `label` names the argument in messages ("--input"; may be empty):
// "--input /tmp/p is a FIFO (named pipe), not a regular file".
Status check_input_file(const std::string& label, const std::string& path);

// An output path (see the rules above), checked without writing anything.
Status check_output_path(const std::string& label, const std::string& path);

// Refuses an output that is the same file as an input: both exist and have the same st_dev and
// st_ino after following symbolic links (so hard links, symlinks and "a/../b" spellings are all
// caught). The message names both arguments, both paths and the resolved path.
Status check_output_not_input(const std::string& out_label, const std::string& out, const std::string& in_label,
                              const std::string& in);

// A file being written atomically. create() makes the temporary file; write() appends; commit()
// syncs and renames it onto the path. Destroying it uncommitted (or any failed call) removes the
// temporary file; after a failed call every later call returns the same error.
class AtomicFile {
 public:
  static Result<AtomicFile> create(const std::string& path, const std::string& label = "");

  AtomicFile(AtomicFile&& other) noexcept;
  AtomicFile& operator=(AtomicFile&& other) noexcept;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  Status write(std::span<const uint8_t> bytes);
  Status write(std::string_view text);
  // fsync, close, check the destination is still absent or a regular file, rename(2) onto it,
  // fsync the directory.
  Status commit();
  // Removes the temporary file (no-op after commit).
  void discard();

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_; }  // "" once committed or discarded
  int64_t bytes_written() const { return written_; }

 private:
  AtomicFile() = default;
  Status fail(const std::string& what, int err);
  std::string where() const;  // "LABEL PATH" or "PATH" for messages

  std::string path_, temp_, label_;
  int fd_ = -1;
  int slot_ = -1;  // entry in the signal-cleanup table, -1 if untracked
  int64_t written_ = 0;
  Status error_;  // sticky error of a failed call
};

// Writes `bytes` / `text` to `path` through an AtomicFile.
Status write_file_atomic(const std::string& path, std::span<const uint8_t> bytes, const std::string& label = "");
Status write_file_atomic(const std::string& path, std::string_view text, const std::string& label = "");

// Installs handlers for SIGINT, SIGTERM and SIGHUP (where they are not ignored) that unlink the
// temporary file of every live AtomicFile, then re-raise the signal with its default action. The
// handler is async-signal-safe: it walks a fixed-size static table of paths (64 entries of up to
// 4095 bytes; a temporary file that does not fit is still removed on every other path).
void install_temp_file_cleanup_handlers();

namespace detail {
// Test hook: replaces write(2) inside AtomicFile (nullptr restores it), to inject short writes
// and errors such as ENOSPC.
using WriteFn = long (*)(int fd, const void* buf, size_t n);
void set_atomic_file_write_for_testing(WriteFn fn);
}  // namespace detail

}  // namespace k3
