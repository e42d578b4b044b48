// Bit-exact agreement of k3's codecs with NVIDIA's own host-callable conversions from the CUDA
// toolkit headers (cuda_fp8.h, cuda_fp4.h, cuda_bf16.h, cuda_fp16.h), compiled here by the C++
// compiler: no GPU involved. Each sweep covers
//   * every 41st FP32 bit pattern (104,755,300 patterns: both signs, subnormals, Inf, NaN), and
//   * every rounding threshold of the target format (midpoints between neighbouring codes and the
//     saturation edge) +-64 FP32 ulps, both signs, plus +-0, +-Inf, NaNs and FP32 subnormals.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <sstream>
#include <vector>

#include "k3/formats.hpp"
#include "k3/mx.hpp"

namespace k3 {
namespace {

constexpr uint64_t kStride = 41;

float from_bits(uint32_t u) { return bits_to_f32(u); }

// FP32 patterns around each threshold t of a format (given as positive floats).
std::vector<uint32_t> neighbourhoods(const std::vector<float>& thresholds) {
  std::vector<uint32_t> out;
  for (float t : thresholds) {
    const uint32_t b = f32_to_bits(t);
    for (int64_t d = -64; d <= 64; ++d) {
      const int64_t v = static_cast<int64_t>(b) + d;
      if (v < 0 || v > 0x7F800000) continue;
      out.push_back(static_cast<uint32_t>(v));
      out.push_back(static_cast<uint32_t>(v) | 0x80000000u);
    }
  }
  for (uint32_t s : {0x0u, 0x80000000u}) {
    for (uint32_t u : {0x0u, 0x1u, 0x2u, 0x3FFFFFu, 0x400000u, 0x7FFFFFu, 0x800000u, 0x7F7FFFFFu, 0x7F800000u,
                       0x7F800001u, 0x7FC00000u, 0x7FFFFFFFu}) {
      out.push_back(s | u);
    }
  }
  return out;
}

// Midpoints between consecutive representable magnitudes (decoded from every code), and the
// value one step beyond the maximum (where saturation starts).
std::vector<float> thresholds_of(float (*decode)(uint8_t), uint32_t max_code) {
  std::vector<float> t;
  for (uint32_t c = 0; c <= max_code; ++c) {
    const double v = decode(static_cast<uint8_t>(c));
    const double next = c < max_code ? static_cast<double>(decode(static_cast<uint8_t>(c + 1)))
                                     : v * 1.25;  // beyond max: a far point and the max itself
    t.push_back(static_cast<float>(v));
    t.push_back(static_cast<float>((v + next) / 2));
  }
  return t;
}

struct Mismatch {
  uint64_t compared = 0;
  uint64_t count = 0;
  std::string first;
};

// Compares f(x) (k3) and g(x) (NVIDIA) over the sweep; reports the count and first mismatches.
Mismatch sweep(const std::vector<uint32_t>& extra, const std::function<uint32_t(float)>& ours,
               const std::function<uint32_t(float)>& theirs) {
  Mismatch m;
  const int64_t n = static_cast<int64_t>((uint64_t{1} << 32) / kStride) + 1;
  uint64_t count = 0, compared = 0;
  uint32_t first_bits = 0;
  bool have_first = false;
#pragma omp parallel for schedule(static) reduction(+ : count, compared)
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t u = static_cast<uint64_t>(i) * kStride;
    if (u > 0xFFFFFFFFu) continue;
    const float x = from_bits(static_cast<uint32_t>(u));
    ++compared;
    if (ours(x) != theirs(x)) {
      ++count;
#pragma omp critical
      if (!have_first) {
        have_first = true;
        first_bits = static_cast<uint32_t>(u);
      }
    }
  }
  for (uint32_t u : extra) {
    const float x = from_bits(u);
    ++compared;
    if (ours(x) != theirs(x)) {
      ++count;
      if (!have_first) {
        have_first = true;
        first_bits = u;
      }
    }
  }
  m.count = count;
  m.compared = compared;
  if (have_first) {
    std::ostringstream os;
    const float x = from_bits(first_bits);
    os << "first mismatch at bits 0x" << std::hex << first_bits << " (" << x << "): k3 0x" << ours(x)
       << ", NVIDIA 0x" << theirs(x);
    m.first = os.str();
  }
  return m;
}

TEST(NvidiaXcheck, E4M3EncodeSatfinite) {
  const auto extra = neighbourhoods(thresholds_of(e4m3_to_f32, 0x7E));
  const auto m = sweep(extra, [](float x) { return uint32_t{e4m3_from_f32(x)}; },
                       [](float x) { return uint32_t{__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)}; });
  EXPECT_EQ(m.count, 0u) << m.first;
  EXPECT_GE(m.compared, 100000000u);
}

