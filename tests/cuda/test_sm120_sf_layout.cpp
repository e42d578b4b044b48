// k3's scale-factor index function of the sm_120a block-scaled GEMM against CUTLASS's own layout
// (Sm1xxBlockScaledConfig<32>::tile_atom_to_shape_SFA / _SFB, the layouts the GEMM's setup kernel
// hands to CUTLASS), offset by offset. CuTe layouts evaluate on the host: no device needed, so
// this runs on every machine where k3_cuda_tests is built with the CUTLASS headers.
#include <gtest/gtest.h>

#include "cuda_cutlass/moe_sm120_blockscaled_layout.hpp"

#if defined(K3_HAVE_CUTLASS)
#include "cute/tensor.hpp"
#include "cutlass/detail/sm100_blockscaled_layout.hpp"
#endif

namespace {

using namespace k3::cuda::sm120_bs;

#if defined(K3_HAVE_CUTLASS)
using SfConfig = cutlass::detail::Sm1xxBlockScaledConfig<32>;

TEST(Sm120SfLayout, EveryOffsetMatchesCutlass) {
  int64_t compared = 0;
  for (int rows : {1, 5, 31, 32, 33, 127, 128, 129, 255, 256, 300, 1000}) {
    for (int k : {128, 256, 384, 512, 1024, 2048, 7168}) {
      // As A (rows = M) and as B (rows = N): the two layouts the GEMM uses.
      const auto la = SfConfig::tile_atom_to_shape_SFA(cute::make_shape(rows, 64, k, 1));
      const auto lb = SfConfig::tile_atom_to_shape_SFB(cute::make_shape(64, rows, k, 1));
      ASSERT_EQ(static_cast<int64_t>(cute::cosize(la)), sf_bytes(rows, k)) << rows << " x " << k;
      ASSERT_EQ(static_cast<int64_t>(cute::cosize(lb)), sf_bytes(rows, k)) << rows << " x " << k;
      for (int r = 0; r < rows; ++r) {
        for (int b = 0; b < k / 32; ++b) {
          // CUTLASS indexes the SF tensor by element (row, k, batch); the 32 elements of a block share one offset.
          for (int e : {0, 31}) {
            ASSERT_EQ(static_cast<int64_t>(la(r, b * 32 + e, 0)), sf_offset(r, b, k)) << "A " << rows << " x " << k << " at " << r << ", " << b;
            ASSERT_EQ(static_cast<int64_t>(lb(r, b * 32 + e, 0)), sf_offset(r, b, k)) << "B " << rows << " x " << k << " at " << r << ", " << b;
          }
          ++compared;
        }
      }
    }
  }
  EXPECT_GT(compared, 100000);
}
#else
TEST(Sm120SfLayout, EveryOffsetMatchesCutlass) { GTEST_SKIP() << "built without the CUTLASS headers"; }
#endif

}  // namespace
