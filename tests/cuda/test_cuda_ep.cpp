// The CUDA MoE's expert-parallel seam (cuda::run_experts + cuda::finalize) and the GPU EP path
// over NCCL (k3/cuda_ep.hpp). The argument errors run on any machine (no device touched); the
// bit-for-bit tests need a device (the seam) and NCCL (EP at world size 1) and skip, saying why,
// without them. On one GPU only world size 1 can run: the multi-rank bookkeeping is tested on the
// host (tests/core/test_ep_route.cpp), the multi-rank transfers by the CPU path's MPI tests.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "cuda_caps_util.hpp"
#include "k3/comm.hpp"
#include "k3/comm_nccl.hpp"
#include "k3/cuda.hpp"
#include "k3/cuda_ep.hpp"
#include "k3/cuda_moe.hpp"
#include "k3/formats.hpp"
#include "k3/harness/moe_case.hpp"

namespace k3 {
namespace {

cuda::DeviceCaps h200() { return test::h200_caps(); }

cuda::MoePlan host_plan(const MoeShape& shape, int64_t max_tokens) {
  MoeProblem p;
  p.shape = shape;
  cuda::MoeOptions o;
  o.max_tokens = max_tokens;
  o.device = h200();
  auto plan = cuda::plan(p, o);
  EXPECT_TRUE(plan.is_ok()) << plan.status().to_string();
  return plan.is_ok() ? plan.value() : cuda::MoePlan{};
}

// A DeviceCommunicator that refuses every transfer: the argument checks must fail before any.
class NoTransfer final : public comm::DeviceCommunicator {
 public:
  explicit NoTransfer(comm::Communicator& host) : host_(host) {}
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  int device() const override { return 0; }
  comm::Communicator& host() override { return host_; }
  Status alltoallv(const void*, std::span<const int64_t>, void*, std::span<const int64_t>, void*) override {
    ADD_FAILURE() << "a transfer was attempted";
    return Status(StatusCode::kInternal, "no transfer");
  }
  Status native_allreduce_sum_f32(float*, int64_t, void*) override { return Status(StatusCode::kInternal, "no"); }
  Status synchronize(void*) override {
    ADD_FAILURE() << "a synchronize was attempted";
    return Status(StatusCode::kInternal, "no synchronize");
  }