TEST(NvidiaXcheck, E5M2EncodeSatfinite) {
  const auto extra = neighbourhoods(thresholds_of(e5m2_to_f32, 0x7B));
  const auto m = sweep(extra, [](float x) { return uint32_t{e5m2_from_f32(x)}; },
                       [](float x) { return uint32_t{__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2)}; });
  EXPECT_EQ(m.count, 0u) << m.first;
  EXPECT_GE(m.compared, 100000000u);
}

TEST(NvidiaXcheck, E2M1EncodeRoundNearest) {
  const auto extra = neighbourhoods(thresholds_of(e2m1_to_f32, 0x7));
  const auto m = sweep(extra, [](float x) { return uint32_t{e2m1_from_f32(x)}; },
                       [](float x) { return uint32_t{__nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest)}; });
  EXPECT_EQ(m.count, 0u) << m.first;
  EXPECT_GE(m.compared, 100000000u);
}

TEST(NvidiaXcheck, E2M1PairPackingMatchesFp4x2) {
  // __nv_cvt_float2_to_fp4x2 puts .x in the low nibble: the same order as k3's packing.
  const auto extra = neighbourhoods(thresholds_of(e2m1_to_f32, 0x7));
  const auto m = sweep(
      extra, [](float x) { return uint32_t{fp4_pack(e2m1_from_f32(x), e2m1_from_f32(-0.5f * x))}; },
      [](float x) { return uint32_t{__nv_cvt_float2_to_fp4x2(float2{x, -0.5f * x}, __NV_E2M1, cudaRoundNearest)}; });
  EXPECT_EQ(m.count, 0u) << m.first;
  EXPECT_GE(m.compared, 100000000u);
}

std::vector<float> powers_of_two() {
  std::vector<float> t;
  for (int e = -149; e <= 127; ++e) t.push_back(std::ldexp(1.f, e));
  return t;
}

TEST(NvidiaXcheck, E8M0EncodeRoundUp) {
  const auto m = sweep(neighbourhoods(powers_of_two()), [](float x) { return uint32_t{e8m0_from_f32_ceil(x)}; },
                       [](float x) { return uint32_t{__nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf)}; });
  EXPECT_EQ(m.count, 0u) << m.first;
  EXPECT_GE(m.compared, 100000000u);
}

TEST(NvidiaXcheck, E8M0EncodeRoundDown) {
  const auto m = sweep(neighbourhoods(powers_of_two()), [](float x) { return uint32_t{e8m0_from_f32_floor(x)}; },
                       [](float x) { return uint32_t{__nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundZero)}; });
  EXPECT_EQ(m.count, 0u) << m.first;
  EXPECT_GE(m.compared, 100000000u);
}

