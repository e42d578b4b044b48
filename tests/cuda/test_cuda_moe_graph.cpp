// CUDA fused MoE: eager, graph capture and two replays give identical bits; a replay with a
// smaller real M (read from device memory) leaves the fixed grid unchanged. Needs a device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <random>
#include <string>
#include <vector>

#include "k3/cuda.hpp"
#include "k3/cuda_moe.hpp"
#include "k3/harness/moe_case.hpp"

namespace k3 {
namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

MoeCase make_problem(int64_t m) {
  MoeCaseSpec spec;
  spec.problem.shape = {256, 128, 16, 4, 2, 1};  // K, N, E, top_k, EP2 rank 1
  spec.m = m;
  spec.routing = RoutingPattern::kMasked;
  spec.seed = 11;
  auto c = make_moe_case(spec);
  EXPECT_TRUE(c.is_ok()) << c.status().to_string();
  return std::move(c).value();
}

// Every test runs once per path (MoeOptions::path): decode, decode-splitk (programmatic dependent
// launches inside the capture) and prefill.
class CudaMoeGraph : public ::testing::TestWithParam<cuda::MoePath> {
 protected:
  // prefill-sm90 runs only on sm_90 devices with a build that has CUTLASS: skipped elsewhere.
  void SetUp() override {
    auto caps = cuda::device_caps(0);
    if (caps.is_ok() && GetParam() == cuda::MoePath::kPrefillSm90 &&
        !(caps->cc_major == 9 && caps->cc_minor == 0 && caps->has_sm90_grouped)) {
      GTEST_SKIP() << "prefill-sm90 needs an sm_90 device and a build with CUTLASS ('" << caps->name << "')";
    }
  }
  cuda::MoeOptions options(int64_t max_tokens, const cuda::DeviceCaps& caps) const {
    cuda::MoeOptions o{.max_tokens = max_tokens, .device = caps};
    o.path = GetParam();
    return o;
  }
};

TEST_P(CudaMoeGraph, EagerCaptureAndReplaysAreBitIdentical) {
  auto caps = cuda::device_caps(0);
  if (!caps.is_ok()) GTEST_SKIP() << "no CUDA device: " << caps.status().message();
  auto pr = make_problem(37);
  auto plan = cuda::plan(pr.problem, options(pr.m, caps.value()));
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  const MoeWeightsView wv = pr.weights();
  auto weights = cuda::prepack(plan.value(), wv);
  ASSERT_TRUE(weights.is_ok()) << weights.status().to_string();

  void *ws, *dx, *dids, *dw, *dout, *dm;
  const size_t out_bytes = pr.m * 256 * 2;
  CUDA_OK(cudaMalloc(&ws, plan->workspace_bytes));
  CUDA_OK(cudaMalloc(&dx, pr.x.size() * 2));
  CUDA_OK(cudaMalloc(&dids, pr.topk_ids.size() * 4));
  CUDA_OK(cudaMalloc(&dw, pr.topk_weights.size() * 4));
  CUDA_OK(cudaMalloc(&dout, out_bytes));
  CUDA_OK(cudaMalloc(&dm, 4));
  const int32_t m32 = static_cast<int32_t>(pr.m);
  CUDA_OK(cudaMemcpy(dx, pr.x.data(), pr.x.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dids, pr.topk_ids.data(), pr.topk_ids.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dw, pr.topk_weights.data(), pr.topk_weights.size() * 4, cudaMemcpyHostToDevice));
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

// A token count in device memory beyond the plan's max_m (or negative) is clamped: the kernels
// never read ids / x / weights past max_m rows or write past the row map and out. The buffers
// carry a tail that a kernel without the clamp would read (local expert ids) or write (out guard).
TEST_P(CudaMoeGraph, DeviceTokenCountIsClampedToMaxM) {
  auto caps = cuda::device_caps(0);
  if (!caps.is_ok()) GTEST_SKIP() << "no CUDA device: " << caps.status().message();
  auto pr = make_problem(37);
  const int64_t k = 256, top_k = 4, max_m = pr.m;
  auto plan = cuda::plan(pr.problem, options(max_m, caps.value()));
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  auto weights = cuda::prepack(plan.value(), pr.weights());
  ASSERT_TRUE(weights.is_ok()) << weights.status().to_string();
  // Tails of another max_m rows: every slot routed to the first local expert, x = 1, w = 1.
  std::vector<int32_t> ids(pr.topk_ids);
  ids.resize(2 * max_m * top_k, pr.problem.shape.first_local_expert());
  std::vector<float> w(pr.topk_weights);
  w.resize(2 * max_m * top_k, 1.0f);
  std::vector<uint16_t> x(pr.x);
  x.resize(2 * max_m * k, 0x3F80);
  const size_t out_bytes = max_m * k * 2, guard = 4096;
  void *ws, *dx, *dids, *dw, *dout, *dm;
  CUDA_OK(cudaMalloc(&ws, plan->workspace_bytes));
  CUDA_OK(cudaMalloc(&dx, x.size() * 2));
  CUDA_OK(cudaMalloc(&dids, ids.size() * 4));
  CUDA_OK(cudaMalloc(&dw, w.size() * 4));
  CUDA_OK(cudaMalloc(&dout, out_bytes + guard));
  CUDA_OK(cudaMalloc(&dm, 4));
  CUDA_OK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  cuda::DeviceInputs in{static_cast<int32_t*>(dm), static_cast<uint16_t*>(dx), static_cast<int32_t*>(dids),
                        static_cast<float*>(dw), dout};
  auto run_with = [&](int32_t m_dev, std::vector<uint8_t>& got) {
    CUDA_OK(cudaMemcpy(dm, &m_dev, 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(dout, 0x5A, out_bytes + guard));
    ASSERT_TRUE(cuda::run(plan.value(), weights.value(), in, ws, nullptr).is_ok());
    CUDA_OK(cudaDeviceSynchronize());
    got.resize(out_bytes + guard);
    CUDA_OK(cudaMemcpy(got.data(), dout, got.size(), cudaMemcpyDeviceToHost));
  };
  std::vector<uint8_t> ref, got;
  run_with(static_cast<int32_t>(max_m), ref);
  for (size_t b = out_bytes; b < ref.size(); ++b) ASSERT_EQ(ref[b], 0x5A) << "guard byte " << b;
  for (int32_t m_dev : {static_cast<int32_t>(max_m + 1), static_cast<int32_t>(2 * max_m), INT32_MAX}) {
    run_with(m_dev, got);
    EXPECT_EQ(got, ref) << "m_device = " << m_dev << " must act as max_m = " << max_m;
  }
  run_with(-5, got);  // negative: no tokens, out untouched
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](uint8_t v) { return v == 0x5A; }));
  for (void* p : {ws, dx, dids, dw, dout, dm}) cudaFree(p);
}

