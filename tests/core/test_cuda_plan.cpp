// Planning of the CUDA fused-MoE backend: pure host logic, tested without a GPU.
#include <gtest/gtest.h>

#include <tuple>

#include "cuda_caps_util.hpp"
#include "k3/cuda_moe.hpp"

namespace k3::cuda {
namespace {

DeviceCaps h200() { return test::h200_caps(); }

MoeProblem kimi_rank7() {
  MoeProblem p;
  p.shape.ep_size = 32;
  p.shape.ep_rank = 7;
  return p;
}

TEST(CudaMoePlan, KimiDecodeAndPrefillPaths) {
  auto d = cuda::plan(kimi_rank7(), {.max_tokens = 1, .device = h200()});
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(d->path, MoePath::kDecodeSplitK);  // the automatic decode choice
  EXPECT_EQ(d->block_m, 16);
  EXPECT_EQ(d->block_n, 64);  // 3072 and 3584 are multiples of 64
  EXPECT_EQ(d->max_slots, 16);
  // every expert may need one padded tile: ceil((16 + 28 * 15) / 16)
  EXPECT_EQ(d->max_tiles, (16 + 28 * 15 + 15) / 16);
  auto p = cuda::plan(kimi_rank7(), {.max_tokens = 2048, .device = h200()});
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(p->path, MoePath::kPrefill);
  EXPECT_EQ(p->block_m, 64);
  EXPECT_NE(p->describe().find("path prefill"), std::string::npos) << p->describe();
  EXPECT_NE(p->describe().find("max_tokens 2048"), std::string::npos) << p->describe();
}

// MoeOptions::path overrides the choice (tests, the device check); describe() says so, and the
// tile follows the forced path. Names round-trip; an unknown name lists the known ones.
TEST(CudaMoePlan, ForcedPathOverridesTheChoice) {
  MoeOptions o{.max_tokens = 1, .device = h200()};
  o.path = MoePath::kPrefill;
  auto p = cuda::plan(kimi_rank7(), o);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->path, MoePath::kPrefill);
  EXPECT_TRUE(p->path_forced);
  EXPECT_EQ(p->block_m, 64);
  EXPECT_NE(p->describe().find("path prefill (forced by the options)"), std::string::npos) << p->describe();
  auto a = cuda::plan(kimi_rank7(), {.max_tokens = 1, .device = h200()});
  ASSERT_TRUE(a.is_ok());
  EXPECT_FALSE(a->path_forced);
  EXPECT_EQ(a->describe().find("forced"), std::string::npos) << a->describe();
  for (MoePath path : {MoePath::kPrefill, MoePath::kDecodeSplitK, MoePath::kPrefillSm90, MoePath::kW4a8Sm120Cutlass}) {
    auto back = moe_path_from_name(moe_path_name(path));
    ASSERT_TRUE(back.is_ok());
    EXPECT_EQ(back.value(), path);
  }
  auto bad = moe_path_from_name("fast");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("'fast' is not one of prefill, decode-splitk, prefill-sm90, w4a8-sm120-cutlass"), std::string::npos)
      << bad.status().message();
}

// The path follows the rows each LOCAL expert can expect (max_tokens * top_k / E under uniform
// routing), not max_tokens * top_k / E_local: at EP 32 a rank sees 1/32 of the slots.
TEST(CudaMoePlan, PathFollowsTheExpectedRowsPerLocalExpert) {
  for (const auto& [ep, max_tokens, want] : {std::tuple{32, 512, MoePath::kDecodeSplitK},   // 512 * 16 / 896 = 9.1
                                             std::tuple{32, 896, MoePath::kDecodeSplitK},   // 16.0
                                             std::tuple{32, 1024, MoePath::kPrefill},       // 18.3
                                             std::tuple{1, 512, MoePath::kDecodeSplitK},
                                             std::tuple{1, 2048, MoePath::kPrefill}}) {
    MoeProblem pr;
    pr.shape.ep_size = ep;
    pr.shape.ep_rank = ep - 1;
    auto p = cuda::plan(pr, {.max_tokens = max_tokens, .device = h200()});
    ASSERT_TRUE(p.is_ok()) << p.status().to_string();
    EXPECT_EQ(p->path, want) << "ep " << ep << " max_tokens " << max_tokens;
    EXPECT_DOUBLE_EQ(p->expected_rows_per_local_expert, max_tokens * 16.0 / 896.0);
    EXPECT_NE(p->describe().find("rows per local expert"), std::string::npos) << p->describe();
  }
}

