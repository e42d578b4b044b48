// Host implementation of the MX row operations declared in k3/mx.hpp. Rows are independent, so
// the OpenMP split over rows cannot change any bit of the result.
#include "k3/mx.hpp"

#include <array>
#include <string>

namespace k3 {

const char* mx_element_name(MxElement e) { return e == MxElement::kE2M1 ? "mxfp4" : "mxfp8"; }
const char* scale_rule_name(ScaleRule r) { return r == ScaleRule::kRceil ? "rceil" : "floor"; }

std::string MxBlockRef::to_string() const {
  return "row " + std::to_string(row) + ", block " + std::to_string(block) + " (scale code " +
         std::to_string(scale_code) + " = 2^" + std::to_string(e8m0_exponent(scale_code)) + ")";
}

namespace {

Status check_size(const char* name, size_t have, int64_t need) {
  if (static_cast<int64_t>(have) < need) {
    return invalid_argument(std::string(name) + ": buffer holds " + std::to_string(have) + " elements, needs " +
                            std::to_string(need));
  }
  return Status::ok();
}

template <typename LoadFn>
void quantize_rows(LoadFn load, int64_t rows, int64_t cols, MxElement e, ScaleRule rule, uint8_t* q,
                   uint8_t* scales) {
  const int64_t nblk = mx_scale_cols(cols);
  const int64_t row_bytes = mx_row_bytes(e, cols);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    std::array<float, kMxBlock> buf{};
    std::array<uint8_t, kMxBlock> codes{};
    for (int64_t b = 0; b < nblk; ++b) {
      for (int i = 0; i < kMxBlock; ++i) buf[i] = load(r * cols + b * kMxBlock + i);
      scales[r * nblk + b] = mx_quantize_block(buf.data(), e, rule, codes.data());
      uint8_t* dst = q + r * row_bytes;
      if (e == MxElement::kE2M1) {
        for (int i = 0; i < kMxBlock; i += 2) dst[(b * kMxBlock + i) / 2] = fp4_pack(codes[i], codes[i + 1]);
      } else {
        for (int i = 0; i < kMxBlock; ++i) dst[b * kMxBlock + i] = codes[i];
      }
    }
  }
}

uint8_t element_code(const uint8_t* q, int64_t row_bytes, int64_t r, int64_t c, MxElement e) {
  if (e == MxElement::kE2M1) {
    const uint8_t byte = q[r * row_bytes + c / 2];
    return (c & 1) ? fp4_high(byte) : fp4_low(byte);
  }
  return q[r * row_bytes + c];
}

Status check_quantized(std::span<const uint8_t> q, std::span<const uint8_t> scales, int64_t rows, int64_t cols,
                       MxElement e) {
  K3_RETURN_IF_ERROR(mx_check_shape(rows, cols, "mx tensor"));
  K3_RETURN_IF_ERROR(check_size("q", q.size(), rows * mx_row_bytes(e, cols)));
  return check_size("scales", scales.size(), rows * mx_scale_cols(cols));
}

}  // namespace

Status mx_check_shape(int64_t rows, int64_t cols, const char* what) {
  if (rows < 0) return invalid_argument(std::string(what) + ": rows = " + std::to_string(rows) + " must be >= 0");
  if (cols <= 0 || cols % kMxBlock != 0) {
    return invalid_argument(std::string(what) + ": cols = " + std::to_string(cols) +
                            " must be a positive multiple of the MX block size 32");
  }
  return Status::ok();
}

Status mx_quantize(std::span<const float> x, int64_t rows, int64_t cols, MxElement e, ScaleRule rule,
                   std::span<uint8_t> q, std::span<uint8_t> scales) {
  K3_RETURN_IF_ERROR(mx_check_shape(rows, cols, "mx_quantize"));
  K3_RETURN_IF_ERROR(check_size("x", x.size(), rows * cols));
  K3_RETURN_IF_ERROR(check_size("q", q.size(), rows * mx_row_bytes(e, cols)));
  K3_RETURN_IF_ERROR(check_size("scales", scales.size(), rows * mx_scale_cols(cols)));
  const float* src = x.data();
  quantize_rows([src](int64_t i) { return src[i]; }, rows, cols, e, rule, q.data(), scales.data());
  return Status::ok();
}

Status mx_quantize_bf16(std::span<const uint16_t> x, int64_t rows, int64_t cols, MxElement e, ScaleRule rule,
                        std::span<uint8_t> q, std::span<uint8_t> scales) {
  K3_RETURN_IF_ERROR(mx_check_shape(rows, cols, "mx_quantize_bf16"));
  K3_RETURN_IF_ERROR(check_size("x", x.size(), rows * cols));
  K3_RETURN_IF_ERROR(check_size("q", q.size(), rows * mx_row_bytes(e, cols)));
  K3_RETURN_IF_ERROR(check_size("scales", scales.size(), rows * mx_scale_cols(cols)));
  const uint16_t* src = x.data();
  quantize_rows([src](int64_t i) { return bf16_to_f32(src[i]); }, rows, cols, e, rule, q.data(), scales.data());
  return Status::ok();
}

