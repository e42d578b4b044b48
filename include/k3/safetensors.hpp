// k3/safetensors.hpp — the safetensors format: a validating parser, a memory-mapped reader with
// zero-copy views, a writer, and sharded checkpoint directories (model.safetensors.index.json).
//
// File layout: 8-byte little-endian u64 header length H, then H bytes of UTF-8 JSON
//   {"name": {"dtype": "U8", "shape": [r, c], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value", ...}}
// then the data section; offsets are relative to its start, end exclusive.
//
// Validation (every failure is an error naming the file, the tensor and the problem; bad input
// never crashes or reads out of bounds):
//   * the file holds at least the 8-byte length, H <= kMaxHeaderBytes and 8 + H <= file size;
//   * the header is valid JSON (nesting depth <= kMaxJsonDepth), an object of at most kMaxTensors
//     entries, without a UTF-8 byte order mark, a key repeated in any object, or anything after
//     the JSON but space padding (errors give the byte offset in the file); "__metadata__" is an
//     object of strings;
//   * each tensor has a known dtype, a shape of non-negative integers whose byte size does not
//     overflow and equals end - begin, and 0 <= begin <= end <= data section size;
//   * no two tensors with bytes overlap (gaps are allowed, zero-size tensors may sit anywhere).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "k3/status.hpp"

namespace k3::st {

// Largest JSON header accepted (the reference Rust implementation uses the same 100 MB bound).
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Most entries (tensors, plus "__metadata__") one header may have: above a whole Kimi-K3
// checkpoint in one file (~560 000 tensors). Counted before the JSON is parsed into memory.
inline constexpr int64_t kMaxTensors = 1'000'000;
// Deepest JSON nesting accepted; a safetensors header needs 3 (object / tensor / shape).
inline constexpr int kMaxJsonDepth = 64;

enum class DType : uint8_t { kBool, kU8, kI8, kU16, kI16, kU32, kI32, kU64, kI64, kF16, kBF16, kF32, kF64,
                             kF8E4M3, kF8E5M2 };
const char* dtype_name(DType d);  // safetensors spelling: "BOOL","U8",...,"BF16","F32","F8_E4M3","F8_E5M2"
int dtype_size(DType d);          // bytes per element
// "U8" -> kU8; an unknown spelling is an error listing the known ones.
Result<DType> parse_dtype(const std::string& name);

struct TensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // data_offsets, relative to the data section, end exclusive
  // Product of the dims (1 for a scalar, 0 when a dim is 0); -1 when it overflows int64, which
  // never happens for a tensor from parse_header (its byte size is checked).
  int64_t numel() const;
  int64_t nbytes() const { return end - begin; }
};

// A tensor name (or any file-supplied string) safe to print: control bytes (0x00-0x1f, 0x7f), the
// C1 controls U+0080-U+009F and backslash become \xNN, so a name cannot move the cursor, clear the
// screen or fake another line; everything else (UTF-8 included) is kept.
std::string printable_name(std::string_view name);

// "[3072, 1792]"
std::string shape_string(const std::vector<int64_t>& shape);

// Parses an in-memory safetensors image (used by File::open and by the fuzz target). `source`
// names the file in error messages. Tensors come back in file order (ascending data offset, then
// name). The image must hold the whole file: offsets are checked against its size.
Result<std::vector<TensorInfo>> parse_header(std::span<const uint8_t> image, const std::string& source,
                                             std::map<std::string, std::string>* metadata = nullptr);

// A memory-mapped .safetensors file; views are zero-copy and live as long as the File (moving a
// File keeps them valid). Truncating the file on disk while it is mapped is outside the contract.
class File {
 public:
  static Result<File> open(const std::string& path);  // validates everything (see above)
  // A File over an in-memory image (validated like open; `source` names it in messages). The
  // bytes are not copied: they must outlive the File. Used by the fuzz targets and tests.
  static Result<File> view(std::span<const uint8_t> image, const std::string& source);
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in file order
  const TensorInfo* find(const std::string& name) const;               // nullptr if absent
  std::span<const uint8_t> bytes(const TensorInfo& t) const;           // the tensor's raw bytes
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }
  uint64_t file_size() const { return size_; }

 private:
  File() = default;
  void release();
  Status index_image();  // parses the header of map_[0, size_) into tensors_ / index_ / metadata_

  std::string path_;
  const uint8_t* map_ = nullptr;  // whole file, PROT_READ (or the caller's image: see owns_map_)
  bool owns_map_ = false;         // true: map_ is an mmap of the file, unmapped by the destructor
  uint64_t size_ = 0;
  uint64_t data_start_ = 0;       // 8 + header length
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

// Builds a safetensors file. Tensors are written contiguously in the order they were added (no
// gaps: the reference implementation rejects them); the header is padded with spaces so that the
// data section starts at a multiple of 8 bytes.
class Writer {
 public:
  // Fills `out` (exactly the tensor's byte size) when the file is written; lets a caller stream
  // tensors far larger than memory without holding them all.
  using Fill = std::function<Status(std::span<uint8_t> out)>;

  // Copies `bytes`; size must equal numel * dtype_size. Names must be unique and non-empty.
  Status add(const std::string& name, DType dtype, std::vector<int64_t> shape, std::span<const uint8_t> bytes);
  // Defers the bytes to write(): `fill` is called once, in order, with a buffer of the tensor's size.
  Status add_deferred(const std::string& name, DType dtype, std::vector<int64_t> shape, Fill fill);
  void set_metadata(std::map<std::string, std::string> m) { metadata_ = std::move(m); }
  // Header + data, written through k3::AtomicFile (k3/harness/atomic_file.hpp): a uniquely named
  // temporary file in the destination directory, fsync'ed and renamed onto `path`, so a failed or
  // interrupted write leaves no partial file and a concurrent reader sees the old or the new file.
  // `label` names the argument in messages ("--output"; may be empty).
  Status write(const std::string& path, const std::string& label = "") const;

  size_t size() const { return entries_.size(); }
  int64_t data_bytes() const;  // bytes of the data section

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    int64_t nbytes;
    std::vector<uint8_t> bytes;  // empty when `fill` is set
    Fill fill;
  };
  Status check_new(const std::string& name, DType dtype, const std::vector<int64_t>& shape, int64_t* nbytes) const;
  Status write_unchecked(const std::string& path, const std::string& label) const;

  std::vector<Entry> entries_;
  std::set<std::string> names_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint: a directory with model.safetensors.index.json (weight_map: tensor -> shard
// file, shards opened lazily and kept open), a directory of *.safetensors files (all opened;
// a name in two files is an error), or a single .safetensors file. Thread-safe for concurrent
// find() calls.
class Checkpoint {
 public:
  static Result<Checkpoint> open(const std::string& path);  // directory or single file
  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;
  ~Checkpoint();

  // The file holding `name` and its entry; the error names the tensor and the checkpoint (or the
  // shard that failed to open or does not hold it).
  Result<std::pair<const File*, const TensorInfo*>> find(const std::string& name) const;
  bool contains(const std::string& name) const;
  std::vector<std::string> tensor_names() const;  // sorted
  // The directory (for a single file: the folder holding it; config.json is looked up there).
  const std::string& directory() const;
  // Shard file names relative to directory(), sorted.
  std::vector<std::string> shard_files() const;

 private:
  struct State;
  Checkpoint();
  static Result<Checkpoint> open_impl(const std::string& path);
  std::unique_ptr<State> state_;
};

}  // namespace k3::st