 private:
  comm::Communicator& host_;
};

void expect_message(const Status& st, const std::string& part) {
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find(part), std::string::npos) << st.message();
}

TEST(CudaEpArguments, SeamRefusesMissingWeightsAndPointers) {
  const auto plan = host_plan(MoeShape{256, 128, 16, 4, 1, 0}, 64);
  cuda::DeviceWeights none;
  std::vector<char> host_ws(static_cast<size_t>(plan.workspace_bytes));  // never touched: layout arithmetic only
  char* ws = host_ws.data();
  const cuda::DeviceInputs in{};
  expect_message(cuda::run_experts(plan, none, in, ws, nullptr).status(), "run_experts: weights were not prepacked");
  expect_message(cuda::finalize(plan, nullptr, cuda::ExpertRows{}, nullptr, nullptr, nullptr),
                 "finalize: m_device, rows.y, rows.slot_row, topk_weights and out must all be device pointers");
  // expert_rows is the workspace layout of the plan.
  const auto rows = cuda::expert_rows(plan, ws);
  EXPECT_EQ(reinterpret_cast<const char*>(rows.y), ws + plan.ws_y);
  EXPECT_EQ(reinterpret_cast<const char*>(rows.slot_row), ws + plan.ws_slot_row);
  EXPECT_EQ(cuda::expert_rows(plan, nullptr).y, nullptr);
}

TEST(CudaEpArguments, DispatchAndCombineRefuseBeforeAnyTransfer) {
  auto host = comm::make_self_communicator();
  NoTransfer dev(*host);
  comm::DeviceEpBuffers buffers;
  const auto plan2 = host_plan(MoeShape{256, 128, 16, 4, 2, 1}, 64);
  expect_message(comm::ep_dispatch_device(dev, plan2, 4, nullptr, nullptr, buffers, nullptr).status(),
                 "ep_size = 2, ep_rank = 1 must be the communicator's size 1 and rank 0");
  const auto plan = host_plan(MoeShape{256, 128, 16, 4, 1, 0}, 64);
  expect_message(comm::ep_dispatch_device(dev, plan, -3, nullptr, nullptr, buffers, nullptr).status(),
                 "m = -3 must be in [0, 2^24]");
  expect_message(comm::ep_dispatch_device(dev, plan, 5, nullptr, nullptr, buffers, nullptr).status(),
                 "x and topk_ids must be device pointers (null given) for m = 5");
  comm::DeviceEpDispatch d;  // never dispatched: no ranks
  expect_message(comm::ep_combine_device(dev, d, plan, nullptr, nullptr, nullptr, buffers, nullptr),
                 "the dispatch was made on a communicator of 0 ranks, this one has 1");
  d.shape = plan.problem.shape;
  d.rows_from = {0};
  d.route.slots_to = {0};
  d.slots.slots_from = {0};
  d.source_tokens = 65;
  expect_message(comm::ep_combine_device(dev, d, plan, nullptr, nullptr, nullptr, buffers, nullptr),
                 "M = 65 exceed plan.max_tokens = 64");
  d.source_tokens = 3;
  expect_message(comm::ep_combine_device(dev, d, plan, nullptr, nullptr, nullptr, buffers, nullptr),
                 "topk_weights and out must be device pointers (null given) for M = 3");
  cuda::DeviceWeights none;
  expect_message(comm::ep_experts_device(plan2, none, d, nullptr, buffers, nullptr).status(),
                 "the plan's shape (K 256, top_k 4, E 16, ep 1/2) differs from the dispatch's");
}

// ---- on a device ------------------------------------------------------------------------------

struct Dev {
  std::vector<void*> bufs;
  ~Dev() {
    for (void* p : bufs) cudaFree(p);
  }
  template <typename T>
  T* up(const std::vector<T>& v) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, v.size() * sizeof(T) + 256), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    bufs.push_back(p);
    return static_cast<T*>(p);
  }
  void* zeros(size_t bytes, int fill) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes + 256), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, fill, bytes + 256), cudaSuccess);
    bufs.push_back(p);
    return p;
  }
};

