// The NCCL transport's refusals on a machine that cannot run it (no CUDA backend, no NCCL or no
// device): a clear reason, the same from every entry point, and never a crash.
#include <gtest/gtest.h>

#include "k3/comm.hpp"
#include "k3/comm_nccl.hpp"

namespace k3 {
namespace {

TEST(NcclHost, UnavailableSaysWhyAndMakeReturnsTheSameReason) {
  const Status a = comm::nccl_available();
  if (a.is_ok()) GTEST_SKIP() << "NCCL and a CUDA device are present: tests/cuda/test_nccl.cpp covers this machine";
  EXPECT_FALSE(a.message().empty());
  const bool known = a.message().find("built without the CUDA backend") != std::string::npos ||
                     a.message().find("NCCL could not be opened") != std::string::npos ||
                     a.message().find("no CUDA device") != std::string::npos;
  EXPECT_TRUE(known) << a.message();
  auto self = comm::make_self_communicator();
  auto c = comm::make_nccl_communicator(*self);
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find(a.message()), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("rank 0 of 1: "), std::string::npos) << c.status().message();
}

}  // namespace
}  // namespace k3
