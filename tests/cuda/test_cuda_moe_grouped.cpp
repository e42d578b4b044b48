// prefill-sm90 (CUTLASS sm_90a grouped GEMM): the plan's workspace bounds against what the
// compiled CUTLASS instance asks for. Host arithmetic only: runs without a device, skips in
// builds without CUTLASS (where the plan refuses the path anyway).
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "cuda/moe/moe_grouped.hpp"
#include "k3/cuda.hpp"
#include "k3/cuda_moe.hpp"
#include "k3/harness/moe_case.hpp"
#include "k3/harness/moe_compare.hpp"
#include "k3/moe_ref.hpp"

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

// Weights prefill-sm90 cannot re-encode (two MX blocks of one 64-column group 20 binades apart):
// a plan that chose prefill-sm90 itself runs the prefill kernels (effective_path says so, and the
// result still matches the oracle); a forced plan's prepack is refused, naming the place. Device.
TEST(CudaMoeGrouped, UnencodableWeightsFallBackOrAreRefused) {
  auto caps = device_caps(0);
  if (!caps.is_ok()) GTEST_SKIP() << "no CUDA device: " << caps.status().message();
  if (caps->cc_major != 9 || !caps->has_sm90_grouped) GTEST_SKIP() << "needs an sm_90 device and a CUTLASS build";
  MoeCaseSpec spec;
  spec.problem.shape = {64, 64, 4, 2, 1, 0};
  spec.m = 64;  // 64 x top-2 / 4 experts = 32 expected rows per local expert > 16: the plan picks prefill-sm90
  spec.routing = RoutingPattern::kUniform;
  spec.seed = 21;
  auto made = make_moe_case(spec);
  ASSERT_TRUE(made.is_ok()) << made.status().to_string();
  MoeCase c = std::move(made).value();
  // fc1 row 3 of expert 1: block 0 scale 2^-10, block 1 scale 2^+10, both with nonzero codes.
  const int64_t row = 1 * 2 * 64 + 3, blocks = 64 / 32;
  c.fc1_scale[static_cast<size_t>(row * blocks + 0)] = 127 - 10;
  c.fc1_scale[static_cast<size_t>(row * blocks + 1)] = 127 + 10;
  for (int64_t b = 0; b < 64 / 2; ++b) c.fc1_q[static_cast<size_t>(row * 32 + b)] = 0x22;  // 1.0, 1.0
  MoeOptions o{.max_tokens = c.m, .device = caps.value()};
  auto plan = cuda::plan(c.problem, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  ASSERT_EQ(plan->path, MoePath::kPrefillSm90) << plan->describe();
  auto w = prepack(plan.value(), c.weights());
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  EXPECT_EQ(effective_path(plan.value(), w.value()), MoePath::kPrefill);
  std::vector<double> ref(c.m * 64);
  ASSERT_TRUE(moe_oracle(c.problem, c.weights(), c.inputs(), OracleKind::kContract, ref).is_ok());
  std::vector<uint8_t> out(c.m * 64 * out_dtype_size(c.problem.out_dtype));
  ASSERT_TRUE(run_host(c.problem, c.weights(), c.inputs(), out).is_ok());
  auto met = compare_moe_output(out, c.problem.out_dtype, ref, rows_without_local_slot(c.problem.shape, c.inputs()));
  ASSERT_TRUE(met.is_ok());
  std::string why;
  EXPECT_TRUE(within(met.value(), contract_tolerance(c.problem.out_dtype), &why)) << why;
  o.path = MoePath::kPrefillSm90;
  auto forced = cuda::plan(c.problem, o);
  ASSERT_TRUE(forced.is_ok());
  auto refused = prepack(forced.value(), c.weights());
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("14 binades"), std::string::npos) << refused.status().message();
}

}  // namespace
}  // namespace k3::cuda
