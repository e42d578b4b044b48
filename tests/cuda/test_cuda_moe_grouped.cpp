// prefill-sm90 (CUTLASS sm_90a grouped GEMM): the plan's workspace bounds against what the
// compiled CUTLASS instance asks for. Host arithmetic only: runs without a device, skips in
// builds without CUTLASS (where the plan refuses the path anyway).
#include <gtest/gtest.h>

#include <cstdio>

#include "cuda/moe/moe_grouped.hpp"
#include "k3/cuda.hpp"
#include "k3/cuda_moe.hpp"

namespace k3::cuda {
namespace {

TEST(CudaMoeGrouped, PlanReservesWhatCutlassAsksFor) {
  if (!moe_detail::sm90_grouped_built()) GTEST_SKIP() << "this build has no CUTLASS (prefill-sm90 not built)";
  for (int sm_count : {1, 66, 78, 114, 132, 144, 264}) {
    for (int e_local : {1, 5, 28, 896, 4096}) {
      MoeProblem p;
      p.shape = {64, 64, e_local, 1, 1, 0};
      DeviceCaps caps;
      caps.name = "sm_90 test device";
      caps.cc_major = 9;
      caps.sm_count = sm_count;
      caps.smem_per_block_optin = 227 * 1024;
      caps.compiled_archs = {90};
      caps.has_sm90_grouped = true;
      MoeOptions o{.max_tokens = 256, .device = caps};
      o.path = MoePath::kPrefillSm90;
      auto plan = cuda::plan(p, o);
      ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
      EXPECT_GE(static_cast<size_t>(plan->cutlass_bytes), moe_detail::sm90_cutlass_workspace_bytes(sm_count))
          << "sm_count " << sm_count;
      EXPECT_GE(static_cast<size_t>(plan->sm90_arrays_bytes), moe_detail::sm90_group_arrays_bytes(e_local))
          << "e_local " << e_local;
    }
  }
  std::printf("[ CUTLASS workspace for both GEMMs at 132 SMs: %zu B; group arrays for 28 experts: %zu B ]\n",
              moe_detail::sm90_cutlass_workspace_bytes(132), moe_detail::sm90_group_arrays_bytes(28));
}

}  // namespace
}  // namespace k3::cuda
