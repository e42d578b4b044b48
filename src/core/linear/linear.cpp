// The linear contract (k3/linear.hpp): problem checks, the plain reference and the FP64 oracle.
#include "k3/linear.hpp"

#include <cmath>
#include <cstring>
#include <vector>

#include "k3/formats.hpp"
#include "k3/moe_ref.hpp"
#include "k3/mx.hpp"

namespace k3 {

const char* linear_recipe_name(LinearRecipe r) {
  switch (r) {
    case LinearRecipe::kW8A8: return "w8a8";
    case LinearRecipe::kW8A16: return "w8a16";
    case LinearRecipe::kW16A16: return "w16a16";
  }
  return "?";
}

Result<LinearRecipe> parse_linear_recipe(const std::string& s) {
  if (s == "w8a8") return LinearRecipe::kW8A8;
  if (s == "w8a16") return LinearRecipe::kW8A16;
  if (s == "w16a16") return LinearRecipe::kW16A16;
  return invalid_argument("recipe '" + s + "' is not a linear recipe (allowed: w8a8, w8a16, w16a16)");
}

Status validate_linear_problem(const LinearProblem& p) {
  if (p.k <= 0 || p.k % kMxBlock != 0 || p.k > kLinearMaxDim)
    return invalid_argument("linear: k = " + std::to_string(p.k) + " must be a positive multiple of 32 (the MX block) and <= " +
                            std::to_string(kLinearMaxDim));
  if (p.n <= 0 || p.n > kLinearMaxDim)
    return invalid_argument("linear: n = " + std::to_string(p.n) + " must be in [1, " + std::to_string(kLinearMaxDim) + "]");
  if (p.out_dtype != OutDType::kBF16 && p.out_dtype != OutDType::kFP16 && p.out_dtype != OutDType::kFP32)
    return invalid_argument("linear: out_dtype must be bf16, fp16 or fp32");
  if (p.recipe != LinearRecipe::kW8A8 && p.recipe != LinearRecipe::kW8A16 && p.recipe != LinearRecipe::kW16A16)
    return invalid_argument("linear: recipe must be w8a8, w8a16 or w16a16");
  return Status::ok();
}

namespace {
Status size_error(const char* what, size_t got, int64_t want, const std::string& shape) {
  return invalid_argument(std::string("linear: ") + what + " has " + std::to_string(got) + " elements; expected " +
                          std::to_string(want) + " (" + shape + ")");
}
}  // namespace

Status validate_linear_weights(const LinearProblem& p, const LinearWeightsView& w) {
  if (auto st = validate_linear_problem(p); !st.is_ok()) return st;
  const int64_t blocks = p.k / kMxBlock;
  if (p.bias && static_cast<int64_t>(w.bias.size()) != p.n) return size_error("bias", w.bias.size(), p.n, "N FP32 values");
  if (!p.bias && !w.bias.empty())
    return invalid_argument("linear: a bias of " + std::to_string(w.bias.size()) +
                            " values was given but the problem has bias = false");
  if (p.recipe == LinearRecipe::kW16A16) {
    if (!w.codes.empty() || !w.scales.empty())
      return invalid_argument("linear: recipe w16a16 takes BF16 weights (the bf16 field); codes and scales must be "
                              "empty, got " + std::to_string(w.codes.size()) + " codes and " +
                              std::to_string(w.scales.size()) + " scales");
    if (static_cast<int64_t>(w.bf16.size()) != p.n * p.k)
      return size_error("BF16 weights", w.bf16.size(), p.n * p.k, "N x K BF16 values");
    for (int64_t i = 0; i < p.n * p.k; ++i) {
      if ((w.bf16[static_cast<size_t>(i)] & 0x7FFF) > 0x7F80)
        return invalid_argument("linear: BF16 weight of row " + std::to_string(i / p.k) + ", column " +
                                std::to_string(i % p.k) + " is NaN; the layer refuses NaN weights");
    }
    return Status::ok();
  }
  if (!w.bf16.empty())
    return invalid_argument(std::string("linear: recipe ") + linear_recipe_name(p.recipe) +
                            " takes MXFP8 weights (codes and scales); the bf16 field must be empty, got " +
                            std::to_string(w.bf16.size()) + " values");
  if (static_cast<int64_t>(w.codes.size()) != p.n * p.k)
    return size_error("weight codes", w.codes.size(), p.n * p.k, "N x K E4M3 codes");
  if (static_cast<int64_t>(w.scales.size()) != p.n * blocks)
    return size_error("weight scales", w.scales.size(), p.n * blocks, "N x K/32 E8M0 codes");
  for (int64_t r = 0; r < p.n; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      if (w.scales[static_cast<size_t>(r * blocks + b)] == kE8M0Nan)
        return invalid_argument("linear: weight scale of row " + std::to_string(r) + ", block " + std::to_string(b) +
                                " is 0xFF (E8M0 NaN); the layer refuses NaN weights");
    }
    const uint8_t* row = w.codes.data() + r * p.k;
    for (int64_t k = 0; k < p.k; ++k) {
      if ((row[k] & 0x7F) == 0x7F)
        return invalid_argument("linear: weight code of row " + std::to_string(r) + ", column " + std::to_string(k) +
                                " (block " + std::to_string(k / kMxBlock) + ") is 0x" +
                                (row[k] == 0x7F ? std::string("7F") : std::string("FF")) +
                                " (E4M3 NaN); the layer refuses NaN weights");
    }
  }
  return Status::ok();
}