TEST(NvidiaXcheck, MxScaleRceilEqualsNvidiaQuotientRule) {
  // NVIDIA's quantizers: cvt.rp.satfinite.ue8m0(amax / elem_max). k3 computes the exact quotient;
  // over finite positive amax they agree wherever amax / elem_max is a normal FP32.
  for (MxElement el : {MxElement::kE2M1, MxElement::kE4M3}) {
    const float emax = mx_elem_max(el);
    const auto m = sweep(
        neighbourhoods(powers_of_two()),
        [el](float x) {
          const float a = std::fabs(x);
          return (std::isfinite(a) && a / mx_elem_max(el) >= std::ldexp(1.f, -126)) ? uint32_t{mx_scale_code(a, el, ScaleRule::kRceil)} : 0u;
        },
        [emax](float x) {
          const float a = std::fabs(x);
          return (std::isfinite(a) && a / emax >= std::ldexp(1.f, -126))
                     ? uint32_t{__nv_cvt_float_to_e8m0(a / emax, __NV_SATFINITE, cudaRoundPosInf)}
                     : 0u;
        });
    EXPECT_EQ(m.count, 0u) << mx_element_name(el) << ": " << m.first;
    EXPECT_GE(m.compared, 100000000u);
  }
}

TEST(NvidiaXcheck, Bf16EncodeRoundNearest) {
  const auto m = sweep(neighbourhoods(powers_of_two()), [](float x) { return uint32_t{bf16_from_f32(x)}; },
                       [](float x) {
                         const __nv_bfloat16_raw r = __float2bfloat16_rn(x);
                         return uint32_t{r.x};
                       });
  EXPECT_EQ(m.count, 0u) << m.first;
  EXPECT_GE(m.compared, 100000000u);
}

TEST(NvidiaXcheck, Fp16EncodeRoundNearest) {
  const auto m = sweep(neighbourhoods(powers_of_two()), [](float x) { return uint32_t{fp16_from_f32(x)}; },
                       [](float x) {
                         const __half_raw r = __float2half_rn(x);
                         return uint32_t{r.x};
                       });
  EXPECT_EQ(m.count, 0u) << m.first;
  EXPECT_GE(m.compared, 100000000u);
}

bool same_value(float a, float b) { return (std::isnan(a) && std::isnan(b)) || f32_to_bits(a) == f32_to_bits(b); }

TEST(NvidiaXcheck, DecodeTypesAgreeOnEveryCode) {
  for (uint32_t c = 0; c < 256; ++c) {
    __nv_fp8_e4m3 a;
    a.__x = static_cast<__nv_fp8_storage_t>(c);
    EXPECT_TRUE(same_value(e4m3_to_f32(static_cast<uint8_t>(c)), static_cast<float>(a))) << "e4m3 " << c;
    __nv_fp8_e5m2 b;
    b.__x = static_cast<__nv_fp8_storage_t>(c);
    EXPECT_TRUE(same_value(e5m2_to_f32(static_cast<uint8_t>(c)), static_cast<float>(b))) << "e5m2 " << c;
    __nv_fp8_e8m0 s;
    s.__x = static_cast<__nv_fp8_storage_t>(c);
    EXPECT_TRUE(same_value(e8m0_to_f32(static_cast<uint8_t>(c)), static_cast<float>(s))) << "e8m0 " << c;
  }
  for (uint32_t c = 0; c < 16; ++c) {
    __nv_fp4_e2m1 f;
    f.__x = static_cast<__nv_fp4_storage_t>(c);
    EXPECT_TRUE(same_value(e2m1_to_f32(static_cast<uint8_t>(c)), static_cast<float>(f))) << "e2m1 " << c;
  }
  for (uint32_t h = 0; h < 0x10000; ++h) {
    __nv_bfloat16_raw br;
    br.x = static_cast<unsigned short>(h);
    EXPECT_TRUE(same_value(bf16_to_f32(static_cast<uint16_t>(h)), __bfloat162float(__nv_bfloat16(br)))) << h;
    __half_raw hr;
    hr.x = static_cast<unsigned short>(h);
    EXPECT_TRUE(same_value(fp16_to_f32(static_cast<uint16_t>(h)), __half2float(__half(hr)))) << h;
  }
}

}  // namespace
}  // namespace k3