// decode-splitk (the automatic decode path): tile 16 token rows x 64 weight rows, 8 warps split K,
// static shared memory for the partials, CTA counts and the split in describe(); the old decode
// path stays selectable.
TEST(CudaMoePlan, DecodeSplitKGeometryAndDescribe) {
  auto p = cuda::plan(kimi_rank7(), {.max_tokens = 64, .device = h200()});
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->path, MoePath::kDecodeSplitK);
  EXPECT_FALSE(p->path_forced);
  EXPECT_EQ(p->block_m, 16);
  EXPECT_EQ(p->splitk_warps, 8);
  EXPECT_EQ(p->splitk_rows, 64);
  EXPECT_EQ(p->smem_bytes, 8 * 4 * 2 * 4 * 32 * 4);  // 32 KB of FP32 partials
  EXPECT_EQ(p->splitk_fc1_ctas, p->max_tiles * (2 * 3072 / 64));
  EXPECT_EQ(p->splitk_fc2_ctas, p->max_tiles * (3584 / 64));
  const std::string s = p->describe();
  EXPECT_NE(s.find("path decode-splitk"), std::string::npos) << s;
  EXPECT_NE(s.find("K split over 8 warps"), std::string::npos) << s;
  EXPECT_NE(s.find("16 token rows (2 n-tiles of 8) x 64 weight rows"), std::string::npos) << s;
  // The old forced-only "decode" path (mma.sync tiles of 16 rows) is gone: one decode path.
  auto gone = moe_path_from_name("decode");
  ASSERT_FALSE(gone.is_ok());
  EXPECT_NE(gone.status().message().find("'decode' is not one of"), std::string::npos) << gone.status().message();
  // Odd shapes (K, N multiples of 32, not of 64) plan too; FC2's last row group is half full.
  MoeProblem odd;
  odd.shape.hidden = 96;
  odd.shape.intermediate = 160;
  odd.shape.num_experts = 5;
  odd.shape.top_k = 3;
  auto q = cuda::plan(odd, {.max_tokens = 19, .device = h200()});
  ASSERT_TRUE(q.is_ok());
  EXPECT_EQ(q->path, MoePath::kDecodeSplitK);  // 19 * 3 / 5 = 11.4 rows per expert
  EXPECT_EQ(q->splitk_fc2_ctas, q->max_tiles * 2);
}

TEST(CudaMoePlan, WorkspaceRegionsAreDisjointAndAligned) {
  auto p = cuda::plan(kimi_rank7(), {.max_tokens = 128, .device = h200()});
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
  auto plan = cuda::plan(p, {.max_tokens = 19, .device = h200()});
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  EXPECT_EQ(plan->block_n, 32);
}

