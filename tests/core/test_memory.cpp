// k3/memory.hpp: large buffers (the packed weights) are 2 MiB aligned and advised for transparent
// huge pages; small ones are 64-byte aligned. The advice is checked where the kernel reports it
// (/proc/self/smaps "THPeligible"), against an ordinary allocation of the same size.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "k3/cpu_linear.hpp"
#include "k3/memory.hpp"

namespace k3 {
namespace {

bool aligned(const void* p, std::uintptr_t a) { return reinterpret_cast<std::uintptr_t>(p) % a == 0; }

TEST(HugePages, LargeBuffersAreAlignedAndAdvised) {
  const std::size_t bytes = 5 * kHugePageBytes + 3;
  HugePageVector<uint8_t> v(bytes);
  ASSERT_TRUE(aligned(v.data(), kHugePageBytes));
  for (std::size_t i = 0; i < bytes; i += 4096) v[i] = static_cast<uint8_t>(i >> 12);
  for (std::size_t i = 0; i < bytes; i += 4096) ASSERT_EQ(v[i], static_cast<uint8_t>(i >> 12));
  const std::string mode = huge_page_mode();
  if (mode != "madvise" && mode != "always") {
    GTEST_SKIP() << "transparent huge pages are '" << mode << "' on this machine: the advice has no effect";
  }
  EXPECT_TRUE(huge_pages_eligible(v.data(), v.size())) << "THP mode " << mode;
  if (mode == "madvise") {
    // An ordinary allocation of the same size is not eligible: the test sees the advice itself.
    std::vector<uint8_t> plain(bytes, 1);
    EXPECT_FALSE(huge_pages_eligible(plain.data(), plain.size()));
  }
}

TEST(HugePages, SmallBuffersAre64ByteAlignedAndCopiesWork) {
  HugePageVector<float> a(100, 1.5f);
  EXPECT_TRUE(aligned(a.data(), 64));
  HugePageVector<float> b = a;
  EXPECT_TRUE(aligned(b.data(), 64));
  EXPECT_EQ(a, b);
  HugePageVector<uint8_t> empty;
  empty.reserve(0);
  EXPECT_EQ(empty.size(), 0u);
  EXPECT_FALSE(huge_pages_eligible(nullptr, 0));
}

TEST(HugePages, PackedLinearWeightsUseThem) {
  // 2048 x 1024 MXFP8 codes (2 MiB): the packed codes start on a 2 MiB boundary.
  const int64_t k = 1024, n = 2048;
  LinearProblem p{k, n, LinearRecipe::kW8A16, OutDType::kFP32, false};
  cpu::LinearOptions o;
  o.threads = 1;
  auto plan = cpu::plan(p, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  std::vector<uint8_t> codes(static_cast<size_t>(n * k), 0x38), scales(static_cast<size_t>(n * k / 32), 127);
  LinearWeightsView w;
  w.codes = codes;
  w.scales = scales;
  auto packed = cpu::prepack(plan.value(), w);
  ASSERT_TRUE(packed.is_ok()) << packed.status().message();
  EXPECT_TRUE(aligned(packed->tile_codes(0), kHugePageBytes));
}

}  // namespace
}  // namespace k3
