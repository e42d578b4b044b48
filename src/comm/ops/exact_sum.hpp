// Exact sums of BF16 values, rounded once to FP32 (round to nearest, ties to even) — the
// reduction of the tensor-parallel all-reduce (k3/allreduce.hpp, docs/distributed.md).
//
// Contract of exact_sum_bf16(v, stride, n) (v[0], v[stride], ..., v[(n-1) stride], BF16 bits):
//   * any NaN, or +Inf together with -Inf          -> quiet NaN
//   * otherwise any Inf                            -> that Inf
//   * otherwise the mathematically exact sum S, rounded to FP32 with round-to-nearest-even:
//     |S| >= 2^128 - 2^103 gives +-Inf (what RNE gives), S = 0 gives -0 when every input is -0
//     (IEEE's rule for a sum of zeros) and +0 otherwise (n = 0 gives +0).
// The result depends only on the multiset of inputs: not on their order, not on how they were
// grouped, hence not on the world size nor on which rank held what.
//
// Why it is exact: a finite BF16 is M * 2^(max(E,1) - 134) with M < 256 (E = biased exponent),
// i.e. an integer multiple of 2^-133 below 2^261; the sum of n of them is an integer multiple of
// 2^-133 below n * 2^261.
//   Fast path: sum in FP64 with an error-free TwoSum per addition; when every error term is zero
//     the FP64 sum is the exact sum, and one conversion to FP32 rounds it (RNE).
//   Fallback (Bf16FixedAccumulator): a fixed-point integer in units of 2^-133 with ten 32-bit
//     digits held in int64 limbs (320 bits, signed; carries deferred, normalized every 2^30
//     additions), rounded to FP32 by inspecting its top 25 bits and a sticky bit.
//
// Host and device code (K3_HOST_DEVICE): the CPU all-reduce and the CUDA one (docs/distributed.md)
// use this one definition, so both give the same bits. Only additions and subtractions of
// doubles: nothing a compiler may contract into an FMA.
#pragma once

#include <cstdint>

#include "k3/config.hpp"
#include "k3/formats.hpp"

namespace k3::comm::detail {

K3_HOST_DEVICE inline int countl_zero32(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __clz(static_cast<int>(v));
#else
  return v == 0 ? 32 : __builtin_clz(v);
#endif
}
K3_HOST_DEVICE inline uint64_t f64_bits(double d) { return __builtin_bit_cast(uint64_t, d); }
K3_HOST_DEVICE inline double f64_from_bits(uint64_t u) { return __builtin_bit_cast(double, u); }

// Non-finite classification shared by both paths.
struct Bf16NonFinite {
  bool nan = false, pos_inf = false, neg_inf = false;
  // Returns true (and records it) when h is Inf or NaN.
  K3_HOST_DEVICE bool record(uint16_t h) {
    if ((h & 0x7F80u) != 0x7F80u) return false;
    if ((h & 0x007Fu) != 0) {
      nan = true;
    } else if (h & 0x8000u) {
      neg_inf = true;
    } else {
      pos_inf = true;
    }
    return true;
  }
  K3_HOST_DEVICE bool any() const { return nan || pos_inf || neg_inf; }
  K3_HOST_DEVICE float result() const {
    if (nan || (pos_inf && neg_inf)) return bits_to_f32(0x7FC00000u);  // quiet NaN
    return bits_to_f32(pos_inf ? 0x7F800000u : 0xFF800000u);
  }
};

// Signed fixed-point accumulator of finite BF16 values in units of 2^-133.
class Bf16FixedAccumulator {
 public:
  static constexpr int kLimbs = 10;  // 32-bit digits; a value needs 9 (bits 0..260), one spare
  static constexpr int64_t kAddsBeforeNormalize = int64_t{1} << 30;  // |limb| < 2^31 * 2^32

  // Adds one finite BF16 (Inf / NaN must be filtered by the caller).
  K3_HOST_DEVICE void add(uint16_t h) {
    const uint32_t e = (h >> 7) & 0xFFu;
    const uint64_t m = e != 0 ? (h & 0x7Fu) | 0x80u : (h & 0x7Fu);
    if (m == 0) return;
    const uint32_t shift = e != 0 ? e - 1 : 0;  // 0 ... 253
    const uint64_t v = m << (shift & 31u);       // < 2^39
    const uint32_t k = shift >> 5;               // 0 ... 7
    const int64_t lo = static_cast<int64_t>(v & 0xFFFFFFFFu), hi = static_cast<int64_t>(v >> 32);
    if (h & 0x8000u) {
      limb_[k] -= lo;
      limb_[k + 1] -= hi;
    } else {
      limb_[k] += lo;
      limb_[k + 1] += hi;
    }
    if (++adds_ >= kAddsBeforeNormalize) normalize();
  }