std::vector<uint8_t> down(const void* p, size_t bytes) {
  std::vector<uint8_t> v(bytes);
  EXPECT_EQ(cudaMemcpy(v.data(), p, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

MoeCase make_case(Recipe r, OutDType dt, int64_t m, uint64_t seed) {
  MoeCaseSpec spec;
  spec.problem.shape = {256, 128, 16, 4, 1, 0};
  spec.problem.recipe = r;
  spec.problem.out_dtype = dt;
  spec.m = m;
  spec.routing = RoutingPattern::kMasked;
  spec.seed = seed;
  auto c = make_moe_case(spec);
  EXPECT_TRUE(c.is_ok()) << c.status().to_string();
  MoeCase out = std::move(c).value();
  for (int s = 0; s < 4; ++s) out.topk_ids[static_cast<size_t>(4 + s)] = -1;  // token 1: every slot masked
  return out;
}

// cuda::run on device buffers: the reference of both tests. Returns the out bytes.
struct RunSetup {
  cuda::MoePlan plan;
  cuda::DeviceWeights w;
  void* ws = nullptr;
  int32_t* m_dev = nullptr;
  uint16_t* x = nullptr;
  int32_t* ids = nullptr;
  float* tw = nullptr;
  size_t out_bytes = 0;
};

bool setup(Dev& dev, const MoeCase& c, RunSetup& s) {
  auto caps = cuda::device_caps(0);
  if (!caps.is_ok()) return false;
  cuda::MoeOptions o;
  o.max_tokens = c.m;
  o.device = caps.value();
  auto plan = cuda::plan(c.problem, o);
  EXPECT_TRUE(plan.is_ok()) << plan.status().to_string();
  if (!plan.is_ok()) return false;
  s.plan = plan.value();
  auto w = cuda::prepack(s.plan, c.weights());
  EXPECT_TRUE(w.is_ok()) << w.status().to_string();
  if (!w.is_ok()) return false;
  s.w = std::move(w).value();
  s.ws = dev.zeros(static_cast<size_t>(s.plan.workspace_bytes), 0);
  s.m_dev = dev.up(std::vector<int32_t>{static_cast<int32_t>(c.m)});
  s.x = dev.up(c.x);
  s.ids = dev.up(c.topk_ids);
  s.tw = dev.up(c.topk_weights);
  s.out_bytes = static_cast<size_t>(c.m * c.problem.shape.hidden * out_dtype_size(c.problem.out_dtype));
  return true;
}

std::vector<uint8_t> reference_run(Dev& dev, const RunSetup& s) {
  void* out = dev.zeros(s.out_bytes, 0xEE);
  const cuda::DeviceInputs in{s.m_dev, s.x, s.ids, s.tw, out};
  const Status st = cuda::run(s.plan, s.w, in, s.ws, nullptr);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return down(out, s.out_bytes);
}

TEST(CudaEpDevice, SeamEqualsRunBitForBit) {
  if (auto caps = cuda::device_caps(0); !caps.is_ok()) GTEST_SKIP() << "no CUDA device: " << caps.status().message();
  for (const Recipe r : {Recipe::kW4A16, Recipe::kW4A8}) {
    for (const OutDType dt : {OutDType::kBF16, OutDType::kFP32}) {
      const MoeCase c = make_case(r, dt, 37, 11);
      Dev dev;
      RunSetup s;
      ASSERT_TRUE(setup(dev, c, s));
      const auto want = reference_run(dev, s);
      void* out = dev.zeros(s.out_bytes, 0x55);
      const cuda::DeviceInputs in{s.m_dev, s.x, s.ids, nullptr, nullptr};  // run_experts reads no weights / out
      auto rows = cuda::run_experts(s.plan, s.w, in, s.ws, nullptr);
      ASSERT_TRUE(rows.is_ok()) << rows.status().to_string();
      ASSERT_TRUE(cuda::finalize(s.plan, s.m_dev, rows.value(), s.tw, out, nullptr).is_ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(down(out, s.out_bytes), want) << recipe_name(r) << " " << out_dtype_name(dt);
    }
  }
}

TEST(CudaEpDevice, DispatchExpertsCombineAtWorldSizeOneEqualRunBitForBit) {
  if (const Status a = comm::nccl_available(); !a.is_ok()) GTEST_SKIP() << a.message();
  auto host = comm::make_self_communicator();
  auto nccl = comm::make_nccl_communicator(*host);
  ASSERT_TRUE(nccl.is_ok()) << nccl.status().to_string();
  comm::DeviceEpBuffers buffers;  // reused across the cases (grows)
  for (const Recipe r : {Recipe::kW4A16, Recipe::kW4A8}) {
    for (const OutDType dt : {OutDType::kBF16, OutDType::kFP32}) {
      const MoeCase c = make_case(r, dt, 37, 13);
      Dev dev;
      RunSetup s;
      ASSERT_TRUE(setup(dev, c, s));
      const auto want = reference_run(dev, s);
      void* out = dev.zeros(s.out_bytes, 0x55);
      const Status st = comm::ep_moe_run_device(**nccl, s.plan, s.w, c.m, s.x, s.ids, s.tw, out, s.ws, buffers, nullptr);
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      ASSERT_TRUE((*nccl)->synchronize(nullptr).is_ok());
      EXPECT_EQ(down(out, s.out_bytes), want) << recipe_name(r) << " " << out_dtype_name(dt);
    }
  }
  // No tokens: nothing sent, nothing written, no error.
  const auto plan = host_plan(MoeShape{256, 128, 16, 4, 1, 0}, 64);
  auto d = comm::ep_dispatch_device(**nccl, plan, 0, nullptr, nullptr, buffers, nullptr);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(d->rows, 0);
  EXPECT_EQ(d->bytes_sent, 0);
}

}  // namespace
}  // namespace k3
