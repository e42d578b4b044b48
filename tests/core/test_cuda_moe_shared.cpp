// The host + device functions of the CUDA fused-MoE kernels (src/cuda/moe/moe_shared.hpp),
// compiled here by the host compiler: the same source the kernels run, checked against the
// contract (k3/moe_ref.hpp, k3/mx.hpp) without a GPU. Each test pins one defect of the first
// review of the CUDA backend (docs/cuda_moe.md, "Defects fixed").
#include <gtest/gtest.h>

#include <optional>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "cuda_caps_util.hpp"
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

// ---- defect 2: prep_x calls a block exact when its FP32 dequantization overflows ----------------

// The contract's step 1 for one block: MXFP8 (RCEIL) and the FP32 dequantization (k3/mx.hpp).
std::vector<float> contract_block(const uint16_t* x) {
  std::vector<uint8_t> q(kMxBlock), s(1);
  EXPECT_TRUE(mx_quantize_bf16(std::span<const uint16_t>(x, kMxBlock), 1, kMxBlock, MxElement::kE4M3,
                               ScaleRule::kRceil, q, s)
                  .is_ok());
  std::vector<float> out(kMxBlock);
  for (int j = 0; j < kMxBlock; ++j) out[j] = mx_decode_element(q[j], s[0], MxElement::kE4M3);
  return out;
}

void expect_matches_contract(const uint16_t* x, const uint16_t* got, const std::string& what) {
  const auto ref = contract_block(x);
  for (int j = 0; j < kMxBlock; ++j) {
    if (std::isnan(ref[j])) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(got[j]))) << what << " element " << j;
    } else {
      EXPECT_EQ(got[j], bf16_from_f32(ref[j])) << what << " element " << j;
      EXPECT_EQ(bf16_to_f32(got[j]), ref[j]) << what << " element " << j << ": BF16 must hold it exactly";
    }
  }
}

TEST(CudaMoeShared, PrepBlockOverflowToInfIsExact) {
  uint16_t x[kMxBlock], dst[kMxBlock];
  // The nonfinite suite's "largest finite BF16": scale 2^120, element 256 -> 2^128 = +Inf in FP32.
  for (auto& v : x) v = 0x7F7F;
  x[3] = 0xFF7F;  // -max
  EXPECT_TRUE(w4a8_prep_block(x, dst)) << "BF16 holds the contract's +-Inf exactly";
  EXPECT_EQ(dst[0], 0x7F80);
  EXPECT_EQ(dst[3], 0xFF80);
  expect_matches_contract(x, dst, "max");
  // +Inf and -Inf in a block of ordinary values: scale 0xFE, Inf elements -> +-448 * 2^127 = +-Inf.
  for (int j = 0; j < kMxBlock; ++j) x[j] = bf16_from_f32(static_cast<float>(j) - 16.0f);
  x[5] = 0x7F80;
  x[9] = 0xFF80;
  EXPECT_TRUE(w4a8_prep_block(x, dst));
  EXPECT_EQ(dst[5], 0x7F80);
  EXPECT_EQ(dst[9], 0xFF80);
  expect_matches_contract(x, dst, "inf");
  // The per-element predicate: 448 * 2^127 overflows FP32; mx_element_bf16_exact (BF16's normal
  // range, the old check) calls it inexact, the operand check does not.
  EXPECT_FALSE(mx_element_bf16_exact(0x7E, 0xFE, MxElement::kE4M3));
  EXPECT_TRUE(mx_bf16_operand_exact(0x7E, 0xFE, MxElement::kE4M3));
}

TEST(CudaMoeShared, PrepBlockMatchesContractAndFlagsSubnormals) {
  uint16_t x[kMxBlock], dst[kMxBlock];
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int rep = 0; rep < 200; ++rep) {
    const float scale = std::ldexp(1.0f, rep % 60 - 30);
    for (auto& v : x) v = bf16_from_f32(nd(rng) * scale);
    ASSERT_TRUE(w4a8_prep_block(x, dst)) << rep;
    expect_matches_contract(x, dst, "random " + std::to_string(rep));
  }
  // NaN block: scale 0xFF, every element NaN; exact (NaN is NaN).
  for (auto& v : x) v = 0x3F80;
  x[17] = 0x7FC0;
  EXPECT_TRUE(w4a8_prep_block(x, dst));
  for (uint16_t h : dst) EXPECT_TRUE(std::isnan(bf16_to_f32(h)));
  // A subnormal next to 1.0 rounds to 0 under the block's scale: that 0 is the contract's value.
  for (auto& v : x) v = 0;
  x[0] = 0x3F80;
  x[1] = 0x0001;
  EXPECT_TRUE(w4a8_prep_block(x, dst));
  EXPECT_EQ(dst[1], 0);
  // A block of BF16 subnormals dequantizes into BF16's subnormal range: flagged, not rounded silently.
  for (auto& v : x) v = 0x0003;
  EXPECT_FALSE(w4a8_prep_block(x, dst));
  // W4A16-size magnitudes near 2^-126 stay normal: exact.
  for (auto& v : x) v = 0x0080;  // 2^-126, the smallest normal
  EXPECT_TRUE(w4a8_prep_block(x, dst));
  expect_matches_contract(x, dst, "min normal");
}

