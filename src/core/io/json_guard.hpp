// Guards for parsing untrusted JSON (safetensors headers, model.safetensors.index.json,
// config.json) with nlohmann-json. Its parser is iterative, but serializing a value (dump) recurses,
// so a hostile "[[[[..." could exhaust the stack when an error message quotes it. Every untrusted
// document is therefore depth-checked before parsing, and errors quote values through json_quote.
#pragma once

#include <algorithm>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "k3/safetensors.hpp"

namespace k3::detail {

// Deepest JSON nesting a k3 input may have (a safetensors header needs 3, a config.json ~5).
inline constexpr int kMaxJsonDepth = st::kMaxJsonDepth;

// Deepest bracket nesting outside strings (no full parse; unbalanced input is the parser's business).
inline int json_max_nesting(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == '[' || c == '{') deepest = std::max(deepest, ++depth);
    else if ((c == ']' || c == '}') && depth > 0) --depth;
  }
  return deepest;
}

// A value for an error message, as JSON cut to 40 characters. Only for documents that passed the
// depth check (dump recurses once per nesting level).
inline std::string json_quote(const nlohmann::json& v) {
  std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

}  // namespace k3::detail