TEST(CudaMoePlan, MissingCapabilitiesNameTheFixAndTheAlternative) {
  DeviceCaps ampere = h200();
  ampere.name = "NVIDIA A100";
  ampere.cc_major = 8;
  auto r = cuda::plan(kimi_rank7(), {.max_tokens = 1, .device = ampere});
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(r.status().message().find("sm_80"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("sm_90, sm_120"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("--backend cpu"), std::string::npos);

  DeviceCaps tiny = h200();
  tiny.smem_per_block_optin = 1024;
  r = cuda::plan(kimi_rank7(), {.max_tokens = 4096, .device = tiny});
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("shared memory"), std::string::npos) << r.status().message();

  const auto zero = cuda::plan(kimi_rank7(), {.max_tokens = 0, .device = h200()});
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(zero.status().message().find("max_tokens = 0 must be in [1, 65536]"), std::string::npos);
  cuda::MoeOptions no_device_options;  // device left empty
  no_device_options.max_tokens = 1;
  const auto no_device = cuda::plan(kimi_rank7(), no_device_options);
  EXPECT_EQ(no_device.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_device.status().message().find("options.device is empty"), std::string::npos)
      << no_device.status().message();
  MoeProblem bad = kimi_rank7();
  bad.shape.hidden = 3583;
  EXPECT_NE(cuda::plan(bad, {.max_tokens = 1, .device = h200()}).status().message().find("hidden (K) = 3583"), std::string::npos);
}

}  // namespace
}  // namespace k3::cuda

namespace k3::cuda {
namespace {

// sm_120 plans the same canonical paths as sm_90 (decode-splitk, prefill); its block-scaled W4A8
// GEMM (w4a8-sm120-cutlass) is taken only when forced. There is no other sm_120 W4A8 option.
TEST(CudaMoePlan, Sm120PlansTheCanonicalPaths) {
  MoeProblem p;
  DeviceCaps rtx = h200();
  rtx.name = "NVIDIA RTX PRO 6000 Blackwell";
  rtx.cc_major = 12;
  rtx.smem_per_block_optin = 99 * 1024;
  rtx.compiled_archs = {90, 120};
  rtx.has_sm120_blockscaled = true;
  for (const auto& [max_tokens, want] : {std::pair{8, MoePath::kDecodeSplitK}, std::pair{8192, MoePath::kPrefill}}) {
    auto r = cuda::plan(p, {.max_tokens = max_tokens, .device = rtx});
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_EQ(r->path, want) << max_tokens;
    EXPECT_EQ(r->block_m, want == MoePath::kDecodeSplitK ? 16 : 64);
    EXPECT_EQ(r->describe().find("UNVERIFIED"), std::string::npos) << r->describe();  // no opt-in native MMA path
  }
}

// w4a8-sm120-cutlass (CUTLASS sm_120a block-scaled GEMMs) is forced only, and every condition it
// needs is checked by name: an sm_120 device, a build with its GEMM, W4A8, K and N multiples of 128.
TEST(CudaMoePlan, W4a8Sm120CutlassIsForcedOnlyAndChecked) {
  MoeProblem p;  // Kimi: K 3584, N 3072 (multiples of 128), W4A8
  DeviceCaps rtx = h200();
  rtx.name = "NVIDIA RTX PRO 6000 Blackwell";
  rtx.cc_major = 12;
  rtx.sm_count = 188;
  rtx.smem_per_block_optin = 99 * 1024;
  rtx.has_sm120_blockscaled = true;
  for (int64_t max_tokens : {1, 64, 8192}) {  // never the plan's own choice
    auto a = cuda::plan(p, {.max_tokens = max_tokens, .device = rtx});
    ASSERT_TRUE(a.is_ok()) << a.status().to_string();
    EXPECT_NE(a->path, MoePath::kW4a8Sm120Cutlass);
  }
  MoeOptions o{.max_tokens = 64, .device = rtx};
  o.path = MoePath::kW4a8Sm120Cutlass;
  auto ok = cuda::plan(p, o);
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_EQ(ok->block_m, 64);
  EXPECT_EQ(ok->sm_count, 188);
  EXPECT_NE(ok->describe().find("w4a8-sm120-cutlass (NEVER RUN ON ANY GPU)"), std::string::npos) << ok->describe();
  auto back = moe_path_from_name("w4a8-sm120-cutlass");
  ASSERT_TRUE(back.is_ok());
  EXPECT_EQ(back.value(), MoePath::kW4a8Sm120Cutlass);

  const auto refused = [&](const MoeProblem& pr, MoeOptions opt, const std::string& want) {
    auto r = cuda::plan(pr, opt);
    ASSERT_FALSE(r.is_ok()) << want;
    EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status().message();
  };
  MoeOptions on_h200 = o;
  on_h200.device = h200();
  refused(p, on_h200, "needs an sm_120 device; 'NVIDIA H200' is sm_90");
  MoeOptions not_built = o;
  not_built.device.has_sm120_blockscaled = false;
  refused(p, not_built, "not in this build");
  MoeProblem w4a16 = p;
  w4a16.recipe = Recipe::kW4A16;
  refused(w4a16, o, "runs the w4a8 recipe only, not w4a16");
  MoeProblem k96 = p;
  k96.shape.hidden = 96;
  refused(k96, o, "K and N multiples of 128 (CUTLASS's scale-factor atoms); K = 96, N = 3072");
  MoeOptions no_sms = o;
  no_sms.device.sm_count = 0;
  refused(p, no_sms, "sm_count = 0 must be >= 1");
}

}  // namespace
}  // namespace k3::cuda