Status mx_dequantize(std::span<const uint8_t> q, std::span<const uint8_t> scales, int64_t rows, int64_t cols,
                     MxElement e, std::span<float> out) {
  K3_RETURN_IF_ERROR(check_quantized(q, scales, rows, cols, e));
  K3_RETURN_IF_ERROR(check_size("out", out.size(), rows * cols));
  const int64_t row_bytes = mx_row_bytes(e, cols);
  const int64_t nblk = mx_scale_cols(cols);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      out[r * cols + c] = mx_decode_element(element_code(q.data(), row_bytes, r, c, e), scales[r * nblk + c / kMxBlock], e);
    }
  }
  return Status::ok();
}

std::optional<MxBlockRef> mx_find_bf16_inexact_block(std::span<const uint8_t> q, std::span<const uint8_t> scales,
                                                     int64_t rows, int64_t cols, MxElement e) {
  if (!check_quantized(q, scales, rows, cols, e).is_ok()) return std::nullopt;
  const int64_t row_bytes = mx_row_bytes(e, cols);
  const int64_t nblk = mx_scale_cols(cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nblk; ++b) {
      const uint8_t s = scales[r * nblk + b];
      // Scales in [2^-117, 2^119] keep every E4M3 / E2M1 product normal: skip the element scan.
      if (s >= 10 && s <= 246) continue;
      for (int64_t i = 0; i < kMxBlock; ++i) {
        if (!mx_element_bf16_exact(element_code(q.data(), row_bytes, r, b * kMxBlock + i, e), s, e)) {
          return MxBlockRef{r, b, s};
        }
      }
    }
  }
  return std::nullopt;
}

Status mx_dequantize_bf16(std::span<const uint8_t> q, std::span<const uint8_t> scales, int64_t rows, int64_t cols,
                          MxElement e, std::span<uint16_t> out) {
  K3_RETURN_IF_ERROR(check_quantized(q, scales, rows, cols, e));
  K3_RETURN_IF_ERROR(check_size("out", out.size(), rows * cols));
  if (auto bad = mx_find_bf16_inexact_block(q, scales, rows, cols, e)) {
    return {StatusCode::kInexact, std::string("mx_dequantize_bf16: ") + mx_element_name(e) + " " + bad->to_string() +
                                      " holds a value outside BF16's normal range [2^-126, 2^128); "
                                      "dequantize to FP32 instead"};
  }
  const int64_t row_bytes = mx_row_bytes(e, cols);
  const int64_t nblk = mx_scale_cols(cols);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float v = mx_decode_element(element_code(q.data(), row_bytes, r, c, e), scales[r * nblk + c / kMxBlock], e);
      out[r * cols + c] = bf16_from_f32(v);  // exact: checked above
    }
  }
  return Status::ok();
}

Status scales_to_swizzled(std::span<const uint8_t> linear, int64_t rows, int64_t scale_cols,
                          std::span<uint8_t> swizzled) {
  if (rows < 0 || scale_cols <= 0) {
    return invalid_argument("scales_to_swizzled: rows = " + std::to_string(rows) + ", scale_cols = " +
                            std::to_string(scale_cols) + " (need rows >= 0, scale_cols > 0)");
  }
  K3_RETURN_IF_ERROR(check_size("linear", linear.size(), rows * scale_cols));
  K3_RETURN_IF_ERROR(check_size("swizzled", swizzled.size(), swizzled_scale_size(rows, scale_cols)));
  const int64_t padded_rows = ((rows + 127) / 128) * 128;
  const int64_t padded_cols = ((scale_cols + 3) / 4) * 4;
  for (int64_t r = 0; r < padded_rows; ++r) {
    for (int64_t c = 0; c < padded_cols; ++c) {
      const bool inside = r < rows && c < scale_cols;
      swizzled[swizzled_scale_offset(r, c, scale_cols)] = inside ? linear[r * scale_cols + c] : uint8_t{0};
    }
  }
  return Status::ok();
}

Status scales_from_swizzled(std::span<const uint8_t> swizzled, int64_t rows, int64_t scale_cols,
                            std::span<uint8_t> linear) {
  if (rows < 0 || scale_cols <= 0) {
    return invalid_argument("scales_from_swizzled: rows = " + std::to_string(rows) + ", scale_cols = " +
                            std::to_string(scale_cols) + " (need rows >= 0, scale_cols > 0)");
  }
  K3_RETURN_IF_ERROR(check_size("swizzled", swizzled.size(), swizzled_scale_size(rows, scale_cols)));
  K3_RETURN_IF_ERROR(check_size("linear", linear.size(), rows * scale_cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < scale_cols; ++c) linear[r * scale_cols + c] = swizzled[swizzled_scale_offset(r, c, scale_cols)];
  }
  return Status::ok();
}

}  // namespace k3
