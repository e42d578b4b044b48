// CUDA fused MoE: eager, graph capture and two replays give identical bits; a replay with a
// smaller real M (read from device memory) leaves the fixed grid unchanged. Needs a device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "k3/cuda.hpp"
#include "k3/cuda_moe.hpp"
#include "k3/formats.hpp"

namespace k3 {
namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

struct Problem {
  MoeProblem p;
  std::vector<uint8_t> f1, s1, f2, s2;
  std::vector<uint16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> w;
  int64_t m;
};

Problem make_problem(int64_t m) {
  Problem pr;
  pr.m = m;
  pr.p.shape.hidden = 256;
  pr.p.shape.intermediate = 128;
  pr.p.shape.num_experts = 16;
  pr.p.shape.top_k = 4;
  pr.p.shape.ep_size = 2;
  pr.p.shape.ep_rank = 1;
  const int64_t e = 8, k = 256, n = 128;
  std::mt19937 rng(11);
  auto fill = [&rng](std::vector<uint8_t>& v, size_t size, int lo, int hi) {
    v.resize(size);
    std::uniform_int_distribution<int> d(lo, hi);
    for (auto& b : v) b = static_cast<uint8_t>(d(rng));
  };
  fill(pr.f1, e * 2 * n * k / 2, 0, 255);
  fill(pr.s1, e * 2 * n * k / 32, 120, 124);
  fill(pr.f2, e * k * n / 2, 0, 255);
  fill(pr.s2, e * k * n / 32, 120, 124);
  std::normal_distribution<float> nd;
  pr.x.resize(m * k);
  for (auto& v : pr.x) v = bf16_from_f32(nd(rng));
  pr.ids.resize(m * 4);
  pr.w.resize(m * 4);
  std::uniform_int_distribution<int> id(-1, 15);
  for (auto& v : pr.ids) v = id(rng);
  for (auto& v : pr.w) v = std::uniform_real_distribution<float>(0.f, 1.f)(rng);
  return pr;
}

TEST(CudaMoeGraph, EagerCaptureAndReplaysAreBitIdentical) {
  auto caps = cuda::device_caps(0);
  if (!caps.is_ok()) GTEST_SKIP() << "no CUDA device: " << caps.status().message();
  auto pr = make_problem(37);
  auto plan = cuda::plan_moe(pr.p, pr.m, caps.value());
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  MoeWeightsView wv{pr.f1, pr.s1, pr.f2, pr.s2, {}, {}};
  auto weights = cuda::prepack(plan.value(), wv);
  ASSERT_TRUE(weights.is_ok()) << weights.status().to_string();

  void *ws, *dx, *dids, *dw, *dout, *dm;
  const size_t out_bytes = pr.m * 256 * 2;
  CUDA_OK(cudaMalloc(&ws, plan->workspace_bytes));
  CUDA_OK(cudaMalloc(&dx, pr.x.size() * 2));
  CUDA_OK(cudaMalloc(&dids, pr.ids.size() * 4));
  CUDA_OK(cudaMalloc(&dw, pr.w.size() * 4));
  CUDA_OK(cudaMalloc(&dout, out_bytes));
  CUDA_OK(cudaMalloc(&dm, 4));
  const int32_t m32 = static_cast<int32_t>(pr.m);
  CUDA_OK(cudaMemcpy(dx, pr.x.data(), pr.x.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dids, pr.ids.data(), pr.ids.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dw, pr.w.data(), pr.w.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dm, &m32, 4, cudaMemcpyHostToDevice));
  cuda::DeviceInputs in{static_cast<int32_t*>(dm), static_cast<uint16_t*>(dx), static_cast<int32_t*>(dids),
                        static_cast<float*>(dw), dout};
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));

  std::vector<uint8_t> eager(out_bytes), replay(out_bytes);
  CUDA_OK(cudaMemsetAsync(dout, 0xAB, out_bytes, stream));  // poison: every element must be written
  ASSERT_TRUE(cuda::run(plan.value(), weights.value(), in, ws, stream).is_ok());
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaMemcpy(eager.data(), dout, out_bytes, cudaMemcpyDeviceToHost));

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  ASSERT_TRUE(cuda::run(plan.value(), weights.value(), in, ws, stream).is_ok());
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 2; ++rep) {
    CUDA_OK(cudaMemsetAsync(dout, 0xCD, out_bytes, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaMemcpy(replay.data(), dout, out_bytes, cudaMemcpyDeviceToHost));
    EXPECT_EQ(eager, replay) << "replay " << rep;
  }
  // A smaller real M through the same graph: the first rows match the eager result.
  const int32_t m_small = 5;
  CUDA_OK(cudaMemcpy(dm, &m_small, 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaMemcpy(replay.data(), dout, out_bytes, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(std::equal(eager.begin(), eager.begin() + m_small * 256 * 2, replay.begin()));

  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  for (void* p : {ws, dx, dids, dw, dout, dm}) cudaFree(p);
}

}  // namespace
}  // namespace k3
