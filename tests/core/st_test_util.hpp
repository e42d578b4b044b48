// Test helpers for safetensors / checkpoint tests: a unique temporary directory removed at the end
// of the test, and hand-built safetensors images.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace k3::test {

class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("k3_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// 8-byte little-endian header length + header text + data.
inline std::vector<uint8_t> st_image(const std::string& header, const std::vector<uint8_t>& data = {},
                                     uint64_t header_len_override = UINT64_MAX) {
  const uint64_t n = header_len_override == UINT64_MAX ? header.size() : header_len_override;
  std::vector<uint8_t> img;
  for (int i = 0; i < 8; ++i) img.push_back(static_cast<uint8_t>(n >> (8 * i)));
  img.insert(img.end(), header.begin(), header.end());
  img.insert(img.end(), data.begin(), data.end());
  return img;
}

inline void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

}  // namespace k3::test
