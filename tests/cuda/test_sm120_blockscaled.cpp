// The sm_120a block-scaled grouped GEMM building block (src/cuda_cutlass/moe_sm120_blockscaled.cu)
// against a host reference: MX decode of k3/mx.hpp, FP64 sums. Needs an sm_120 device and a build
// with CUTLASS and 120a; skips otherwise (every machine here). NEVER RUN ON A GPU so far.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <random>
#include <vector>

#include "cuda_cutlass/moe_sm120_blockscaled.cuh"
#include "cuda_cutlass/moe_sm120_blockscaled_layout.hpp"
#include "k3/cuda.hpp"
#include "k3/cuda_sm120.hpp"
#include "k3/mx.hpp"

namespace {

using namespace k3;
using namespace k3::cuda::sm120_bs;

template <typename T>
struct Dev {
  T* p = nullptr;
  explicit Dev(size_t n) { EXPECT_EQ(cudaMalloc(&p, n * sizeof(T) + 1), cudaSuccess); }
  ~Dev() { cudaFree(p); }
  void put(const std::vector<T>& v) { ASSERT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess); }
  std::vector<T> get(size_t n) const {
    std::vector<T> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
};

class Sm120BlockScaledGemm : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::has_sm120_blockscaled_gemm()) GTEST_SKIP() << "this build has no CUTLASS sm_120a block-scaled GEMM";
    auto caps = cuda::device_caps(0);
    if (!caps.is_ok()) GTEST_SKIP() << "no CUDA device: " << caps.status().message();
    if (caps.value().cc_major != 12 || caps.value().cc_minor != 0) {
      GTEST_SKIP() << "device 0 is sm_" << caps.value().cc_major << caps.value().cc_minor << ", the GEMM needs sm_120";
    }
    sm_count_ = caps.value().sm_count;
  }
  int sm_count_ = 0;
};

