// Guards for parsing untrusted JSON (safetensors headers, model.safetensors.index.json,
// config.json) with nlohmann-json. Its parser is iterative, but serializing a value (dump) recurses,
// so a hostile "[[[[..." could exhaust the stack when an error message quotes it. Every untrusted
// document is therefore depth-checked before parsing, and errors quote values through json_quote.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <vector>

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

// Top-level members of a JSON object document (colons at depth 1 outside strings); a cheap count
// before building the DOM, so an entry-count limit is enforced before the memory is spent.
inline int64_t json_top_level_members(std::string_view text) {
  int depth = 0;
  int64_t members = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == '[' || c == '{') ++depth;
    else if ((c == ']' || c == '}') && depth > 0) --depth;
    else if (c == ':' && depth == 1) ++members;
  }
  return members;
}

// A byte for an error message: 'x' when printable ASCII, else 0xNN.
inline std::string describe_byte(unsigned char c) {
  if (c >= 0x20 && c < 0x7f) return std::string("'") + static_cast<char>(c) + "'";
  static const char* hex = "0123456789abcdef";
  return std::string("0x") + hex[c >> 4] + hex[c & 15];
}

// The first key that appears twice in one object of `text`, which must be valid JSON (parsed
// already). Keys are compared after unescaping ("a" and "\u0061" are the same key). O(n log n).
struct DuplicateKey {
  bool found = false;
  std::string key;        // the repeated key
  std::string top_key;    // the top-level member it sits in ("" when it is itself top-level)
  size_t offset = 0;      // byte offset of its second occurrence (the opening quote) in `text`
};

namespace json_scan {

inline void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

inline uint32_t hex4(std::string_view t, size_t i) {
  uint32_t v = 0;
  for (size_t k = i; k < i + 4 && k < t.size(); ++k) {
    const char c = t[k];
    v = v * 16 + static_cast<uint32_t>(c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                                              : c >= 'A' && c <= 'F' ? c - 'A' + 10 : 0);
  }
  return v;
}

// Decodes the string starting at the quote t[i]; returns the index after its closing quote.
inline size_t read_string(std::string_view t, size_t i, std::string& out) {
  out.clear();
  ++i;
  while (i < t.size() && t[i] != '"') {
    if (t[i] != '\\') {
      out += t[i++];
      continue;
    }
    if (i + 1 >= t.size()) break;
    const char e = t[i + 1];
    i += 2;
    switch (e) {
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'u': {
        uint32_t cp = hex4(t, i);
        i += 4;
        if (cp >= 0xD800 && cp < 0xDC00 && i + 6 <= t.size() && t[i] == '\\' && t[i + 1] == 'u') {
          const uint32_t lo = hex4(t, i + 2);
          if (lo >= 0xDC00 && lo < 0xE000) {
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            i += 6;
          }
        }
        append_utf8(out, cp);
        break;
      }
      default: out += e; break;  // \" \\ \/
    }
  }
  return i + 1;
}

}  // namespace json_scan

inline DuplicateKey find_duplicate_key(std::string_view text) {
  struct Frame {
    bool object;
    bool expect_key;
    std::set<std::string> keys;
  };
  std::vector<Frame> stack;
  std::string s, top_key;
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (c == '"') {
      const size_t at = i;
      i = json_scan::read_string(text, i, s);
      if (!stack.empty() && stack.back().object && stack.back().expect_key) {
        stack.back().expect_key = false;
        if (!stack.back().keys.insert(s).second) {
          DuplicateKey d;
          d.found = true;
          d.key = s;
          d.top_key = stack.size() == 1 ? std::string() : top_key;
          d.offset = at;
          return d;
        }
        if (stack.size() == 1) top_key = s;
      }
      continue;
    }
    if (c == '{' || c == '[') {
      stack.push_back(Frame{c == '{', c == '{', {}});
    } else if ((c == '}' || c == ']') && !stack.empty()) {
      stack.pop_back();
    } else if (c == ',' && !stack.empty() && stack.back().object) {
      stack.back().expect_key = true;
    }
    ++i;
  }
  return {};
}

