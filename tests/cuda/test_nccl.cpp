// The NCCL transport and the device TP all-reduce at world size 1 (one GPU): the device results
// must equal the CPU all-reduce bit for bit (same exact-sum code, same epilogue). Skips, saying
// why, without a CUDA device or without NCCL. On one GPU only world size 1 can be tested: the
// multi-rank transfers are exercised by the MPI tests of the CPU path, not here.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "k3/allreduce.hpp"
#include "k3/comm.hpp"
#include "k3/comm_nccl.hpp"
#include "k3/formats.hpp"

namespace k3 {
namespace {

class NcclDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const Status a = comm::nccl_available(); !a.is_ok()) GTEST_SKIP() << a.message();
    host_ = comm::make_self_communicator();
    auto c = comm::make_nccl_communicator(*host_);
    ASSERT_TRUE(c.is_ok()) << c.status().to_string();
    dev_ = std::move(c).value();
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
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
  ~NcclDevice() override {
    for (void* p : bufs_) cudaFree(p);
  }
  std::unique_ptr<comm::Communicator> host_;
  std::unique_ptr<comm::DeviceCommunicator> dev_;
  cudaStream_t stream_ = nullptr;
  std::vector<void*> bufs_;
};

// Wide exponent range, both signs, zeros, a few Inf / NaN.
std::vector<uint16_t> hostile_rows(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (auto& h : v) {
    const uint32_t r = static_cast<uint32_t>(rng());
    h = static_cast<uint16_t>(r & 0xFFFF);
    if ((r >> 16) % 97 == 0) h = 0x7F80;                 // +Inf now and then
    if (((h >> 7) & 0xFF) == 0xFF && (r >> 24) % 3) h ^= 0x4000;  // most NaN / Inf patterns back to finite
  }
  return v;
}

TEST_F(NcclDevice, AllreduceEqualsTheCpuAllreduceBitForBit) {
  for (const int64_t cols : {int64_t{3584}, int64_t{100}}) {
    const int64_t rows = 9;
    const auto x = hostile_rows(rows * cols, 7 + static_cast<uint64_t>(cols));
    std::vector<uint16_t> want(x.size());
    ASSERT_TRUE(comm::allreduce_bf16(*host_, x, rows, cols, want).is_ok());
    uint16_t* dx = upload(x);
    uint16_t* dout = upload(std::vector<uint16_t>(x.size(), 0xDEAD));
    ASSERT_TRUE(comm::allreduce_bf16_device(*dev_, dx, rows, cols, dout, stream_).is_ok());
    ASSERT_TRUE(dev_->synchronize(stream_).is_ok());
    EXPECT_EQ(download(dout, x.size()), want) << "cols " << cols;
  }
}

TEST_F(NcclDevice, AddRmsNormEqualsTheCpuBitForBit) {
  const int64_t rows = 5, cols = 3584;
  std::mt19937_64 rng(3);
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
    uint16_t* dres = upload(res);
    uint16_t* dg = upload(gamma);
    uint16_t* dout = upload(std::vector<uint16_t>(x.size(), 0));
    uint16_t* drout = upload(std::vector<uint16_t>(x.size(), 0));
    ASSERT_TRUE(comm::allreduce_add_rmsnorm_bf16_device(*dev_, dx, with_residual ? dres : nullptr, dg, rows, cols, 1e-5f,
                                                        dout, drout, stream_)
                    .is_ok());
    ASSERT_TRUE(dev_->synchronize(stream_).is_ok());
    EXPECT_EQ(download(dout, x.size()), out) << "residual " << with_residual;
    EXPECT_EQ(download(drout, x.size()), rout) << "residual " << with_residual;
  }
}

TEST_F(NcclDevice, AlltoallvAndNativeAllreduceAtWorldSizeOne) {
  const std::vector<uint16_t> x = hostile_rows(1000, 1);
  uint16_t* dx = upload(x);
  uint16_t* dy = upload(std::vector<uint16_t>(x.size(), 0));
  const std::vector<int64_t> bytes = {2000};
  ASSERT_TRUE(dev_->alltoallv(dx, bytes, dy, bytes, stream_).is_ok());
  ASSERT_TRUE(dev_->synchronize(stream_).is_ok());
  EXPECT_EQ(download(dy, x.size()), x);
  const auto st = dev_->alltoallv(dx, std::vector<int64_t>{1, 2}, dy, bytes, stream_);
  EXPECT_NE(st.message().find("expected size() = 1"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace k3