// Groups with 0 rows, fewer rows than a tile, not a multiple of the tile, and more than one tile.
TEST_F(Sm120BlockScaledGemm, MatchesHostReferenceOnUnevenGroups) {
  const std::vector<int32_t> counts = {37, 0, 128, 200, 1};
  const int groups = static_cast<int>(counts.size());
  const int64_t n = 192, k = 256, kb = k / 32;
  int64_t total = 0;
  for (int32_t c : counts) total += c;
  const int64_t cap = row_capacity(total, groups);

  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(static_cast<size_t>(total * k));
  for (auto& v : x) v = nd(rng);
  std::vector<uint8_t> wq(static_cast<size_t>(groups * n * k / 2)), ws(static_cast<size_t>(groups * n * kb));
  for (auto& v : wq) v = static_cast<uint8_t>(rng());
  for (auto& v : ws) v = static_cast<uint8_t>(120 + rng() % 10);
  auto pw = prepack_weights(wq, ws, groups, n, k);
  ASSERT_TRUE(pw.is_ok()) << pw.status().message();

  Dev<int32_t> d_counts(counts.size());
  Dev<float> d_x(x.size());
  Dev<uint8_t> d_a(static_cast<size_t>(cap * k)), d_asf(static_cast<size_t>(sf_bytes(cap, k)));
  Dev<uint8_t> d_b(pw.value().codes.size()), d_bsf(pw.value().sf.size());
  Dev<float> d_d(static_cast<size_t>(cap * n));
  d_counts.put(counts);
  d_x.put(x);
  d_b.put(pw.value().codes);
  d_bsf.put(pw.value().sf);
  ASSERT_EQ(cudaMemset(d_d.p, 0xFF, static_cast<size_t>(cap * n) * sizeof(float)), cudaSuccess);  // NaN guard

  GemmOperands ops{d_counts.p, d_a.p, d_asf.p, d_b.p, d_bsf.p, d_d.p};
  auto gemm = GroupedGemm::create(GemmShape{groups, n, k, cap, sm_count_}, ops);
  ASSERT_TRUE(gemm.is_ok()) << gemm.status().message();
  ASSERT_TRUE(gemm.value().setup(nullptr).is_ok());
  ASSERT_TRUE(gemm.value().quantize_a(d_x.p, nullptr).is_ok());
  ASSERT_TRUE(gemm.value().gemm(nullptr).is_ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  std::vector<int32_t> status(1);
  ASSERT_EQ(cudaMemcpy(status.data(), gemm.value().status(), sizeof(int32_t), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(status[0], 0);
  std::vector<int64_t> pstart(static_cast<size_t>(groups) + 1);
  ASSERT_EQ(cudaMemcpy(pstart.data(), gemm.value().padded_start(), pstart.size() * sizeof(int64_t), cudaMemcpyDeviceToHost),
            cudaSuccess);
  const auto d = d_d.get(static_cast<size_t>(cap * n));

  // Host reference: x quantized to MXFP8 (RCEIL) by k3's codec, both operands decoded exactly,
  // products summed in FP64. Every product is exact in FP32 (4 + 2 significant bits, power-of-two
  // scales), so any FP32 summation order stays within (k - 1) * 2^-24 * sum |a*b|; the test allows
  // twice that, and prints the largest error seen for the first-run record.
  std::vector<uint8_t> xq(x.size()), xs(static_cast<size_t>(total * kb));
  ASSERT_TRUE(mx_quantize(x, total, k, MxElement::kE4M3, ScaleRule::kRceil, xq, xs).is_ok());
  int64_t compact = 0, bad = 0;
  double max_rel = 0;
  for (int g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < counts[static_cast<size_t>(g)]; ++r) {
      for (int64_t j = 0; j < n; ++j) {
        double sum = 0, mag = 0;
        for (int64_t c = 0; c < k; ++c) {
          const double a = mx_decode_element(xq[static_cast<size_t>((compact + r) * k + c)],
                                             xs[static_cast<size_t>((compact + r) * kb + c / 32)], MxElement::kE4M3);
          const uint8_t byte = wq[static_cast<size_t>((g * n + j) * k / 2 + c / 2)];
          const double b = mx_decode_element(c % 2 ? fp4_high(byte) : fp4_low(byte),
                                             ws[static_cast<size_t>((g * n + j) * kb + c / 32)], MxElement::kE2M1);
          sum += a * b;
          mag += std::fabs(a * b);
        }
        const float got = d[static_cast<size_t>((pstart[static_cast<size_t>(g)] + r) * n + j)];
        if (mag > 0) max_rel = std::max(max_rel, std::fabs(got - sum) / mag);
        if (!(std::fabs(got - sum) <= static_cast<double>(k) * 0x1p-23 * mag)) {
          if (++bad <= 5) ADD_FAILURE() << "group " << g << " row " << r << " col " << j << ": " << got << " vs " << sum;
        }
      }
    }
    compact += counts[static_cast<size_t>(g)];
  }
  EXPECT_EQ(bad, 0);
  std::printf("sm120 block-scaled GEMM: max |error| / sum |a*b| = %.3g\n", max_rel);
}

// Graph safety: setup + quantize_a + gemm captured once; replays after new counts are written to
// device memory give the same bits as eager runs with those counts (counts are never read on the host).
TEST_F(Sm120BlockScaledGemm, GraphReplaysWithNewCountsMatchEagerBits) {
  const int groups = 4;
  const int64_t n = 128, k = 128;
  const std::vector<std::vector<int32_t>> trials = {{3, 0, 130, 7}, {0, 0, 0, 1}, {64, 64, 1, 0}};
  const int64_t max_total = 140, cap = row_capacity(max_total, groups);
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(static_cast<size_t>(max_total * k));
  for (auto& v : x) v = nd(rng);
  std::vector<uint8_t> wq(static_cast<size_t>(groups * n * k / 2)), ws(static_cast<size_t>(groups * n * (k / 32)));
  for (auto& v : wq) v = static_cast<uint8_t>(rng());
  for (auto& v : ws) v = static_cast<uint8_t>(124 + rng() % 6);
  auto pw = prepack_weights(wq, ws, groups, n, k);
  ASSERT_TRUE(pw.is_ok());
  Dev<int32_t> d_counts(static_cast<size_t>(groups));
  Dev<float> d_x(x.size());
  Dev<uint8_t> d_a(static_cast<size_t>(cap * k)), d_asf(static_cast<size_t>(sf_bytes(cap, k)));
  Dev<uint8_t> d_b(pw.value().codes.size()), d_bsf(pw.value().sf.size());
  Dev<float> d_d(static_cast<size_t>(cap * n));
  d_x.put(x);
  d_b.put(pw.value().codes);
  d_bsf.put(pw.value().sf);
  auto gemm = GroupedGemm::create(GemmShape{groups, n, k, cap, sm_count_},
                                  GemmOperands{d_counts.p, d_a.p, d_asf.p, d_b.p, d_bsf.p, d_d.p});
  ASSERT_TRUE(gemm.is_ok()) << gemm.status().message();
  auto enqueue = [&](cudaStream_t st) {
    ASSERT_TRUE(gemm.value().setup(st).is_ok());
    ASSERT_TRUE(gemm.value().quantize_a(d_x.p, st).is_ok());
    ASSERT_TRUE(gemm.value().gemm(st).is_ok());
  };
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  std::vector<std::vector<float>> eager;
  for (const auto& c : trials) {
    d_counts.put(c);
    ASSERT_EQ(cudaMemset(d_d.p, 0, static_cast<size_t>(cap * n) * sizeof(float)), cudaSuccess);
    enqueue(stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    eager.push_back(d_d.get(static_cast<size_t>(cap * n)));
  }
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  enqueue(stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (size_t t = 0; t < trials.size(); ++t) {
    d_counts.put(trials[t]);
    ASSERT_EQ(cudaMemset(d_d.p, 0, static_cast<size_t>(cap * n) * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const auto got = d_d.get(static_cast<size_t>(cap * n));
    EXPECT_EQ(std::memcmp(got.data(), eager[t].data(), got.size() * sizeof(float)), 0) << "trial " << t;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