// ---- defect 7: the re-quantized W4A8 activation in the subnormal range ----------------------

TEST(CudaMoeShared, ActivationRequantFlagsSubnormalRange) {
  auto scale_of = [](const float (&v)[8]) {
    float amax = 0;
    for (float f : v) amax = std::fmax(amax, std::fabs(f));
    return mx_scale_code(amax, MxElement::kE4M3, ScaleRule::kRceil);
  };
  uint16_t h[8];
  // Ordinary values: exact, equal to the contract's MXFP8 value.
  const float ok[8] = {1.5f, -3.25f, 100.0f, 0.0f, -0.0f, 7.0f, 96.0f, -448.0f};
  const uint8_t sc_ok = scale_of(ok);
  EXPECT_TRUE(mxfp8_bf16_operands(ok, sc_ok, h));
  for (int t = 0; t < 8; ++t) {
    const float ref = mx_decode_element(mx_encode_element(ok[t], sc_ok, MxElement::kE4M3), sc_ok, MxElement::kE4M3);
    EXPECT_EQ(h[t], bf16_from_f32(ref)) << t;
  }
  // A block of tiny activations (|v| ~ 1e-39, FP32 subnormals): the MXFP8 values lie in BF16's
  // subnormal range, so the BF16 operand would round (or be flushed): flagged.
  const float tiny[8] = {1e-39f, -2e-39f, 3e-40f, 0.0f, 5e-39f, 1e-39f, -1e-39f, 2e-39f};
  EXPECT_FALSE(mxfp8_bf16_operands(tiny, scale_of(tiny), h));
  // Near 2^-120 with a small element in the same block: 2^-128 is subnormal -> flagged.
  const float mixed[8] = {std::ldexp(1.0f, -120), std::ldexp(1.0f, -128), 0, 0, 0, 0, 0, 0};
  EXPECT_FALSE(mxfp8_bf16_operands(mixed, scale_of(mixed), h));
  // Overflow of the FP32 dequantization (an Inf activation, SwiGLU / SiLU): +-Inf, exact.
  const float inf[8] = {kInf, 1.0f, -kInf, 0, 0, 0, 0, 0};
  EXPECT_TRUE(mxfp8_bf16_operands(inf, scale_of(inf), h));
  EXPECT_EQ(h[0], 0x7F80);
  EXPECT_EQ(h[2], 0xFF80);
  // A NaN block (the quad agreed on scale 0xFF): NaN everywhere, exact.
  const float some[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  EXPECT_TRUE(mxfp8_bf16_operands(some, kE8M0Nan, h));
  for (uint16_t v : h) EXPECT_TRUE(std::isnan(bf16_to_f32(v)));
  EXPECT_EQ(kStatusInexactAct & kStatusInexactX, 0) << "distinct status bits";
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

// ---- defect 5: the token count read from device memory --------------------------------------

TEST(CudaMoeShared, TokenCountIsClampedToMaxM) {
  EXPECT_EQ(clamp_tokens(0, 8), 0);
  EXPECT_EQ(clamp_tokens(5, 8), 5);
  EXPECT_EQ(clamp_tokens(8, 8), 8);
  EXPECT_EQ(clamp_tokens(9, 8), 8);
  EXPECT_EQ(clamp_tokens(INT32_MAX, 65536), 65536);
  EXPECT_EQ(clamp_tokens(-1, 8), 0);
  EXPECT_EQ(clamp_tokens(INT32_MIN, 8), 0);
}

// ---- defect 3: launch geometry within CUDA's grid limits for every plan ---------------------

DeviceCaps h200() { return test::h200_caps(); }

void expect_within_limits(const Grid& g, const std::string& what) {
  EXPECT_GE(g.x, 1u) << what;
  EXPECT_GE(g.y, 1u) << what;
  EXPECT_GE(g.z, 1u) << what;
  EXPECT_LE(int64_t{g.x}, kMaxGridX) << what;
  EXPECT_LE(int64_t{g.y}, kMaxGridYZ) << what;
  EXPECT_LE(int64_t{g.z}, kMaxGridYZ) << what;
}

TEST(CudaMoeShared, LaunchGridsStayWithinLimitsUpToTheLargestPlan) {
  struct S { int e, ep, top_k; int64_t k, n; };
  const S shapes[] = {{896, 32, 16, 3584, 3072}, {4096, 1, 32, 64, 32}, {32, 32, 1, 96, 160}, {4096, 4096, 32, 32, 64}};
  for (const auto& sh : shapes) {
    for (int64_t max_m : {int64_t{1}, int64_t{16}, int64_t{4096}, int64_t{65535}, int64_t{65536}}) {
    // The plan's own choice, and the mma.sync prefill path forced onto every size (more row tiles
    // than gridDim.y allows: its kernels grid-stride over the tiles).
    for (const std::optional<MoePath> forced : {std::optional<MoePath>{}, std::optional<MoePath>{MoePath::kPrefill}}) {
      MoeProblem p;
      p.shape = {sh.k, sh.n, sh.e, sh.top_k, sh.ep, 0};
      MoeOptions o{.max_tokens = max_m, .device = h200()};
      o.path = forced;
      auto plan = cuda::plan(p, o);
      ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
      const Dims d = dims_of(plan.value());
      const std::string what = "E " + std::to_string(sh.e) + "/" + std::to_string(sh.ep) + " top-" +
                               std::to_string(sh.top_k) + " max_m " + std::to_string(max_m) + " path " +
                               moe_path_name(plan->path);
      expect_within_limits(prep_grid(d), what + " prep_x");
      expect_within_limits(gemm_grid(d, true, plan->block_n), what + " fc1");
      expect_within_limits(gemm_grid(d, false, plan->block_n), what + " fc2");
      const Grid f = finalize_grid(d);
      expect_within_limits(f, what + " finalize");
      // The mma.sync GEMMs launch one CTA per row tile up to gridDim.y's limit and grid-stride past it.
      EXPECT_EQ(int64_t{gemm_grid(d, true, plan->block_n).y}, std::min<int64_t>(d.max_tiles, kMaxGridYZ)) << what;
      EXPECT_EQ(int64_t{gemm_grid(d, true, plan->block_n).x} * plan->block_n, d.n) << what;
      EXPECT_EQ(int64_t{gemm_grid(d, false, plan->block_n).x} * plan->block_n, d.k) << what;
      // Sort: one CTA of `chunk` threads per chunk, covering every slot.
      EXPECT_GE(int64_t{d.chunks} * d.chunk, d.max_slots) << what;
      EXPECT_LE(d.chunk, 1024) << what;
      // Finalize covers every (row, column) exactly once with its grid-stride over rows.
      EXPECT_GE(int64_t{f.x} * kFinalizeThreads, d.k) << what;
      std::vector<int> visits(static_cast<size_t>(d.max_m), 0);
      for (int64_t by = 0; by < f.y; ++by) {
        for (int64_t t = by; t < d.max_m; t += f.y) ++visits[static_cast<size_t>(t)];
      }
      for (int64_t t = 0; t < d.max_m; ++t) ASSERT_EQ(visits[static_cast<size_t>(t)], 1) << what << " row " << t;
      // prep_x covers every (token, block) with its grid-stride.
      EXPECT_GE(int64_t{prep_grid(d).x} * kPrepThreads, std::min<int64_t>(d.max_m * (d.k / kMxBlock), kMaxGridX))
          << what;
      // The mma.sync GEMMs visit every row tile exactly once (tile = blockIdx.y; tile += gridDim.y).
      const int64_t gy = gemm_grid(d, true, plan->block_n).y;
      std::vector<int> tile_visits(static_cast<size_t>(d.max_tiles), 0);
      for (int64_t by = 0; by < gy; ++by) {
        for (int64_t t = by; t < d.max_tiles; t += gy) ++tile_visits[static_cast<size_t>(t)];
      }
      for (int64_t t = 0; t < d.max_tiles; ++t) ASSERT_EQ(tile_visits[static_cast<size_t>(t)], 1) << what << " tile " << t;
    }
    }
  }
  // The case a grid of max_m rows gets wrong: gridDim.y = 65536 is not launchable.
  MoeProblem p;
  auto plan = cuda::plan(p, {.max_tokens = 65536, .device = h200()});
  ASSERT_TRUE(plan.is_ok());
  EXPECT_EQ(finalize_grid(dims_of(plan.value())).y, 65535u);
}

}  // namespace
}  // namespace k3::cuda::moe_detail
