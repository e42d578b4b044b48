#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>

#include "k3/harness/digest.hpp"
#include "k3/status.hpp"
#include "k3/system.hpp"

namespace k3 {
namespace {

TEST(CpuInfo, FeaturesAreConsistent) {
  const auto& info = cpu_info();
  EXPECT_FALSE(info.model.empty());
  EXPECT_GE(info.logical_cpus, 1);
  const auto& f = info.features;
  if (f.avx512bw || f.avx512vl || f.avx512_bf16 || f.avx512_vnni) {
    EXPECT_TRUE(f.avx512f);
  }
  if (f.avx512f || f.avx_vnni) {
    EXPECT_TRUE(f.avx2);
  }
}

TEST(CpuInfo, ThreadCountHonoursEnvironment) {
  setenv("K3_NUM_THREADS", "3", 1);
  EXPECT_EQ(default_thread_count(), 3);
  setenv("K3_NUM_THREADS", "0", 1);  // ignored: not positive
  unsetenv("OMP_NUM_THREADS");
  EXPECT_EQ(default_thread_count(), cpu_info().logical_cpus);
  unsetenv("K3_NUM_THREADS");
}

TEST(CpuInfo, HardwareThreadCountIgnoresTheEnvironment) {
  setenv("K3_NUM_THREADS", "3", 1);
  setenv("OMP_NUM_THREADS", "5", 1);
  EXPECT_EQ(hardware_thread_count(), std::max(1, cpu_info().logical_cpus));
  EXPECT_EQ(default_thread_count(), 3);
  EXPECT_EQ(default_thread_count_source(), "K3_NUM_THREADS=3");
  unsetenv("K3_NUM_THREADS");
  EXPECT_EQ(default_thread_count(), 5);
  unsetenv("OMP_NUM_THREADS");
  EXPECT_EQ(default_thread_count(), hardware_thread_count());
}

TEST(Digest, Sha256KnownVectors) {
  EXPECT_EQ(sha256_hex({}), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  const std::string abc = "abc";
  EXPECT_EQ(sha256_hex({reinterpret_cast<const uint8_t*>(abc.data()), abc.size()}),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Status, MessagesCarryTheCode) {
  const Status st = invalid_argument("cols = 33 must be a multiple of 32");
  EXPECT_FALSE(st.is_ok());
  EXPECT_EQ(st.to_string(), "INVALID_ARGUMENT: cols = 33 must be a multiple of 32");
  Result<int> r = out_of_range("x");
  EXPECT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange);
  Result<int> v = 5;
  EXPECT_TRUE(v.is_ok());
  EXPECT_EQ(*v, 5);
}

}  // namespace
}  // namespace k3

namespace k3 {
namespace {

TEST(Isa, ParseAndForce) {
  EXPECT_EQ(parse_isa_level("scalar").value(), IsaLevel::kScalar);
  const auto bad = parse_isa_level("sse9");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("'sse9' is unknown"), std::string::npos);
  if (best_isa_level() != IsaLevel::kAvx512Bf16) {
    EXPECT_EQ(parse_isa_level("avx512bf16").status().code(), StatusCode::kUnsupported);
  }
  setenv("K3_ISA", "scalar", 1);
  EXPECT_EQ(active_isa_level().value(), IsaLevel::kScalar);
  setenv("K3_ISA", "bogus", 1);
  EXPECT_NE(active_isa_level().status().message().find("K3_ISA"), std::string::npos);
  unsetenv("K3_ISA");
  EXPECT_EQ(active_isa_level().value(), best_isa_level());
}

}  // namespace
}  // namespace k3