Status validate_linear_io(const LinearProblem& p, int64_t m, std::span<const uint16_t> x, std::span<const uint8_t> out) {
  if (m < 0) return invalid_argument("linear: m = " + std::to_string(m) + " must be >= 0");
  if (static_cast<int64_t>(x.size()) != m * p.k)
    return size_error("x", x.size(), m * p.k, "M x K BF16 values, M = " + std::to_string(m));
  const int64_t want = m * p.n * out_dtype_size(p.out_dtype);
  if (static_cast<int64_t>(out.size()) != want)
    return invalid_argument("linear: out has " + std::to_string(out.size()) + " bytes; expected " + std::to_string(want) +
                            " (M x N " + out_dtype_name(p.out_dtype) + ", M = " + std::to_string(m) + ")");
  return Status::ok();
}

void linear_operand_row(const LinearProblem& p, std::span<const uint16_t> x_row, std::span<float> out) {
  if (p.recipe != LinearRecipe::kW8A8) {
    for (int64_t k = 0; k < p.k; ++k) out[static_cast<size_t>(k)] = bf16_to_f32(x_row[static_cast<size_t>(k)]);
    return;
  }
  float v[kMxBlock];
  uint8_t codes[kMxBlock];
  for (int64_t b = 0; b < p.k / kMxBlock; ++b) {
    for (int i = 0; i < kMxBlock; ++i) v[i] = bf16_to_f32(x_row[static_cast<size_t>(b * kMxBlock + i)]);
    const uint8_t s = mx_quantize_block(v, MxElement::kE4M3, ScaleRule::kRceil, codes);
    for (int i = 0; i < kMxBlock; ++i)
      out[static_cast<size_t>(b * kMxBlock + i)] = mx_decode_element(codes[i], s, MxElement::kE4M3);
  }
}

namespace {
// w_k (unscaled) and s_b of the contract for output n.
float weight_value(const LinearProblem& p, const LinearWeightsView& w, int64_t n, int64_t k) {
  const size_t i = static_cast<size_t>(n * p.k + k);
  return p.recipe == LinearRecipe::kW16A16 ? bf16_to_f32(w.bf16[i]) : e4m3_to_f32(w.codes[i]);
}
uint8_t block_scale(const LinearProblem& p, const LinearWeightsView& w, int64_t n, int64_t b) {
  return p.recipe == LinearRecipe::kW16A16 ? uint8_t{127} : w.scales[static_cast<size_t>(n * (p.k / kMxBlock) + b)];
}

void store(OutDType d, float v, uint8_t* dst) {
  if (d == OutDType::kFP32) {
    std::memcpy(dst, &v, 4);
  } else {
    const uint16_t h = d == OutDType::kBF16 ? bf16_from_f32(v) : fp16_from_f32(v);
    std::memcpy(dst, &h, 2);
  }
}
}  // namespace