// decode-splitk reads its own prepacked layout: weights prepacked for another path's plan are
// refused with the two layouts named, in both directions, before anything is enqueued.
TEST(CudaMoeGraphLayout, WeightsPrepackedForAnotherLayoutAreRefused) {
  auto caps = cuda::device_caps(0);
  if (!caps.is_ok()) GTEST_SKIP() << "no CUDA device: " << caps.status().message();
  auto pr = make_problem(8);
  cuda::MoeOptions o{.max_tokens = pr.m, .device = caps.value()};
  o.path = cuda::MoePath::kDecodeSplitK;
  auto splitk = cuda::plan(pr.problem, o);
  o.path = cuda::MoePath::kPrefill;
  auto prefill = cuda::plan(pr.problem, o);
  ASSERT_TRUE(splitk.is_ok() && prefill.is_ok());
  auto w_splitk = cuda::prepack(splitk.value(), pr.weights());
  auto w_prefill = cuda::prepack(prefill.value(), pr.weights());
  ASSERT_TRUE(w_splitk.is_ok() && w_prefill.is_ok());
  void* ws = nullptr;
  CUDA_OK(cudaMalloc(&ws, std::max(splitk->workspace_bytes, prefill->workspace_bytes)));
  int32_t* dm = nullptr;
  CUDA_OK(cudaMalloc(&dm, 4));
  // Non-null device pointers for the argument checks; nothing may be enqueued.
  cuda::DeviceInputs in{dm, reinterpret_cast<uint16_t*>(ws), reinterpret_cast<int32_t*>(ws), nullptr, nullptr};
  auto a = cuda::run_experts(splitk.value(), w_prefill.value(), in, ws, nullptr);
  EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(a.status().message().find("needs the decode-splitk layout"), std::string::npos) << a.status().message();
  auto b = cuda::run_experts(prefill.value(), w_splitk.value(), in, ws, nullptr);
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("prepacked for the decode-splitk layout"), std::string::npos)
      << b.status().message();
  cudaFree(ws);
  cudaFree(dm);
}

INSTANTIATE_TEST_SUITE_P(Paths, CudaMoeGraph,
                         ::testing::Values(cuda::MoePath::kDecodeSplitK, cuda::MoePath::kPrefill,
                                           cuda::MoePath::kPrefillSm90),
                         [](const ::testing::TestParamInfo<cuda::MoePath>& param_info) {
                           std::string name = cuda::moe_path_name(param_info.param);
                           for (char& c : name) c = c == '-' ? '_' : c;
                           return name;
                         });

}  // namespace
}  // namespace k3