  // The sum rounded to FP32 (RNE; +-Inf past the largest finite FP32; an exact zero is +0).
  K3_HOST_DEVICE float to_f32() {
    normalize();
    const bool negative = limb_[kLimbs - 1] < 0;
    if (negative) {
      for (int i = 0; i < kLimbs; ++i) limb_[i] = -limb_[i];
      normalize();
    }
    int top = kLimbs - 1;
    while (top >= 0 && limb_[top] == 0) --top;
    if (top < 0) return 0.0f;
    const int p = 32 * top + 31 - countl_zero32(static_cast<uint32_t>(limb_[top]));  // top bit
    uint32_t bits;
    if (p <= 23) {  // fits the 24-bit significand: exact
      const uint32_t mag = static_cast<uint32_t>(limb_[0]);
      bits = p >= 7 ? (static_cast<uint32_t>(p - 6) << 23) | ((mag << (23 - p)) & 0x7FFFFFu)  // normal
                    : mag << 16;  // below 2^-126: subnormal, mag * 2^-133 = (mag << 16) * 2^-149
    } else {
      uint32_t sig = static_cast<uint32_t>(bits_at(p - 23, 24));
      const bool round = bits_at(p - 24, 1) != 0;
      const bool sticky = any_below(p - 24);
      int q = p;
      if (round && (sticky || (sig & 1u))) {
        if (++sig == (1u << 24)) {
          sig >>= 1;
          ++q;
        }
      }
      if (q - 133 > 127) {
        bits = 0x7F800000u;  // rounds past the largest finite FP32
      } else {
        bits = (static_cast<uint32_t>(q - 6) << 23) | (sig & 0x7FFFFFu);
      }
    }
    return bits_to_f32(bits | (negative ? 0x80000000u : 0u));
  }

 private:
  // Carries to digits in [0, 2^32); the top limb keeps the sign.
  K3_HOST_DEVICE void normalize() {
    for (int i = 0; i + 1 < kLimbs; ++i) {
      const int64_t c = limb_[i] >> 32;  // floor division by 2^32 (arithmetic shift)
      limb_[i] -= c * (int64_t{1} << 32);
      limb_[i + 1] += c;
    }
    adds_ = 0;
  }
  // `count` (<= 32) bits starting at bit `lo` of the normalized magnitude (lo may be negative).
  K3_HOST_DEVICE uint64_t bits_at(int lo, int count) const {
    uint64_t r = 0;
    for (int i = count - 1; i >= 0; --i) {
      const int b = lo + i;
      const uint64_t bit = b < 0 ? 0u : (static_cast<uint64_t>(limb_[b >> 5]) >> (b & 31)) & 1u;
      r = (r << 1) | bit;
    }
    return r;
  }
  // Whether any bit below bit `b` is set.
  K3_HOST_DEVICE bool any_below(int b) const {
    if (b <= 0) return false;
    const int full = b >> 5;
    for (int i = 0; i < full; ++i) {
      if (limb_[i] != 0) return true;
    }
    const int rem = b & 31;
    return rem != 0 && (static_cast<uint64_t>(limb_[full]) & ((uint64_t{1} << rem) - 1u)) != 0;
  }

  int64_t limb_[kLimbs] = {};
  int64_t adds_ = 0;
};

// The fallback alone (all inputs through the fixed-point accumulator); same contract.
K3_HOST_DEVICE inline float exact_sum_bf16_fixed(const uint16_t* v, int64_t stride, int64_t n) {
  Bf16NonFinite nf;
  Bf16FixedAccumulator acc;
  bool all_neg_zero = n > 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = v[i * stride];
    all_neg_zero = all_neg_zero && h == 0x8000u;
    if (nf.record(h)) continue;
    acc.add(h);
  }
  if (nf.any()) return nf.result();
  if (all_neg_zero) return -0.0f;
  return acc.to_f32();
}

// FP64 -> FP32, round to nearest even, +-Inf from 2^128 - 2^103 on (explicit: a double -> float
// conversion out of float's range is undefined in C++). NaN stays NaN. Integer compares on the
// bit pattern only, so that loops over it vectorize (FP compares may trap: no if-conversion).
K3_HOST_DEVICE inline float f32_from_f64(double s) {
  const uint64_t b = f64_bits(s);
  const uint64_t a = b & 0x7FFFFFFFFFFFFFFFull;
  // all ones when |s| >= 0x1.ffffffp127 (FLT_MAX + half an ulp) and s is not NaN
  const uint64_t huge = 0 - static_cast<uint64_t>((a >= 0x47EFFFFFF0000000ull) & (a <= 0x7FF0000000000000ull));
  const float f = static_cast<float>(f64_from_bits(b & ~huge));  // 0 in place of huge values
  const uint32_t inf = 0x7F800000u | (static_cast<uint32_t>(b >> 32) & 0x80000000u);
  const auto m = static_cast<uint32_t>(huge);
  return bits_to_f32((f32_to_bits(f) & ~m) | (inf & m));
}

// One TwoSum step: s += x; returns whether the FP64 addition was inexact (or non-finite).
K3_HOST_DEVICE inline bool two_sum_inexact(double& s, double x) {
  const double t = s + x;
  const double bp = t - s;
  const double err = (s - (t - bp)) + (x - bp);
  s = t;
  return err != 0.0 || err != err;  // non-finite operands make err NaN
}

// The full contract: FP64 + TwoSum fast path, fixed-point fallback when any step was inexact.
K3_HOST_DEVICE inline float exact_sum_bf16(const uint16_t* v, int64_t stride, int64_t n) {
  if (n == 0) return 0.0f;
  double s = -0.0;  // -0 + ... keeps IEEE's zero-sign rule: -0 only when every input is -0
  bool inexact = false;
  for (int64_t i = 0; i < n; ++i) {
    inexact = two_sum_inexact(s, static_cast<double>(bf16_to_f32(v[i * stride]))) || inexact;
  }
  if (!inexact) return f32_from_f64(s);
  return exact_sum_bf16_fixed(v, stride, n);
}

}  // namespace k3::comm::detail
