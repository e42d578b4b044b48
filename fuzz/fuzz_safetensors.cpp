// libFuzzer target for the safetensors header parser (k3::st::parse_header): any byte string must
// give either a list of tensors that satisfies every documented invariant or an error naming the
// source, never a crash, a hang or an out-of-bounds read (ASan / UBSan watch the latter).
// Build and run: scripts/fuzz.sh [SECONDS]  (docs/checkpoints.md, "Fuzzing").
#include <cstdint>
#include <cstdlib>
#include <map>
#include <span>
#include <string>

#include "k3/safetensors.hpp"

namespace {

[[noreturn]] void violated(const char* what) {
  __builtin_printf("invariant violated: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> image(data, size);
  std::map<std::string, std::string> metadata;
  auto r = k3::st::parse_header(image, "fuzz.safetensors", &metadata);
  if (!r) {
    const std::string& m = r.status().message();
    if (m.rfind("fuzz.safetensors", 0) != 0) violated("an error message does not start with the file name");
    return 0;
  }
  // A header that parsed: offsets lie in the data section, sizes match shapes, no overlaps, and
  // every byte of every tensor can be read.
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];
  const uint64_t data_size = size - 8 - header_len;
  int64_t prev_end = 0;
  uint32_t sum = 0;
  for (const auto& t : r.value()) {
    if (t.begin < 0 || t.end < t.begin || static_cast<uint64_t>(t.end) > data_size) violated("offsets out of range");
    if (t.end > t.begin) {
      if (t.begin < prev_end) violated("overlapping tensors");
      prev_end = t.end;
    }
    int64_t bytes = k3::st::dtype_size(t.dtype);
    for (const int64_t d : t.shape) {
      if (d < 0) violated("negative dim");
      bytes *= d;  // cannot overflow: the parser checked the product
    }
    if (bytes != t.end - t.begin) violated("shape does not match the byte size");
    const uint8_t* p = data + 8 + header_len + t.begin;
    for (int64_t i = 0; i < t.end - t.begin; ++i) sum += p[i];
  }
  if (sum == 0xFFFFFFFFu) __builtin_printf("%u\n", sum);  // keep the reads
  return 0;
}
