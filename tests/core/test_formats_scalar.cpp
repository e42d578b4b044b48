// Scalar codecs: exhaustive over codes, rounding thresholds, saturation, specials.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "k3/formats.hpp"

namespace k3 {
namespace {

// Independent reference decode (double arithmetic on the fields).
double ref_decode(uint32_t code, int ebits, int mbits, int bias) {
  const uint32_t sign = (code >> (ebits + mbits)) & 1u;
  const uint32_t e = (code >> mbits) & ((1u << ebits) - 1u);
  const uint32_t m = code & ((1u << mbits) - 1u);
  const double v = e == 0 ? std::ldexp(m, 1 - bias - mbits) : std::ldexp((1u << mbits) | m, int(e) - bias - mbits);
  return sign ? -v : v;
}

TEST(E2M1, EveryCodeDecodesAndRoundTrips) {
  const float mags[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  for (uint32_t c = 0; c < 16; ++c) {
    const float v = e2m1_to_f32(static_cast<uint8_t>(c));
    EXPECT_EQ(v, (c & 8 ? -1.f : 1.f) * mags[c & 7]) << "code " << c;
    EXPECT_EQ(static_cast<double>(v), ref_decode(c, 2, 1, 1));
    EXPECT_EQ(e2m1_from_f32(v), c) << "code " << c;
  }
  EXPECT_TRUE(std::signbit(e2m1_to_f32(8)));  // code 8 is -0
}

TEST(E2M1, RoundingThresholdsTieToEven) {
  // docs/formats.md: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
  const std::pair<float, float> ties[] = {{0.25f, 0.f}, {0.75f, 1.f}, {1.25f, 1.f}, {1.75f, 2.f},
                                          {2.5f, 2.f},  {3.5f, 4.f},  {5.f, 4.f}};
  for (auto [x, want] : ties) {
    EXPECT_EQ(e2m1_to_f32(e2m1_from_f32(x)), want) << x;
    EXPECT_EQ(e2m1_to_f32(e2m1_from_f32(-x)), -want) << -x;
    // one FP32 ulp above the tie rounds up, one below rounds down
    const float up = std::nextafter(x, 100.f), down = std::nextafter(x, 0.f);
    EXPECT_GT(e2m1_to_f32(e2m1_from_f32(up)), e2m1_to_f32(e2m1_from_f32(down))) << x;
  }
  EXPECT_EQ(e2m1_from_f32(6.5f), 0x7);     // saturates
  EXPECT_EQ(e2m1_from_f32(1e30f), 0x7);
  EXPECT_EQ(e2m1_from_f32(-INFINITY), 0xF);
  EXPECT_EQ(e2m1_from_f32(NAN), 0x7);      // NVIDIA: NaN -> +MAXNORM (E2M1 has no NaN)
  EXPECT_EQ(e2m1_from_f32(1e-30f), 0x0);
}

TEST(E4M3, EveryCodeDecodesAndRoundTrips) {
  for (uint32_t c = 0; c < 256; ++c) {
    const float v = e4m3_to_f32(static_cast<uint8_t>(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(v), ref_decode(c, 4, 3, 7)) << c;
    EXPECT_EQ(e4m3_from_f32(v), c) << c;
  }
  EXPECT_EQ(e4m3_to_f32(0x7E), 448.f);
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.f, -9));
}

TEST(E4M3, SaturatesAndHandlesSpecials) {
  EXPECT_EQ(e4m3_from_f32(449.f), 0x7E);
  EXPECT_EQ(e4m3_from_f32(464.f), 0x7E);  // the midpoint to the (NaN) code above still saturates
  EXPECT_EQ(e4m3_from_f32(1e30f), 0x7E);
  EXPECT_EQ(e4m3_from_f32(INFINITY), 0x7E);
  EXPECT_EQ(e4m3_from_f32(-INFINITY), 0xFE);
  EXPECT_EQ(e4m3_from_f32(NAN), 0x7F);
  EXPECT_EQ(e4m3_from_f32(-0.f), 0x80);
  EXPECT_EQ(e4m3_from_f32(std::ldexp(1.f, -10)), 0x00);                          // tie -> even (0)
  EXPECT_EQ(e4m3_from_f32(std::nextafter(std::ldexp(1.f, -10), 1.f)), 0x01);     // just above -> 2^-9
  EXPECT_EQ(e4m3_from_f32(std::ldexp(3.f, -10)), 0x02);                          // 1.5 ulp tie -> even (2)
}

TEST(E5M2, EveryCodeDecodesAndRoundTrips) {
  for (uint32_t c = 0; c < 256; ++c) {
    const float v = e5m2_to_f32(static_cast<uint8_t>(c));
    if ((c & 0x7C) == 0x7C) {
      EXPECT_TRUE((c & 3) == 0 ? std::isinf(v) : std::isnan(v)) << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(v), ref_decode(c, 5, 2, 15)) << c;
    EXPECT_EQ(e5m2_from_f32(v), c) << c;
  }
  EXPECT_EQ(e5m2_from_f32(INFINITY), 0x7B);  // satfinite
  EXPECT_EQ(e5m2_from_f32(1e9f), 0x7B);
}

TEST(E8M0, EveryCodeDecodesAndRoundTrips) {
  for (uint32_t c = 0; c < 255; ++c) {
    const float v = e8m0_to_f32(static_cast<uint8_t>(c));
    EXPECT_EQ(static_cast<double>(v), std::ldexp(1.0, int(c) - 127)) << c;
    EXPECT_EQ(e8m0_from_f32_ceil(v), c) << c;
    EXPECT_EQ(e8m0_from_f32_floor(v), c) << c;
  }
  EXPECT_TRUE(std::isnan(e8m0_to_f32(0xFF)));
  EXPECT_GT(e8m0_to_f32(0x00), 0.f);  // code 0 is 2^-127, not zero
  EXPECT_EQ(e8m0_from_f32_ceil(1.0000001f), 128);
  EXPECT_EQ(e8m0_from_f32_floor(1.9999999f), 127);
  EXPECT_EQ(e8m0_from_f32_ceil(0.f), 0);
  EXPECT_EQ(e8m0_from_f32_ceil(INFINITY), 0xFE);
  EXPECT_EQ(e8m0_from_f32_ceil(NAN), 0xFF);
  EXPECT_EQ(e8m0_from_f32_ceil(-2.f), 128);  // magnitude only
}

TEST(BF16, RoundsToNearestEven) {
  EXPECT_EQ(bf16_from_f32(1.f), 0x3F80);
  EXPECT_EQ(bf16_from_f32(bits_to_f32(0x3F808000u)), 0x3F80);  // tie -> even
  EXPECT_EQ(bf16_from_f32(bits_to_f32(0x3F818000u)), 0x3F82);  // tie -> even (up)
  EXPECT_EQ(bf16_from_f32(bits_to_f32(0x3F808001u)), 0x3F81);
  EXPECT_EQ(bf16_from_f32(bits_to_f32(0x7F7FFFFFu)), 0x7F80);  // overflow -> Inf
  EXPECT_EQ(bf16_from_f32(NAN), 0x7FFF);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float v = bf16_to_f32(static_cast<uint16_t>(h));
    if (!std::isnan(v)) {
      EXPECT_EQ(bf16_from_f32(v), h) << h;
    }
  }
}

TEST(FP16, EveryCodeRoundTripsAndTiesToEven) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float v = fp16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(v)) continue;
    EXPECT_EQ(fp16_from_f32(v), h) << h;
  }
  EXPECT_EQ(fp16_from_f32(65504.f), 0x7BFF);
  EXPECT_EQ(fp16_from_f32(65519.f), 0x7BFF);
  EXPECT_EQ(fp16_from_f32(65520.f), 0x7C00);  // tie above max rounds to even = Inf
  EXPECT_EQ(fp16_from_f32(std::ldexp(1.f, -25)), 0x0000);
  EXPECT_EQ(fp16_from_f32(std::nextafter(std::ldexp(1.f, -25), 1.f)), 0x0001);
  EXPECT_EQ(fp16_to_f32(0x3C00), 1.f);
}

TEST(Formats, ConstexprEvaluation) {
  static_assert(e4m3_from_f32(448.f) == 0x7E);
  static_assert(e2m1_from_f32(3.5f) == 0x6);
  static_assert(e8m0_from_f32_ceil(480.f / 448.f) == 128);
  static_assert(bf16_from_f32(1.f) == 0x3F80);
  SUCCEED();
}

}  // namespace
}  // namespace k3