// Strict parsing of an untrusted JSON document (a safetensors header, config.json, the shard
// index): besides what nlohmann-json checks, refuses a UTF-8 byte order mark, anything after the
// value other than padding (`only_spaces`: only 0x20, as safetensors pads its header; otherwise
// JSON whitespace) and a key repeated in any object (nlohmann would keep the last one silently).
// The document must pass the depth check first. Errors give the byte offset within `text`; the
// caller adds `base` (where `text` starts in the file) to every offset it reports.
struct StrictJsonError {
  std::string message;  // "... at byte N ..." (N already includes base), without the document's name
  bool syntax = false;     // the parser (or a NUL byte) rejected it: message is "not valid JSON at ..."
  bool duplicate = false;
  DuplicateKey dup;     // when duplicate: the key (offset without base)
};

inline bool parse_strict_json(std::string_view text, bool only_spaces, size_t base, nlohmann::json* out,
                              StrictJsonError* err) {
  const auto at = [&](size_t off) { return "byte " + std::to_string(base + off); };
  if (text.size() >= 3 && static_cast<unsigned char>(text[0]) == 0xEF && static_cast<unsigned char>(text[1]) == 0xBB &&
      static_cast<unsigned char>(text[2]) == 0xBF) {
    err->message = "starts with a UTF-8 byte order mark (EF BB BF at " + at(0) + "); JSON must not have one";
    return false;
  }
  // The value ends at the last byte that is not padding; anything between it and the padding that
  // is not part of the value is reported by the parser (or below, for trailing JSON whitespace).
  size_t end = text.size();
  const auto is_pad = [&](char c) { return c == ' ' || (!only_spaces && (c == '\n' || c == '\r' || c == '\t')); };
  while (end > 0 && is_pad(text[end - 1])) --end;
  const std::string_view body = text.substr(0, end);
  // nlohmann's lexer takes a NUL byte for the end of the input and would ignore what follows it.
  if (const size_t nul = body.find('\0'); nul != std::string_view::npos) {
    err->syntax = true;
    err->message = "not valid JSON at " + at(nul) + " (0x00): a NUL byte";
    return false;
  }
  try {
    *out = nlohmann::json::parse(body.begin(), body.end());
  } catch (const nlohmann::json::parse_error& e) {
    // e.byte counts the characters read, 1-based: the offending byte is e.byte - 1.
    const size_t off = e.byte > 0 ? std::min(static_cast<size_t>(e.byte - 1), body.size()) : 0;
    std::string what = e.what();
    if (const auto p = what.find("syntax error"); p != std::string::npos) what = what.substr(p);
    if (what.size() > 160) what = what.substr(0, 157) + "...";
    err->syntax = true;
    err->message = "not valid JSON at " + at(off) +
                   (off < body.size() ? " (" + describe_byte(static_cast<unsigned char>(body[off])) + ")" : "") + ": " +
                   what;
    return false;
  }
  if (only_spaces && end > 0) {
    // nlohmann accepts trailing JSON whitespace; safetensors pads with spaces only.
    const char last = body.back();
    if (last == '\n' || last == '\r' || last == '\t') {
      size_t off = end;
      const auto ws = [](char c) { return c == '\n' || c == '\r' || c == '\t' || c == ' '; };
      while (off > 0 && ws(body[off - 1])) --off;
      err->message = "has " + describe_byte(static_cast<unsigned char>(body[off])) + " at " + at(off) +
                     " after the JSON value (only spaces may pad it)";
      return false;
    }
  }
  if (const DuplicateKey d = find_duplicate_key(body); d.found) {
    err->duplicate = true;
    err->dup = d;
    err->message = "key \"" + st::printable_name(d.key) + "\"" +
                   (d.top_key.empty() ? "" : " inside \"" + st::printable_name(d.top_key) + "\"") +
                   " appears more than once (second at " + at(d.offset) + ")";
    return false;
  }
  return true;
}

}  // namespace k3::detail
