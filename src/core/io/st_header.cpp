// safetensors header parsing and validation (k3/safetensors.hpp). Works on an in-memory image
// so that the memory-mapped reader and the fuzz target share exactly one code path.
#include <algorithm>
#include <cstring>
#include <exception>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/io/json_guard.hpp"
#include "k3/safetensors.hpp"

namespace k3::st {

namespace {

struct DTypeEntry {
  DType dtype;
  const char* name;
  int size;
};
constexpr DTypeEntry kDTypes[] = {
    {DType::kBool, "BOOL", 1},   {DType::kU8, "U8", 1},           {DType::kI8, "I8", 1},
    {DType::kU16, "U16", 2},     {DType::kI16, "I16", 2},         {DType::kU32, "U32", 4},
    {DType::kI32, "I32", 4},     {DType::kU64, "U64", 8},         {DType::kI64, "I64", 8},
    {DType::kF16, "F16", 2},     {DType::kBF16, "BF16", 2},       {DType::kF32, "F32", 4},
    {DType::kF64, "F64", 8},     {DType::kF8E4M3, "F8_E4M3", 1},  {DType::kF8E5M2, "F8_E5M2", 1},
};

using Json = nlohmann::json;

std::string num(uint64_t v) { return std::to_string(v); }
std::string num(int64_t v) { return std::to_string(v); }

// A JSON value as int64 if it is an integer in [0, INT64_MAX].
std::optional<int64_t> non_negative_int(const Json& v) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    const auto s = v.get<int64_t>();
    if (s < 0) return std::nullopt;
    return s;
  }
  return std::nullopt;
}

Result<TensorInfo> parse_entry(const std::string& source, const std::string& name, const Json& v,
                               uint64_t data_size) {
  const std::string where = source + ": tensor '" + printable_name(name) + "': ";
  if (!v.is_object()) return io_error(where + "entry must be a JSON object, got " + detail::json_quote(v));
  TensorInfo t;
  t.name = name;

  const auto dt = v.find("dtype");
  if (dt == v.end()) return io_error(where + "missing \"dtype\"");
  if (!dt->is_string()) return io_error(where + "\"dtype\" must be a string, got " + detail::json_quote(*dt));
  auto parsed = parse_dtype(dt->get<std::string>());
  if (!parsed) return io_error(where + parsed.status().message());
  t.dtype = parsed.value();

  const auto sh = v.find("shape");
  if (sh == v.end()) return io_error(where + "missing \"shape\"");
  if (!sh->is_array()) return io_error(where + "\"shape\" must be an array, got " + detail::json_quote(*sh));
  for (size_t i = 0; i < sh->size(); ++i) {
    const auto d = non_negative_int((*sh)[i]);
    if (!d) {
      return io_error(where + "shape[" + num(static_cast<uint64_t>(i)) + "] = " + detail::json_quote((*sh)[i]) +
                      " must be a non-negative integer");
    }
    t.shape.push_back(*d);
  }
  // Byte size with overflow checks; any zero dim makes it 0 however large the others are.
  int64_t want_bytes = 0;
  if (std::find(t.shape.begin(), t.shape.end(), 0) == t.shape.end()) {
    want_bytes = dtype_size(t.dtype);
    for (const int64_t d : t.shape) {
      if (__builtin_mul_overflow(want_bytes, d, &want_bytes)) {
        return io_error(where + "shape " + shape_string(t.shape) + " x " + dtype_name(t.dtype) +
                        " overflows 64-bit byte counts");
      }
    }
  }

  const auto off = v.find("data_offsets");
  if (off == v.end()) return io_error(where + "missing \"data_offsets\"");
  if (!off->is_array() || off->size() != 2) {
    return io_error(where + "\"data_offsets\" must be an array [begin, end], got " + detail::json_quote(*off));
  }
  const auto b = non_negative_int((*off)[0]);
  const auto e = non_negative_int((*off)[1]);
  if (!b || !e) return io_error(where + "data_offsets " + detail::json_quote(*off) + " must be non-negative integers");
  if (*b > *e) {
    return io_error(where + "data_offsets [" + num(*b) + ", " + num(*e) + "] have begin > end");
  }
  if (static_cast<uint64_t>(*e) > data_size) {
    return out_of_range(where + "data_offsets [" + num(*b) + ", " + num(*e) + "] end past the data section of " +
                        num(data_size) + " bytes");
  }
  t.begin = *b;
  t.end = *e;
  if (t.end - t.begin != want_bytes) {
    return io_error(where + "shape " + shape_string(t.shape) + " x " + dtype_name(t.dtype) + " needs " +
                    num(want_bytes) + " bytes but data_offsets [" + num(t.begin) + ", " + num(t.end) + "] hold " +
                    num(t.end - t.begin));
  }
  return t;
}

Status parse_metadata(const std::string& source, const Json& v, std::map<std::string, std::string>* out) {
  if (!v.is_object()) return io_error(source + ": \"__metadata__\" must be an object, got " + detail::json_quote(v));
  for (const auto& [k, val] : v.items()) {
    if (!val.is_string()) {
      return io_error(source + ": \"__metadata__\" entry '" + printable_name(k) + "' must be a string, got " +
                      detail::json_quote(val));
    }
    (*out)[k] = val.get<std::string>();
  }
  return Status::ok();
}

