// Runtime ISA selection for the CPU kernels.
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
  if (f.avx512f && f.avx512bw && f.avx512vl) return f.avx512_bf16 ? IsaLevel::kAvx512Bf16 : IsaLevel::kAvx512;
  if (f.avx2 && f.fma) return IsaLevel::kAvx2;
  return IsaLevel::kScalar;
}

Result<IsaLevel> parse_isa_level(const std::string& name) {
  for (IsaLevel l : {IsaLevel::kScalar, IsaLevel::kAvx2, IsaLevel::kAvx512, IsaLevel::kAvx512Bf16}) {
    if (name == isa_level_name(l)) {
      if (static_cast<int>(l) > static_cast<int>(best_isa_level())) {
        return unsupported("ISA level '" + name + "' is not supported by this CPU (best: " +
                           isa_level_name(best_isa_level()) + ")");
      }
      return l;
    }
  }
  return invalid_argument("ISA level '" + name + "' is unknown (expected scalar, avx2, avx512 or avx512bf16)");
}

Result<IsaLevel> active_isa_level() {
  if (const char* v = std::getenv("K3_ISA"); v != nullptr && *v != '\0') {
    auto r = parse_isa_level(v);
    if (!r.is_ok()) return Status(r.status().code(), "K3_ISA: " + r.status().message());
    return r;
  }
  return best_isa_level();
}

}  // namespace k3
