// Replays the fuzzing seed corpus (tests/data/safetensors_corpus, plus any crashers added after a
// fuzzing run) through the parser: valid_* files parse, bad_* files give the expected error, and
// nothing crashes (this test also runs under ASan + UBSan).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>

#include "k3/safetensors.hpp"

namespace k3::st {
namespace {

// What the error of each generated malformed file must say (files not listed only need an error).
const std::map<std::string, std::string> kExpected = {
    {"bad_truncated_length", "5 bytes, too short for the 8-byte header length"},
    {"bad_empty", "0 bytes, too short"},
    {"bad_truncated_data", "tensor 'w': data_offsets [0, 16] end past the data section of 10 bytes"},
    {"bad_header_past_end", "header length 4000 runs past the end"},
    {"bad_absurd_header", "header length 200000000 exceeds the limit of 100000000 bytes"},
    {"bad_huge_header_u64", "exceeds the limit"},
    {"bad_invalid_json", "header is not valid JSON"},
    {"bad_invalid_utf8", "header is not valid JSON"},
    {"bad_non_object", "header must be a JSON object, got array"},
    {"bad_unknown_dtype", "tensor 'w': dtype 'F4' is unknown"},
    {"bad_dtype_not_string", "tensor 'w': \"dtype\" must be a string"},
    {"bad_offsets_out_of_range", "tensor 'w': data_offsets [8, 12] end past the data section of 8 bytes"},
    {"bad_offsets_begin_after_end", "tensor 'w': data_offsets [6, 4] have begin > end"},
    {"bad_offsets_negative", "tensor 'w': data_offsets [-1,0] must be non-negative integers"},
    {"bad_offsets_overlap", "tensor 'b': data_offsets [6, 10] overlap tensor 'a' [0, 8]"},
    {"bad_offsets_contained", "tensor 'b': data_offsets [2, 4] overlap tensor 'a' [0, 12]"},
    {"bad_shape_size_mismatch", "tensor 'w': shape [2, 3] x BF16 needs 12 bytes but data_offsets [0, 8] hold 8"},
    {"bad_shape_overflow", "overflows 64-bit byte counts"},
    {"bad_negative_dim", "tensor 'w': shape[0] = -2 must be a non-negative integer"},
    {"bad_float_dim", "tensor 'w': shape[0] = 1.5 must be a non-negative integer"},
    {"bad_duplicate_names", "tensor 'w': name appears more than once"},
    {"bad_missing_offsets", "tensor 'w': missing \"data_offsets\""},
    {"bad_metadata_not_strings", "\"__metadata__\" entry 'k' must be a string"},
    {"bad_entry_not_object", "tensor 'w': entry must be a JSON object"},
    {"bad_deep_nesting", "nests 200 levels deep (limit 64)"},
    {"bad_bom", "header starts with a UTF-8 byte order mark (EF BB BF at byte 8)"},
    {"bad_duplicate_key_in_entry", "tensor 'w': key \"dtype\" appears more than once (at byte 27)"},
    {"bad_trailing_nul", "header is not valid JSON at byte 10 (0x00): a NUL byte"},
    {"bad_trailing_garbage", "header is not valid JSON at byte 11 ('x')"},
    {"bad_trailing_newline", "header has 0x0a at byte 10 after the JSON value (only spaces may pad it)"},
};

TEST(SafetensorsCorpus, ReplaysEveryFile) {
  const std::filesystem::path dir = std::filesystem::path(K3_TEST_DATA_DIR) / "safetensors_corpus";
  ASSERT_TRUE(std::filesystem::is_directory(dir)) << dir;
  int valid = 0, bad = 0;
  std::set<std::string> seen;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string stem = entry.path().stem().string();
    std::ifstream in(entry.path(), std::ios::binary);
    const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string source = entry.path().filename().string();
    auto r = parse_header(bytes, source);
    seen.insert(stem);
    if (stem.rfind("valid_", 0) == 0) {
      ++valid;
      EXPECT_TRUE(r) << source << ": " << r.status().to_string();
    } else {
      ++bad;
      ASSERT_FALSE(r) << source << " parsed but is malformed";
      EXPECT_EQ(r.status().message().rfind(source + ": ", 0), 0u) << "the error names the file: " << r.status().message();
      if (auto it = kExpected.find(stem); it != kExpected.end()) {
        EXPECT_NE(r.status().message().find(it->second), std::string::npos)
            << source << ": " << r.status().message() << "\n  expected: " << it->second;
      }
    }
    // The mapped reader agrees with the in-memory parser on every file.
    auto f = File::open(entry.path().string());
    EXPECT_EQ(f.is_ok(), r.is_ok()) << source;
  }
  for (const auto& [stem, msg] : kExpected) EXPECT_TRUE(seen.count(stem)) << stem << " is missing from the corpus";
  EXPECT_GE(valid, 5);
  EXPECT_GE(bad, static_cast<int>(kExpected.size()));
}

}  // namespace
}  // namespace k3::st
