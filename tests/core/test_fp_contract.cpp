// k3's core and CPU libraries are compiled without floating-point contraction (-ffp-contract=off,
// CMakeLists.txt) and refuse -ffast-math (k3/config.hpp; the ctest refuses_fast_math). GCC
// contracts a*b+c into an FMA by default wherever FMA is available (any -march with FMA, a
// target("fma") function, every aarch64 build), which would change bits that must agree
// between the CPU and GPU router and between the CPU backend's ISA levels.
#include <gtest/gtest.h>

#include <cmath>

#include "core/sys/fp_contract_probe.hpp"

namespace k3 {
namespace {

TEST(FpContract, CoreAndCpuLibrariesRoundProductsSeparately) {
  if (!detail::fp_contract_probe_runnable()) GTEST_SKIP() << "this CPU has no FMA; contraction cannot happen";
  // a * b = 1 + 2^-11 + 2^-24 rounds (tie to even) to 1 + 2^-11, so a * b + c is 0; fused it is 2^-24.
  volatile float a = 1.0f + 0x1p-12f, b = 1.0f + 0x1p-12f, c = -(1.0f + 0x1p-11f);
  const volatile float product = a * b;
  const float separate = product + c;
  ASSERT_EQ(separate, 0.0f);
  ASSERT_EQ(std::fma(a, b, c), 0x1p-24f) << "the probe's inputs must tell FMA from separate rounding";
  EXPECT_EQ(detail::fp_contract_probe_core(a, b, c), separate) << "k3_core contracts a*b+c into an FMA";
  EXPECT_EQ(detail::fp_contract_probe_cpu(a, b, c), separate) << "k3_cpu contracts a*b+c into an FMA";
}

}  // namespace
}  // namespace k3