Result<std::vector<TensorInfo>> parse_header_impl(std::span<const uint8_t> image, const std::string& source,
                                                  std::map<std::string, std::string>* metadata) {
  if (image.size() < 8) {
    return io_error(source + ": file is " + num(static_cast<uint64_t>(image.size())) +
                    " bytes, too short for the 8-byte header length (truncated?)");
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | image[static_cast<size_t>(i)];
  const uint64_t file_size = image.size();
  if (header_len > kMaxHeaderBytes) {
    return io_error(source + ": header length " + num(header_len) + " exceeds the limit of " +
                    num(kMaxHeaderBytes) + " bytes");
  }
  if (header_len > file_size - 8) {
    return out_of_range(source + ": header length " + num(header_len) + " runs past the end of the " +
                        num(file_size) + "-byte file (truncated?)");
  }
  if (header_len < 2) return io_error(source + ": header length " + num(header_len) + " is too short for JSON");
  const auto* text_begin = reinterpret_cast<const char*>(image.data() + 8);
  const std::string_view text(text_begin, static_cast<size_t>(header_len));
  const uint64_t data_size = file_size - 8 - header_len;

  if (const int depth = detail::json_max_nesting(text); depth > kMaxJsonDepth) {
    return io_error(source + ": header JSON nests " + std::to_string(depth) + " levels deep (limit " +
                    std::to_string(kMaxJsonDepth) + ")");
  }
  if (const int64_t n = detail::json_top_level_members(text); n > kMaxTensors) {
    return io_error(source + ": header has " + num(n) + " entries, above the limit of " + num(kMaxTensors) +
                    " (kMaxTensors)");
  }
  Json header;
  detail::StrictJsonError err;
  if (!detail::parse_strict_json(text, /*only_spaces=*/true, /*base=*/8, &header, &err)) {
    if (err.duplicate && err.dup.top_key.empty()) {
      return io_error(source + ": tensor '" + printable_name(err.dup.key) + "': name appears more than once (at byte " +
                      num(static_cast<uint64_t>(8 + err.dup.offset)) + ")");
    }
    if (err.duplicate) {
      return io_error(source + ": tensor '" + printable_name(err.dup.top_key) + "': key \"" +
                      printable_name(err.dup.key) + "\" appears more than once (at byte " +
                      num(static_cast<uint64_t>(8 + err.dup.offset)) + ")");
    }
    return io_error(source + ": header " + (err.syntax ? "is " : "") + err.message);
  }
  if (!header.is_object()) {
    return io_error(source + ": header must be a JSON object, got " + std::string(header.type_name()));
  }

  std::vector<TensorInfo> tensors;
  tensors.reserve(header.size());
  std::map<std::string, std::string> meta;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      K3_RETURN_IF_ERROR(parse_metadata(source, v, &meta));
      continue;
    }
    if (name.empty()) return io_error(source + ": a tensor has an empty name");
    auto t = parse_entry(source, name, v, data_size);
    if (!t) return t.status();
    tensors.push_back(std::move(t.value()));
  }

  // File order: ascending data offset. Overlap: a tensor with bytes starting before the end of
  // an earlier one with bytes.
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : (a.end != b.end ? a.end < b.end : a.name < b.name);
  });
  const TensorInfo* reach = nullptr;  // the tensor with bytes reaching furthest so far
  for (const auto& t : tensors) {
    if (t.end == t.begin) continue;
    if (reach != nullptr && t.begin < reach->end) {
      return io_error(source + ": tensor '" + printable_name(t.name) + "': data_offsets [" + num(t.begin) + ", " +
                      num(t.end) + "] overlap tensor '" + printable_name(reach->name) + "' [" + num(reach->begin) +
                      ", " + num(reach->end) + "]");
    }
    if (reach == nullptr || t.end > reach->end) reach = &t;
  }
  if (metadata) *metadata = std::move(meta);
  return tensors;
}

}  // namespace

const char* dtype_name(DType d) {
  for (const auto& e : kDTypes) {
    if (e.dtype == d) return e.name;
  }
  return "?";
}

int dtype_size(DType d) {
  for (const auto& e : kDTypes) {
    if (e.dtype == d) return e.size;
  }
  return 0;
}

Result<DType> parse_dtype(const std::string& name) {
  for (const auto& e : kDTypes) {
    if (name == e.name) return e.dtype;
  }
  std::string known;
  for (const auto& e : kDTypes) known += std::string(known.empty() ? "" : ", ") + e.name;
  std::string shown = name.size() > 32 ? name.substr(0, 29) + "..." : name;
  return io_error("dtype '" + shown + "' is unknown (known: " + known + ")");
}

int64_t TensorInfo::numel() const {
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  int64_t n = 1;
  for (const int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return -1;
  }
  return n;
}

std::string printable_name(std::string_view name) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  out.reserve(name.size());
  const auto esc = [&](unsigned char c) {
    out += "\\x";
    out += hex[c >> 4];
    out += hex[c & 15];
  };
  for (size_t i = 0; i < name.size(); ++i) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c == 0x7f || c == '\\') {
      esc(c);
    } else if (c == 0xC2 && i + 1 < name.size() && static_cast<unsigned char>(name[i + 1]) >= 0x80 &&
               static_cast<unsigned char>(name[i + 1]) <= 0x9F) {  // U+0080-U+009F (C1 controls)
      esc(c);
      esc(static_cast<unsigned char>(name[++i]));
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Result<std::vector<TensorInfo>> parse_header(std::span<const uint8_t> image, const std::string& source,
                                             std::map<std::string, std::string>* metadata) {
  try {
    return parse_header_impl(image, source, metadata);
  } catch (const std::exception& e) {  // std::bad_alloc on a hostile header; nothing else throws
    return io_error(source + ": header could not be parsed: " + e.what());
  }
}

}  // namespace k3::st
