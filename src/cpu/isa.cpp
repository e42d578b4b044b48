// Runtime ISA selection for the CPU kernels. The kernels default to best_isa_level();
// active_isa_level() reads K3_ISA for tools, which pass the level explicitly.
#include <cstdlib>
#include <string>

#include "k3/system.hpp"

namespace k3 {

const char* isa_level_name(IsaLevel level) {
  switch (level) {
    case IsaLevel::kScalar: return "scalar";
    case IsaLevel::kAvx2: return "avx2";
    case IsaLevel::kAvx512: return "avx512";
    case IsaLevel::kAvx512Bf16: return "avx512bf16";
  }
  return "?";
}

IsaLevel best_isa_level() {
  const auto& f = cpu_info().features;
  if (f.avx2 && f.fma && f.f16c && f.avx512f && f.avx512bw && f.avx512vl) return f.avx512_bf16 ? IsaLevel::kAvx512Bf16 : IsaLevel::kAvx512;
  if (f.avx2 && f.fma && f.f16c) return IsaLevel::kAvx2;
  return IsaLevel::kScalar;
}

namespace {

constexpr IsaLevel kAllLevels[] = {IsaLevel::kScalar, IsaLevel::kAvx2, IsaLevel::kAvx512, IsaLevel::kAvx512Bf16};

// "allowed: scalar, avx2, avx512, avx512bf16; this CPU has: scalar, avx2"
std::string isa_choices() {
  std::string allowed, has;
  for (IsaLevel l : kAllLevels) {
    allowed += std::string(allowed.empty() ? "" : ", ") + isa_level_name(l);
    if (static_cast<int>(l) <= static_cast<int>(best_isa_level())) {
      has += std::string(has.empty() ? "" : ", ") + isa_level_name(l);
    }
  }
  return "allowed: " + allowed + "; this CPU has: " + has;
}

// A value for an error message: printable ASCII only, at most 32 characters.
std::string shown(const std::string& name) {
  std::string s;
  for (const char c : name.substr(0, 32)) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f) {
      s += c;
    } else {
      static const char* hex = "0123456789abcdef";
      s += "\\x";
      s += hex[u >> 4];
      s += hex[u & 15];
    }
  }
  return name.size() > 32 ? s + "..." : s;
}

}  // namespace

Result<IsaLevel> parse_isa_level(const std::string& name) {
  for (IsaLevel l : kAllLevels) {
    if (name == isa_level_name(l)) {
      if (static_cast<int>(l) > static_cast<int>(best_isa_level())) {
        return unsupported("ISA level '" + name + "' is not supported by this CPU (" + isa_choices() + ")");
      }
      return l;
    }
  }
  return invalid_argument("ISA level '" + shown(name) + "' is unknown (" + isa_choices() + ")");
}

Result<IsaLevel> active_isa_level() {
  if (const char* v = std::getenv("K3_ISA"); v != nullptr && *v != '\0') {
    auto r = parse_isa_level(v);
    if (!r.is_ok()) return Status(r.status().code(), "K3_ISA=" + shown(v) + ": " + r.status().message());
    return r;
  }
  return best_isa_level();
}

}  // namespace k3
