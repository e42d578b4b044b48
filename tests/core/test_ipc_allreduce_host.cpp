// The one-shot IPC all-reduce's host-side parts (k3/comm_ipc.hpp), runnable without a GPU: the
// dispatcher's rule by message size, the options check, and the refusals of a machine that
// cannot make an IPC group (no CUDA backend, or no device), agreed over the host communicator.
#include <gtest/gtest.h>

#include <string>

#include "k3/comm.hpp"
#include "k3/comm_ipc.hpp"
#include "k3/comm_nccl.hpp"

namespace k3 {
namespace {

using comm::AllreducePath;

TEST(IpcAllreduceHost, DispatcherChoosesOneShotUpToTheCapacityAndTwoShotAbove) {
  const int64_t cap = int64_t{1} << 20;  // 1 MiB = 524288 BF16
  EXPECT_EQ(comm::choose_allreduce_path(cap, 128, 4096), AllreducePath::kOneShotIpc);   // exactly 1 MiB
  EXPECT_EQ(comm::choose_allreduce_path(cap, 129, 4096), AllreducePath::kTwoShotNccl);  // 1 MiB + 8 KiB
  EXPECT_EQ(comm::choose_allreduce_path(cap, 1, 524288), AllreducePath::kOneShotIpc);
  EXPECT_EQ(comm::choose_allreduce_path(cap, 1, 524289), AllreducePath::kTwoShotNccl);
  EXPECT_EQ(comm::choose_allreduce_path(cap, 0, 0), AllreducePath::kOneShotIpc);
  EXPECT_EQ(comm::choose_allreduce_path(cap, int64_t{1} << 40, 0), AllreducePath::kOneShotIpc);  // empty
  // No group (IPC unavailable): always NCCL. Bad shapes go to the two-shot, whose check names them.
  EXPECT_EQ(comm::choose_allreduce_path(0, 1, 1), AllreducePath::kTwoShotNccl);
  EXPECT_EQ(comm::choose_allreduce_path(cap, -1, 8), AllreducePath::kTwoShotNccl);
  EXPECT_EQ(comm::choose_allreduce_path(cap, 8, -1), AllreducePath::kTwoShotNccl);
  // rows * cols * 2 would overflow int64: two-shot, not a wrapped "fits".
  EXPECT_EQ(comm::choose_allreduce_path(cap, int64_t{1} << 40, int64_t{1} << 40), AllreducePath::kTwoShotNccl);
  EXPECT_NE(std::string(comm::to_string(AllreducePath::kOneShotIpc)).find("one-shot"), std::string::npos);
  EXPECT_NE(std::string(comm::to_string(AllreducePath::kTwoShotNccl)).find("NCCL"), std::string::npos);
}

TEST(IpcAllreduceHost, OptionsCheckNamesTheFieldAndTheRange) {
  EXPECT_TRUE(comm::check_ipc_options({}).is_ok());
  for (const int64_t bad : {int64_t{0}, int64_t{255}, int64_t{1000}, comm::kIpcMaxCapacityBytes + 256}) {
    const Status s = comm::check_ipc_options({.capacity_bytes = bad});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("IpcOptions.capacity_bytes = " + std::to_string(bad)), std::string::npos) << s.message();
  }
  EXPECT_TRUE(comm::check_ipc_options({.capacity_bytes = comm::kIpcMaxCapacityBytes}).is_ok());
  for (const double bad : {0.0, -1.0, 3601.0}) {
    const Status s = comm::check_ipc_options({.timeout_s = bad});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("IpcOptions.timeout_s"), std::string::npos) << s.message();
  }
}

// A DeviceCommunicator that moves nothing: enough for the group's refusals and the dispatcher's
// argument checks, which happen before any device work.
class NoDevice final : public comm::DeviceCommunicator {
 public:
  NoDevice() : host_(comm::make_self_communicator()) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  int device() const override { return 0; }
  comm::Communicator& host() override { return *host_; }
  Status alltoallv(const void*, std::span<const int64_t>, void*, std::span<const int64_t>, void*) override {
    return unavailable("NoDevice moves nothing");
  }
  Status native_allreduce_sum_f32(float*, int64_t, void*) override { return unavailable("NoDevice"); }
  Status synchronize(void*) override { return Status::ok(); }

 private:
  std::unique_ptr<comm::Communicator> host_;
};

TEST(IpcAllreduceHost, MakeGroupRefusesBadOptionsAndAMachineWithoutIpc) {
  NoDevice dev;
  auto bad = comm::make_ipc_allreduce_group(dev, {.capacity_bytes = 100});
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("rank 0 of 1: IpcOptions.capacity_bytes = 100"), std::string::npos)
      << bad.status().message();

  const Status a = comm::ipc_available();
  if (a.is_ok()) GTEST_SKIP() << "a CUDA device is present: tests/cuda/test_ipc_allreduce.cpp covers this machine";
  const bool known = a.message().find("built without the CUDA backend") != std::string::npos ||
                     a.message().find("no CUDA device") != std::string::npos;
  EXPECT_TRUE(known) << a.message();
  auto g = comm::make_ipc_allreduce_group(dev);
  ASSERT_FALSE(g.is_ok());
  EXPECT_NE(g.status().message().find(a.message()), std::string::npos) << g.status().message();
  EXPECT_NE(g.status().message().find("rank 0 of 1: "), std::string::npos) << g.status().message();
}

TEST(IpcAllreduceHost, DispatcherWithoutAGroupTakesTheTwoShotAndItsArgumentCheck) {
  NoDevice dev;
  // No group: the NCCL two-shot is chosen; its argument check (or, without CUDA, its
  // unavailability) is the answer, and no device memory is touched.
  auto r = comm::allreduce_bf16_auto(dev, nullptr, nullptr, -1, 8, nullptr, nullptr);
  ASSERT_FALSE(r.is_ok());
  const bool expected = r.status().message().find("allreduce_bf16_device: rows = -1") != std::string::npos ||
                        r.status().message().find("built without the CUDA backend") != std::string::npos;
  EXPECT_TRUE(expected) << r.status().message();
  auto n = comm::allreduce_add_rmsnorm_bf16_auto(dev, nullptr, nullptr, nullptr, nullptr, 2, 2, 0.0f, nullptr, nullptr,
                                                 nullptr);
  ASSERT_FALSE(n.is_ok());
  const bool named = n.status().message().find("allreduce_add_rmsnorm_bf16_device: x, out, gamma") != std::string::npos ||
                     n.status().message().find("built without the CUDA backend") != std::string::npos;
  EXPECT_TRUE(named) << n.status().message();
}

}  // namespace
}  // namespace k3