Status linear_reference(const LinearProblem& p, const LinearWeightsView& w, int64_t m, std::span<const uint16_t> x,
                        std::span<uint8_t> out) {
  if (auto st = validate_linear_weights(p, w); !st.is_ok()) return st;
  if (auto st = validate_linear_io(p, m, x, out); !st.is_ok()) return st;
  const int64_t blocks = p.k / kMxBlock;
  const int size = out_dtype_size(p.out_dtype);
  std::vector<float> xv(static_cast<size_t>(p.k));
  for (int64_t r = 0; r < m; ++r) {
    linear_operand_row(p, x.subspan(static_cast<size_t>(r * p.k), static_cast<size_t>(p.k)), xv);
    for (int64_t n = 0; n < p.n; ++n) {
      float total = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        float partial = 0.0f;
        for (int64_t k = b * kMxBlock; k < (b + 1) * kMxBlock; k += 2) {
          partial = std::fma(weight_value(p, w, n, k + 1), xv[static_cast<size_t>(k + 1)], partial);
          partial = std::fma(weight_value(p, w, n, k), xv[static_cast<size_t>(k)], partial);
        }
        total = std::fma(partial, e8m0_to_f32(block_scale(p, w, n, b)), total);
      }
      if (p.bias) total = total + w.bias[static_cast<size_t>(n)];
      store(p.out_dtype, total, out.data() + (r * p.n + n) * size);
    }
  }
  return Status::ok();
}

Status linear_oracle_fp64(const LinearProblem& p, const LinearWeightsView& w, int64_t m, std::span<const uint16_t> x,
                          std::span<double> out_fp64) {
  if (auto st = validate_linear_weights(p, w); !st.is_ok()) return st;
  if (m < 0 || static_cast<int64_t>(x.size()) != m * p.k) return size_error("x", x.size(), m * p.k, "M x K BF16 values");
  if (static_cast<int64_t>(out_fp64.size()) != m * p.n)
    return size_error("oracle output", out_fp64.size(), m * p.n, "M x N FP64 values");
  const int64_t blocks = p.k / kMxBlock;
  std::vector<float> xv(static_cast<size_t>(p.k));
  std::vector<double> wrow(static_cast<size_t>(p.k));
  for (int64_t r = 0; r < m; ++r) {
    linear_operand_row(p, x.subspan(static_cast<size_t>(r * p.k), static_cast<size_t>(p.k)), xv);
    for (int64_t n = 0; n < p.n; ++n) {
      double acc = 0.0;
      for (int64_t b = 0; b < blocks; ++b) {
        const double scale = std::ldexp(1.0, e8m0_exponent(block_scale(p, w, n, b)));
        for (int64_t k = b * kMxBlock; k < (b + 1) * kMxBlock; ++k)
          acc += static_cast<double>(weight_value(p, w, n, k)) * scale * static_cast<double>(xv[static_cast<size_t>(k)]);
      }
      if (p.bias) acc += static_cast<double>(w.bias[static_cast<size_t>(n)]);
      out_fp64[static_cast<size_t>(r * p.n + n)] = acc;
    }
  }
  return Status::ok();
}

int64_t count_output_mismatches(std::span<const uint8_t> got, std::span<const uint8_t> want, OutDType dtype,
                                int64_t* first) {
  if (got.size() != want.size()) return -1;
  const size_t size = static_cast<size_t>(out_dtype_size(dtype));
  int64_t n = 0;
  for (size_t i = 0; i + size <= got.size(); i += size) {
    if (std::memcmp(&got[i], &want[i], size) == 0) continue;
    float g, w;
    if (size == 4) {
      std::memcpy(&g, &got[i], 4);
      std::memcpy(&w, &want[i], 4);
    } else {
      uint16_t hg, hw;
      std::memcpy(&hg, &got[i], 2);
      std::memcpy(&hw, &want[i], 2);
      g = dtype == OutDType::kBF16 ? bf16_to_f32(hg) : fp16_to_f32(hg);
      w = dtype == OutDType::kBF16 ? bf16_to_f32(hw) : fp16_to_f32(hw);
    }
    if (g != g && w != w) continue;
    if (n == 0 && first != nullptr) *first = static_cast<int64_t>(i / size);
    ++n;
  }
  return n;
}

}  // namespace k3
