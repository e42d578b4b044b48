// The one-shot all-reduce over CUDA peer-mapped (IPC) buffers (k3/comm_ipc.hpp) at world size 1:
// the only world size one GPU can run (its handles are exported and its flags / epochs / slot
// alternation run, but no peer is mapped, so the cross-rank signalling is NOT exercised here).
// The one-shot results must equal the NCCL-path two-shot and the CPU all-reduce bit for bit.
// Skips, saying why, without a CUDA device. Ran on an H200 (2026-12-04): pass.
//
// The device communicator is a world-size-1 one made here (alltoallv = a device copy), so the
// two-shot code path (allreduce_*_device) runs without NCCL; tests/cuda/test_nccl.cpp covers NCCL.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "k3/allreduce.hpp"
#include "k3/comm.hpp"
#include "k3/comm_ipc.hpp"
#include "k3/comm_nccl.hpp"
#include "k3/formats.hpp"

namespace k3 {
namespace {

class SelfDevice final : public comm::DeviceCommunicator {
 public:
  explicit SelfDevice(comm::Communicator& host, int device) : host_(host), device_(device) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  int device() const override { return device_; }
  comm::Communicator& host() override { return host_; }
  Status alltoallv(const void* send, std::span<const int64_t> send_bytes, void* recv,
                   std::span<const int64_t> recv_bytes, void* stream) override {
    if (send_bytes.size() != 1 || recv_bytes.size() != 1 || send_bytes[0] != recv_bytes[0]) {
      return invalid_argument("SelfDevice::alltoallv: one equal count expected");
    }
    if (send_bytes[0] == 0) return Status::ok();
    return cudaMemcpyAsync(recv, send, static_cast<size_t>(send_bytes[0]), cudaMemcpyDeviceToDevice,
                           static_cast<cudaStream_t>(stream)) == cudaSuccess
               ? Status::ok()
               : unavailable("cudaMemcpyAsync failed");
  }
  Status native_allreduce_sum_f32(float*, int64_t, void*) override { return Status::ok(); }
  Status synchronize(void* stream) override {
    return cudaStreamSynchronize(static_cast<cudaStream_t>(stream)) == cudaSuccess ? Status::ok()
                                                                                   : unavailable("cudaStreamSynchronize");
  }

 private:
  comm::Communicator& host_;
  int device_;
};

class IpcDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const Status a = comm::ipc_available(); !a.is_ok()) GTEST_SKIP() << a.message();
    host_ = comm::make_self_communicator();
    int d = 0;
    ASSERT_EQ(cudaGetDevice(&d), cudaSuccess);
    dev_ = std::make_unique<SelfDevice>(*host_, d);
    auto g = comm::make_ipc_allreduce_group(*dev_, {.capacity_bytes = kCap});
    ASSERT_TRUE(g.is_ok()) << g.status().to_string();
    ipc_ = std::move(g).value();
    ASSERT_EQ(ipc_->size(), 1);
    ASSERT_EQ(ipc_->capacity_bytes(), kCap);
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  ~IpcDevice() override {
    for (void* p : bufs_) cudaFree(p);
  }
  uint16_t* upload(const std::vector<uint16_t>& v) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, v.size() * 2 + 2), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    bufs_.push_back(p);
    return static_cast<uint16_t*>(p);
  }
  std::vector<uint16_t> download(const uint16_t* p, size_t n) {
    std::vector<uint16_t> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  static constexpr int64_t kCap = int64_t{64} << 10;  // 64 KiB: 32768 BF16
  std::unique_ptr<comm::Communicator> host_;
  std::unique_ptr<SelfDevice> dev_;
  std::unique_ptr<comm::IpcAllreduceGroup> ipc_;
  cudaStream_t stream_ = nullptr;
  std::vector<void*> bufs_;
};

