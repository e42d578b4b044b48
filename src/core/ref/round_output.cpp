// round_output: one RNE rounding from FP64 straight to BF16 / FP16 / FP32. Going through FP32
// first would round twice, which can differ from a single rounding at BF16 / FP16 ties.
#include <cmath>
#include <cstring>

#include "k3/formats.hpp"
#include "k3/moe_ref.hpp"

namespace k3 {
namespace {

// Rounds v to a binary format with `mbits` stored mantissa bits, smallest normal exponent `emin`
// and largest finite value `max_finite` (RNE, subnormals kept, overflow to Inf). The result is
// exactly representable in that format, hence in FP32 for all three formats.
double round_to_format(double v, int mbits, int emin, double max_finite) {
  if (std::isnan(v) || std::isinf(v) || v == 0.0) return v;
  int e2;
  std::frexp(v, &e2);  // |v| = f * 2^e2, f in [0.5, 1): the leading bit has exponent e2 - 1
  const int lead = e2 - 1;
  const int quantum = (lead > emin ? lead : emin) - mbits;  // exponent of one ulp at v
  // Scaling by a power of two is exact here (the result has at most ~1100 bits of range, and
  // the scaled magnitude is < 2^(mbits+1) or tiny); nearbyint rounds ties to even.
  const double q = std::nearbyint(std::ldexp(v, -quantum));
  const double r = std::ldexp(q, quantum);
  if (std::fabs(r) > max_finite) return std::copysign(INFINITY, v);
  return r;
}

}  // namespace

float round_to_f32(double v) {
  constexpr double kOverflow = 0x1.FFFFFFp127;  // FLT_MAX + half an ulp: rounds to Inf (ties to even)
  if (v >= kOverflow) return INFINITY;
  if (v <= -kOverflow) return -INFINITY;
  return static_cast<float>(v);  // in range (or NaN): IEEE round to nearest even
}

void round_output(std::span<const double> in, OutDType dtype, std::span<uint8_t> out) {
  const int size = out_dtype_size(dtype);
  if (out.size() != in.size() * static_cast<size_t>(size)) return;
  for (size_t i = 0; i < in.size(); ++i) {
    const double v = in[i];
    uint8_t* dst = out.data() + i * size;
    if (dtype == OutDType::kFP32) {
      const uint32_t bits = std::isnan(v) ? 0x7FC00000u : f32_to_bits(round_to_f32(v));
      for (int b = 0; b < 4; ++b) dst[b] = static_cast<uint8_t>(bits >> (8 * b));
      continue;
    }
    uint16_t bits;
    if (dtype == OutDType::kBF16) {
      const double r = round_to_format(v, 7, -126, 0x1.FEp127);
      bits = bf16_from_f32(static_cast<float>(r));  // exact: r is a BF16 value (or Inf / NaN)
    } else {
      const double r = round_to_format(v, 10, -14, 65504.0);
      bits = fp16_from_f32(static_cast<float>(r));  // exact: r is an FP16 value (or Inf / NaN)
    }
    dst[0] = static_cast<uint8_t>(bits & 0xFF);
    dst[1] = static_cast<uint8_t>(bits >> 8);
  }
}

}  // namespace k3
