// k3/harness/digest.hpp — SHA-256 digests of output bytes, to compare results bit for bit across
// processes, thread counts and backends without keeping tensors (OpenSSL's EVP).
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace k3 {

// Lower-case hex SHA-256 of the bytes.
std::string sha256_hex(std::span<const uint8_t> bytes);

template <typename T>
std::string sha256_hex_of(std::span<const T> values) {
  return sha256_hex({reinterpret_cast<const uint8_t*>(values.data()), values.size_bytes()});
}

}  // namespace k3
