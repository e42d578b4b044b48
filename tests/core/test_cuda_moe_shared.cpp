// The host + device functions of the CUDA fused-MoE kernels (src/cuda/moe/moe_shared.hpp),
// compiled here by the host compiler: the same source the kernels run, checked against the
// contract (k3/moe_ref.hpp, k3/mx.hpp) without a GPU. Each test pins one defect of the first
// review of the CUDA backend (docs/cuda_moe.md, "Defects fixed").
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "cuda/moe/moe_shared.hpp"
#include "k3/cuda_moe.hpp"
#include "k3/formats.hpp"
#include "k3/moe_ref.hpp"
#include "k3/mx.hpp"

namespace k3::cuda::moe_detail {
namespace {

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

bool same_class(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return true;
}

// ---- defect 1: the SwiGLU clamps propagate NaN ----------------------------------------------

TEST(CudaMoeShared, ClampsKeepNan) {
  EXPECT_TRUE(std::isnan(min_keep_nan(kNan, 7.0f)));
  EXPECT_TRUE(std::isnan(clamp_keep_nan(kNan, -7.0f, 7.0f)));
  EXPECT_EQ(min_keep_nan(9.0f, 7.0f), 7.0f);
  EXPECT_EQ(min_keep_nan(-9.0f, 7.0f), -9.0f);
  EXPECT_EQ(min_keep_nan(kInf, 7.0f), 7.0f);
  EXPECT_EQ(clamp_keep_nan(9.0f, -7.0f, 7.0f), 7.0f);
  EXPECT_EQ(clamp_keep_nan(-kInf, -7.0f, 7.0f), -7.0f);
  EXPECT_EQ(clamp_keep_nan(3.0f, -7.0f, 7.0f), 3.0f);
}

// Every activation against the FP64 contract formulas, including NaN / Inf gate and up values
// and values beyond the SwiGLU limit: same NaN / Inf class, finite values within FP32 error.
TEST(CudaMoeShared, ActivationMatchesContractIncludingNonFinite) {
  // (No finite gate below -87: FP32 exp(-g) overflows there and SiLU's FP32 sigmoid is 0 while
  // the FP64 one is tiny but nonzero, a range difference, not a NaN / clamp question.)
  const float vals[] = {kNan, -kInf, kInf, -1e30f, -50.0f, -7.5f, -7.0f, -1.0f, -0.0f, 0.0f,
                        0.3f, 2.5f,  6.99f, 7.0f,  7.01f,  50.0f, 3e38f};
  Activation a;
  a.swiglu_limit = 7.0f;
  int nan_cases = 0;
  for (ActivationKind kind : {ActivationKind::kSiTU, ActivationKind::kSwiGLU, ActivationKind::kSiLU}) {
    a.kind = kind;
    for (float g : vals) {
      for (float u : vals) {
        const float got = activation_f32(kind, a.swiglu_alpha, a.swiglu_beta, a.swiglu_limit, a.situ_beta,
                                         a.situ_linear_beta, g, u);
        // The contract: FP64, rounded once to FP32 (k3/moe_ref.hpp step 3).
        const double ref = round_to_f32(activation_ref(a, g, u, a.situ_beta, a.situ_linear_beta));
        const std::string what = std::string(activation_name(kind)) + " g=" + std::to_string(g) +
                                 " u=" + std::to_string(u) + " got " + std::to_string(got) + " ref " +
                                 std::to_string(ref);
        ASSERT_TRUE(same_class(got, ref)) << what;
        if (std::isnan(ref)) ++nan_cases;
        if (std::isfinite(ref) && std::isfinite(got)) {
          EXPECT_LE(std::fabs(got - ref), 1e-5 * std::fabs(ref) + 1e-30) << what;
        }
      }
    }
  }
  EXPECT_GT(nan_cases, 0);
  // The cases fminf / fmaxf got wrong: a NaN gate or up value becomes a finite clamp there.
  EXPECT_TRUE(std::isnan(activation_f32(ActivationKind::kSwiGLU, 1.702f, 1.0f, 7.0f, 4, 25, kNan, 1.0f)));
  EXPECT_TRUE(std::isnan(activation_f32(ActivationKind::kSwiGLU, 1.702f, 1.0f, 7.0f, 4, 25, 1.0f, kNan)));
}

TEST(CudaMoeShared, ActivationReadsThePerExpertSituBetas) {
  const float b[] = {4.0f, 2.0f}, lb[] = {25.0f, 3.0f};
  const ActParams p{ActivationKind::kSiTU, 1.702f, 1.0f, 7.0f, b, lb};
  Activation a;
  for (int e = 0; e < 2; ++e) {
    const double ref = activation_ref(a, 5.0, 9.0, b[e], lb[e]);
    EXPECT_NEAR(activation_f32(p, e, 5.0f, 9.0f), ref, 1e-5 * std::fabs(ref)) << e;
  }
  const ActParams sw{ActivationKind::kSwiGLU, 1.702f, 1.0f, 7.0f, nullptr, nullptr};  // betas unread
  EXPECT_TRUE(std::isnan(activation_f32(sw, 0, kNan, 2.0f)));
}

// ---- defect 4: scale 0xFF in the FP4 -> BF16 exponent add -----------------------------------

// For every scale code and packed byte: whenever prepack's exactness check
// (mx_find_bf16_inexact_block) accepts the block, the kernels' conversion gives exactly the
// contract's FP32 dequantization (NaN for the whole block under scale 0xFF).
TEST(CudaMoeShared, Fp4ToBf16IsExactWheneverPrepackAccepts) {
  int accepted = 0;
  for (int sc = 0; sc < 256; ++sc) {
    for (int byte = 0; byte < 256; ++byte) {
      const std::vector<uint8_t> q(kMxBlock / 2, static_cast<uint8_t>(byte));
      const std::vector<uint8_t> s(1, static_cast<uint8_t>(sc));
      if (mx_find_bf16_inexact_block(q, s, 1, kMxBlock, MxElement::kE2M1)) continue;
      ++accepted;
      const uint32_t pair = fp4x2_to_bf16x2(static_cast<uint32_t>(byte), static_cast<uint8_t>(sc));
      for (int half = 0; half < 2; ++half) {
        const uint8_t code = static_cast<uint8_t>(half == 0 ? byte & 0xF : byte >> 4);
        const float ref = mx_decode_element(code, static_cast<uint8_t>(sc), MxElement::kE2M1);
        const float got = bf16_to_f32(static_cast<uint16_t>(pair >> (16 * half)));
        if (std::isnan(ref)) {
          ASSERT_TRUE(std::isnan(got)) << "scale " << sc << " code " << int{code} << " got " << got;
        } else {
          ASSERT_EQ(f32_to_bits(got), f32_to_bits(ref)) << "scale " << sc << " code " << int{code};
        }
      }
    }
  }
  EXPECT_GT(accepted, 200 * 256);
  // Scale 0xFF is accepted by prepack and gives NaN for every code, zero included.
  for (uint32_t byte = 0; byte < 256; ++byte) {
    const uint32_t pair = fp4x2_to_bf16x2(byte, kE8M0Nan);
    EXPECT_TRUE(std::isnan(bf16_to_f32(static_cast<uint16_t>(pair)))) << byte;
    EXPECT_TRUE(std::isnan(bf16_to_f32(static_cast<uint16_t>(pair >> 16)))) << byte;
  }
}

}  // namespace
}  // namespace k3::cuda::moe_detail
