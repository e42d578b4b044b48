// Shared pieces of the CUDA KDA tests (test_cuda_kda.cpp, test_cuda_kda_chunked.cpp): the device
// fixture, a configuration of given dims, and the GPU / FP32-reference runs of a generated case.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "k3/harness/kda_case.hpp"
#include "k3/cuda.hpp"
#include "k3/cuda_kda.hpp"
#include "k3/kda.hpp"

namespace k3::kda::test {

// Skips the test, with the reason, unless device 0 exists and runs a compiled architecture.
class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto devs = cuda::devices();
    if (!devs.is_ok()) GTEST_SKIP() << "no CUDA device: " << devs.status().message();
    if (!devs.value()[0].runnable) GTEST_SKIP() << "device 0 is not among the compiled architectures " << cuda::compiled_archs();
  }
};

inline KdaConfig cfg(int64_t h, int64_t k, int64_t v, GateMode gate, StateLayout layout = StateLayout::kKFirst) {
  KdaConfig c;
  c.num_heads = h;
  c.head_k = k;
  c.head_v = v;
  c.gate = gate;
  c.layout = layout;
  return c;
}

struct Out {
  std::vector<float> o, f;
};

// The case on the CUDA backend (host convenience; outputs pre-filled with 7 to catch rows not written).
inline Out run_gpu(const KdaCase& c, Algorithm algo = Algorithm::kAuto) {
  Out r{std::vector<float>(c.o_size(), 7.0f), std::vector<float>(c.state_size(), 7.0f)};
  const Status st = cuda::prefill_host(c.spec.cfg, c.inputs(), {r.o, r.f}, algo);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return r;
}

inline Out run_ref(const KdaCase& c) {
  Out r{std::vector<float>(c.o_size()), std::vector<float>(c.state_size())};
  EXPECT_TRUE(reference_fp32(c.spec.cfg, c.inputs(), {r.o, r.f}).is_ok());
  return r;
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace k3::kda::test
