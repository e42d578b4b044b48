// Planning of the CUDA fused-MoE backend: pure host logic, tested without a GPU.
#include <gtest/gtest.h>

#include "k3/cuda_moe.hpp"

namespace k3::cuda {
namespace {

DeviceCaps h200() {
  DeviceCaps c;
  c.name = "NVIDIA H200";
  c.cc_major = 9;
  c.cc_minor = 0;
  c.sm_count = 132;
  c.smem_per_block_optin = 227 * 1024;
  c.compiled_archs = {90, 120};
  return c;
}

MoeProblem kimi_rank7() {
  MoeProblem p;
  p.shape.ep_size = 32;
  p.shape.ep_rank = 7;
  return p;
}

TEST(CudaMoePlan, KimiDecodeAndPrefillPaths) {
  auto d = plan_moe(kimi_rank7(), 1, h200());
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(d->path, MoePath::kDecode);
  EXPECT_EQ(d->block_m, 16);
  EXPECT_EQ(d->block_n, 64);  // 3072 and 3584 are multiples of 64
  EXPECT_EQ(d->max_slots, 16);
  // every expert may need one padded tile: ceil((16 + 28 * 15) / 16)
  EXPECT_EQ(d->max_tiles, (16 + 28 * 15 + 15) / 16);
  auto p = plan_moe(kimi_rank7(), 2048, h200());
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(p->path, MoePath::kPrefill);
  EXPECT_EQ(p->block_m, 64);
  EXPECT_NE(p->to_string().find("path prefill"), std::string::npos) << p->to_string();
}

TEST(CudaMoePlan, WorkspaceRegionsAreDisjointAndAligned) {
  auto p = plan_moe(kimi_rank7(), 128, h200());
  ASSERT_TRUE(p.is_ok());
  const int64_t offs[] = {p->ws_x_bf16, p->ws_slot_row, p->ws_row_token, p->ws_tile_expert, p->ws_counts,
                          p->ws_chunk_hist, p->ws_act, p->ws_y, p->ws_status, p->workspace_bytes};
  for (size_t i = 0; i + 1 < std::size(offs); ++i) {
    EXPECT_LT(offs[i], offs[i + 1]) << i;
    EXPECT_EQ(offs[i] % 256, 0) << i;
  }
  const int64_t rows = p->max_tiles * p->block_m;
  EXPECT_GE(p->ws_y - p->ws_act, rows * 3072 * 2);
  EXPECT_GE(p->ws_status - p->ws_y, rows * 3584 * 4);
}

TEST(CudaMoePlan, OddShapeUsesNarrowTiles) {
  MoeProblem p;
  p.shape.hidden = 96;
  p.shape.intermediate = 160;
  p.shape.num_experts = 5;
  p.shape.top_k = 3;
  auto plan = plan_moe(p, 19, h200());
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  EXPECT_EQ(plan->block_n, 32);
}

TEST(CudaMoePlan, MissingCapabilitiesNameTheFixAndTheAlternative) {
  DeviceCaps ampere = h200();
  ampere.name = "NVIDIA A100";
  ampere.cc_major = 8;
  auto r = plan_moe(kimi_rank7(), 1, ampere);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(r.status().message().find("sm_80"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("sm_90, sm_120"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("--backend cpu"), std::string::npos);

  DeviceCaps tiny = h200();
  tiny.smem_per_block_optin = 1024;
  r = plan_moe(kimi_rank7(), 4096, tiny);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("shared memory"), std::string::npos) << r.status().message();

  EXPECT_EQ(plan_moe(kimi_rank7(), 0, h200()).status().code(), StatusCode::kInvalidArgument);
  MoeProblem bad = kimi_rank7();
  bad.shape.hidden = 3583;
  EXPECT_NE(plan_moe(bad, 1, h200()).status().message().find("hidden (K) = 3583"), std::string::npos);
}

}  // namespace
}  // namespace k3::cuda

namespace k3::cuda {
namespace {

TEST(CudaMoePlan, Sm120NativePathIsOptInAndChecked) {
  MoeProblem p;
  DeviceCaps h = h200();
  MoePlanOptions native;
  native.sm120_native_w4a8 = true;
  auto r = plan_moe(p, 8, h, native);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("needs an sm_120 device"), std::string::npos) << r.status().message();

  DeviceCaps rtx = h;
  rtx.name = "NVIDIA RTX PRO 6000 Blackwell";
  rtx.cc_major = 12;
  rtx.smem_per_block_optin = 99 * 1024;
  auto off = plan_moe(p, 8, rtx);
  ASSERT_TRUE(off.is_ok());
  EXPECT_FALSE(off->sm120_native);  // default: the BF16 mma.sync path
  auto on = plan_moe(p, 8, rtx, native);
  ASSERT_TRUE(on.is_ok()) << on.status().to_string();
  EXPECT_TRUE(on->sm120_native);
  EXPECT_GT(on->ws_act_scales, on->ws_act_codes);
  EXPECT_NE(on->to_string().find("UNVERIFIED"), std::string::npos);
  p.recipe = Recipe::kW4A16;
  EXPECT_NE(plan_moe(p, 8, rtx, native).status().message().find("w4a8 recipe only"), std::string::npos);
}

}  // namespace
}  // namespace k3::cuda