namespace k3::cuda {
namespace {

DeviceCaps h200_with_cutlass() {
  DeviceCaps c = h200();
  c.has_sm90_grouped = true;
  return c;
}

// prefill-sm90 is the plan's choice above the decode threshold on sm_90 builds that have it;
// otherwise the mma.sync prefill path, as before. Decode stays decode-splitk.
TEST(CudaMoePlan, PrefillSm90IsChosenOnSm90BuildsWithCutlass) {
  auto p = cuda::plan(kimi_rank7(), {.max_tokens = 2048, .device = h200_with_cutlass()});
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->path, MoePath::kPrefillSm90);
  EXPECT_FALSE(p->path_forced);
  EXPECT_EQ(p->block_m, 64);  // the sort pads experts to 64 rows, as for prefill
  EXPECT_EQ(p->sm_count, 132);
  EXPECT_NE(p->describe().find("path prefill-sm90"), std::string::npos) << p->describe();
  EXPECT_NE(p->describe().find("prefill-sm90 (ran on an H200, 2026-12-04)"), std::string::npos) << p->describe();
  EXPECT_NE(p->describe().find("activation not fused"), std::string::npos) << p->describe();
  // describe() says that the plan's own prefill-sm90 choice may run the prefill kernels; a forced
  // one cannot (its prepack fails instead).
  EXPECT_NE(p->describe().find("cuda::effective_path names the path that runs"), std::string::npos) << p->describe();
  MoeOptions forced{.max_tokens = 2048, .device = h200_with_cutlass()};
  forced.path = MoePath::kPrefillSm90;
  auto f = cuda::plan(kimi_rank7(), forced);
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_EQ(f->describe().find("effective_path"), std::string::npos) << f->describe();
  auto d = cuda::plan(kimi_rank7(), {.max_tokens = 512, .device = h200_with_cutlass()});
  ASSERT_TRUE(d.is_ok());
  EXPECT_EQ(d->path, MoePath::kDecodeSplitK);  // the automatic decode choice, unchanged
  auto without = cuda::plan(kimi_rank7(), {.max_tokens = 2048, .device = h200()});
  ASSERT_TRUE(without.is_ok());
  EXPECT_EQ(without->path, MoePath::kPrefill) << "hand-written caps default to 'not built'";
  EXPECT_EQ(without->ws_xg, 0);
  DeviceCaps rtx = h200_with_cutlass();
  rtx.cc_major = 12;
  rtx.smem_per_block_optin = 99 * 1024;
  auto blackwell = cuda::plan(kimi_rank7(), {.max_tokens = 2048, .device = rtx});
  ASSERT_TRUE(blackwell.is_ok());
  EXPECT_EQ(blackwell->path, MoePath::kPrefill);
  auto back = moe_path_from_name("prefill-sm90");
  ASSERT_TRUE(back.is_ok());
  EXPECT_EQ(back.value(), MoePath::kPrefillSm90);
  EXPECT_STREQ(moe_path_name(MoePath::kPrefillSm90), "prefill-sm90");
}

// Forcing prefill-sm90 where it cannot run is an error that names why and the way out.
TEST(CudaMoePlan, ForcedPrefillSm90IsRefusedWithoutSm90OrCutlass) {
  MoeOptions o{.max_tokens = 64, .device = h200()};
  o.path = MoePath::kPrefillSm90;
  auto r = cuda::plan(kimi_rank7(), o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(r.status().message().find("rebuild after scripts/setup.sh fetched CUTLASS"), std::string::npos)
      << r.status().message();
  o.device = h200_with_cutlass();
  o.device.name = "NVIDIA RTX PRO 6000 Blackwell";
  o.device.cc_major = 12;
  r = cuda::plan(kimi_rank7(), o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("needs an sm_90 device; 'NVIDIA RTX PRO 6000 Blackwell' is sm_120"),
            std::string::npos)
      << r.status().message();
  o.device = h200_with_cutlass();
  o.device.sm_count = 0;
  r = cuda::plan(kimi_rank7(), o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("sm_count = 0"), std::string::npos) << r.status().message();
  o.device = h200_with_cutlass();
  r = cuda::plan(kimi_rank7(), o);  // forced below the decode threshold: allowed, says so
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->path, MoePath::kPrefillSm90);
  EXPECT_NE(r->describe().find("path prefill-sm90 (forced by the options)"), std::string::npos) << r->describe();
}

// The prefill-sm90 regions follow the others, disjoint and aligned, and cover the gathered rows,
// the FP32 GEMM1 output and the bounds for the group arrays and CUTLASS's workspace.
TEST(CudaMoePlan, PrefillSm90WorkspaceCoversEverything) {
  for (int64_t max_tokens : {int64_t{1}, int64_t{2048}, int64_t{65536}}) {
    MoeOptions o{.max_tokens = max_tokens, .device = h200_with_cutlass()};
    o.path = MoePath::kPrefillSm90;
    auto p = cuda::plan(kimi_rank7(), o);
    ASSERT_TRUE(p.is_ok()) << p.status().to_string();
    const int64_t offs[] = {p->ws_x_bf16, p->ws_slot_row, p->ws_row_token, p->ws_tile_expert, p->ws_counts,
                            p->ws_chunk_hist, p->ws_act, p->ws_y, p->ws_status, p->ws_xg, p->ws_h,
                            p->ws_sm90_arrays, p->ws_cutlass, p->workspace_bytes};
    for (size_t i = 0; i + 1 < std::size(offs); ++i) {
      EXPECT_LT(offs[i], offs[i + 1]) << i;
      EXPECT_EQ(offs[i] % 256, 0) << i;
    }
    const int64_t rows = p->max_tiles * p->block_m, k = 3584, n = 3072;
    EXPECT_GE(p->ws_h - p->ws_xg, rows * k * 2);
    EXPECT_GE(p->ws_sm90_arrays - p->ws_h, rows * 2 * n * 4);
    EXPECT_GE(p->ws_cutlass - p->ws_sm90_arrays, p->sm90_arrays_bytes);
    EXPECT_GE(p->sm90_arrays_bytes, 28 * kSm90ArraysBytesPerExpert);
    EXPECT_GE(p->workspace_bytes - p->ws_cutlass, p->cutlass_bytes);
    EXPECT_GE(p->cutlass_bytes, 132 * kSm90CutlassWorkspacePerSm);
    EXPECT_EQ(p->cutlass_bytes % 256, 0) << "each GEMM's half stays 128-byte aligned (TMA descriptors)";
  }
}

}  // namespace
}  // namespace k3::cuda
