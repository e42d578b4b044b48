// Gated FC1 row layouts (k3/layout.hpp): pure row moves, no arithmetic on the values.
#include <cstring>
#include <functional>

#include "k3/layout.hpp"
#include "k3/mx.hpp"

namespace k3 {

namespace {

std::string num(int64_t v) { return std::to_string(v); }

bool overlap(std::span<const uint8_t> a, std::span<uint8_t> b) {
  if (a.empty() || b.empty()) return false;
  const auto* a0 = a.data();
  const auto* b0 = b.data();
  // std::less gives a total order on pointers even across objects.
  return std::less<const uint8_t*>()(a0, b0 + b.size()) && std::less<const uint8_t*>()(b0, a0 + a.size());
}

}  // namespace

const char* gated_layout_name(GatedLayout l) {
  switch (l) {
    case GatedLayout::kGateUp: return "gate_up";
    case GatedLayout::kUpGate: return "up_gate";
    case GatedLayout::kInterleaved: return "interleaved";
  }
  return "?";
}

Result<GatedLayout> parse_gated_layout(const std::string& s) {
  if (s == "gate_up" || s == "w13") return GatedLayout::kGateUp;
  if (s == "up_gate" || s == "w31") return GatedLayout::kUpGate;
  if (s == "interleaved" || s == "gpt_oss") return GatedLayout::kInterleaved;
  return invalid_argument("layout '" + s + "' is unknown (expected gate_up / w13, up_gate / w31, interleaved / gpt_oss)");
}

Status convert_gated_rows(std::span<const uint8_t> src, std::span<uint8_t> dst, int64_t experts, int64_t n,
                          int64_t row_bytes, GatedLayout from, GatedLayout to) {
  if (experts < 0) return invalid_argument("experts = " + num(experts) + " must be >= 0");
  if (n <= 0) return invalid_argument("n = " + num(n) + " (rows per half) must be positive");
  if (row_bytes <= 0) return invalid_argument("row_bytes = " + num(row_bytes) + " must be positive");
  int64_t total = 0;
  if (__builtin_mul_overflow(experts, 2 * n, &total) || __builtin_mul_overflow(total, row_bytes, &total)) {
    return invalid_argument("experts x 2n x row_bytes overflows");
  }
  if (static_cast<int64_t>(src.size()) != total) {
    return invalid_argument("src has " + num(static_cast<int64_t>(src.size())) + " bytes, expected [experts " +
                            num(experts) + ", 2n " + num(2 * n) + ", " + num(row_bytes) + "] = " + num(total));
  }
  if (static_cast<int64_t>(dst.size()) != total) {
    return invalid_argument("dst has " + num(static_cast<int64_t>(dst.size())) + " bytes, expected " + num(total));
  }
  if (overlap(src, dst)) return invalid_argument("src and dst overlap; a layout conversion is not in place");
  const int64_t rows = 2 * n;
  // Threads only pay off for large copies (a Kimi expert's FC1 is 11 MB); small ones stay serial.
  const bool parallel = total >= (int64_t{1} << 22);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t er = 0; er < experts * rows; ++er) {  // logical row (half, i) of expert e
    const int64_t e = er / rows, i = (er % rows) % n, half = (er % rows) / n;
    const int64_t s = gated_row(from, static_cast<int>(half), i, n);
    const int64_t d = gated_row(to, static_cast<int>(half), i, n);
    std::memcpy(dst.data() + (e * rows + d) * row_bytes, src.data() + (e * rows + s) * row_bytes,
                static_cast<size_t>(row_bytes));
  }
  return Status::ok();
}

Status convert_fc1_layout(std::span<const uint8_t> q, std::span<const uint8_t> scale, int64_t experts, int64_t n,
                          int64_t k, GatedLayout from, GatedLayout to, std::span<uint8_t> q_out,
                          std::span<uint8_t> scale_out) {
  if (k <= 0 || k % kMxBlock != 0) return invalid_argument("k = " + num(k) + " must be a positive multiple of 32");
  if (Status s = convert_gated_rows(q, q_out, experts, n, k / 2, from, to); !s.is_ok()) {
    return Status(s.code(), "FC1 codes [E, 2N, K/2]: " + s.message());
  }
  if (Status s = convert_gated_rows(scale, scale_out, experts, n, k / kMxBlock, from, to); !s.is_ok()) {
    return Status(s.code(), "FC1 scales [E, 2N, K/32]: " + s.message());
  }
  return Status::ok();
}

}  // namespace k3