// Wide exponent range, both signs, zeros, some Inf / NaN.
std::vector<uint16_t> hostile(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (auto& h : v) {
    const uint32_t r = static_cast<uint32_t>(rng());
    h = static_cast<uint16_t>(r & 0xFFFF);
    if ((r >> 16) % 97 == 0) h = 0x7F80;
    if (((h >> 7) & 0xFF) == 0xFF && (r >> 24) % 3) h ^= 0x4000;
  }
  return v;
}

TEST_F(IpcDevice, OneShotEqualsTwoShotAndTheCpuBitForBitOverSeveralEpochs) {
  // Two calls per shape, six in all: epochs 1..6, each data slot used three times.
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{9, 3584}, {7, 100}, {1, 32768}}) {
    for (int rep = 0; rep < 2; ++rep) {
      const auto x = hostile(rows * cols, 11 + static_cast<uint64_t>(cols + rep));
      std::vector<uint16_t> want(x.size());
      ASSERT_TRUE(comm::allreduce_bf16(*host_, x, rows, cols, want).is_ok());
      uint16_t* dx = upload(x);
      uint16_t* one = upload(std::vector<uint16_t>(x.size(), 0xDEAD));
      uint16_t* two = upload(std::vector<uint16_t>(x.size(), 0xBEEF));
      ASSERT_TRUE(comm::allreduce_bf16_oneshot(*ipc_, dx, rows, cols, one, stream_).is_ok());
      ASSERT_TRUE(ipc_->synchronize(stream_).is_ok());
      ASSERT_TRUE(comm::allreduce_bf16_device(*dev_, dx, rows, cols, two, stream_).is_ok());
      ASSERT_TRUE(dev_->synchronize(stream_).is_ok());
      EXPECT_EQ(download(one, x.size()), want) << rows << " x " << cols;
      EXPECT_EQ(download(two, x.size()), want) << rows << " x " << cols;
    }
  }
}

TEST_F(IpcDevice, AddRmsNormOneShotEqualsTwoShotAndTheCpuIncludingInPlaceResidual) {
  const int64_t rows = 4, cols = 3584;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> x(rows * cols), res(rows * cols), gamma(cols);
  for (auto& v : x) v = bf16_from_f32(nd(rng));
  for (auto& v : res) v = bf16_from_f32(nd(rng));
  for (auto& v : gamma) v = bf16_from_f32(1.0f + 0.1f * nd(rng));
  for (const bool with_residual : {true, false}) {
    std::vector<uint16_t> out(x.size()), rout(x.size());
    ASSERT_TRUE(comm::allreduce_add_rmsnorm_bf16(*host_, x, with_residual ? std::span<const uint16_t>(res)
                                                                          : std::span<const uint16_t>(),
                                                 gamma, rows, cols, 1e-5f, out, rout)
                    .is_ok());
    uint16_t* dx = upload(x);
    uint16_t* dg = upload(gamma);
    uint16_t* dres = upload(res);  // updated in place by the one-shot (residual_out == residual)
    uint16_t* dres2 = upload(res);
    uint16_t* one = upload(std::vector<uint16_t>(x.size(), 0));
    uint16_t* two = upload(std::vector<uint16_t>(x.size(), 0));
    uint16_t* rtwo = upload(std::vector<uint16_t>(x.size(), 0));
    ASSERT_TRUE(comm::allreduce_add_rmsnorm_bf16_oneshot(*ipc_, dx, with_residual ? dres : nullptr, dg, rows, cols,
                                                         1e-5f, one, dres, stream_)
                    .is_ok());
    ASSERT_TRUE(ipc_->synchronize(stream_).is_ok());
    ASSERT_TRUE(comm::allreduce_add_rmsnorm_bf16_device(*dev_, dx, with_residual ? dres2 : nullptr, dg, rows, cols,
                                                        1e-5f, two, rtwo, stream_)
                    .is_ok());
    ASSERT_TRUE(dev_->synchronize(stream_).is_ok());
    EXPECT_EQ(download(one, x.size()), out) << "residual " << with_residual;
    EXPECT_EQ(download(dres, x.size()), rout) << "residual " << with_residual;
    EXPECT_EQ(download(two, x.size()), out) << "residual " << with_residual;
    EXPECT_EQ(download(rtwo, x.size()), rout) << "residual " << with_residual;
  }
}

TEST_F(IpcDevice, DispatcherPicksByCapacityAndBothPathsGiveTheCpuBits) {
  const int64_t cols = 1024;  // kCap = 64 KiB = 32 rows of 1024 BF16
  for (const auto& [rows, path] : {std::pair<int64_t, comm::AllreducePath>{32, comm::AllreducePath::kOneShotIpc},
                                   {33, comm::AllreducePath::kTwoShotNccl},
                                   {1, comm::AllreducePath::kOneShotIpc}}) {
    const auto x = hostile(rows * cols, 100 + static_cast<uint64_t>(rows));
    std::vector<uint16_t> want(x.size());
    ASSERT_TRUE(comm::allreduce_bf16(*host_, x, rows, cols, want).is_ok());
    uint16_t* dx = upload(x);
    uint16_t* dout = upload(std::vector<uint16_t>(x.size(), 0xDEAD));
    auto r = comm::allreduce_bf16_auto(*dev_, ipc_.get(), dx, rows, cols, dout, stream_);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_EQ(r.value(), path) << rows << " rows: " << comm::to_string(r.value());
    ASSERT_TRUE(r.value() == comm::AllreducePath::kOneShotIpc ? ipc_->synchronize(stream_).is_ok()
                                                              : dev_->synchronize(stream_).is_ok());
    EXPECT_EQ(download(dout, x.size()), want) << rows << " rows";
  }
  // No group: always the two-shot.
  const auto x = hostile(cols, 3);
  uint16_t* dx = upload(x);
  uint16_t* dout = upload(std::vector<uint16_t>(x.size(), 0));
  auto r = comm::allreduce_bf16_auto(*dev_, nullptr, dx, 1, cols, dout, stream_);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r.value(), comm::AllreducePath::kTwoShotNccl);
  ASSERT_TRUE(dev_->synchronize(stream_).is_ok());
}

TEST_F(IpcDevice, OneShotAboveTheCapacityIsRefusedAndTheGroupStaysUsable) {
  const int64_t rows = 33, cols = 1024;
  const auto x = hostile(rows * cols, 9);
  uint16_t* dx = upload(x);
  uint16_t* dout = upload(std::vector<uint16_t>(x.size(), 0));
  const Status s = comm::allreduce_bf16_oneshot(*ipc_, dx, rows, cols, dout, stream_);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("33 x 1024 x 2 = 67584 bytes exceeds the IPC buffer's capacity_bytes = 65536"),
            std::string::npos)
      << s.message();
  const Status n = comm::allreduce_add_rmsnorm_bf16_oneshot(*ipc_, dx, nullptr, dx, rows, cols, 1e-5f, dout, dout,
                                                            stream_);
  EXPECT_NE(n.message().find("allreduce_add_rmsnorm_bf16_oneshot: the message"), std::string::npos) << n.message();
  // A fitting call afterwards still works (the refusal moved no epoch).
  std::vector<uint16_t> want(static_cast<size_t>(cols));
  const std::vector<uint16_t> head(x.begin(), x.begin() + cols);
  ASSERT_TRUE(comm::allreduce_bf16(*host_, head, 1, cols, want).is_ok());
  ASSERT_TRUE(comm::allreduce_bf16_oneshot(*ipc_, dx, 1, cols, dout, stream_).is_ok());
  ASSERT_TRUE(ipc_->synchronize(stream_).is_ok());
  EXPECT_EQ(download(dout, static_cast<size_t>(cols)), want);
  // A group made from another device communicator is refused by the dispatcher.
  SelfDevice other(*host_, dev_->device());
  auto r = comm::allreduce_bf16_auto(other, ipc_.get(), dx, 1, cols, dout, stream_);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("made from another DeviceCommunicator"), std::string::npos)
      << r.status().message();
}

}  // namespace
}  // namespace k3
