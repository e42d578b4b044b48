// The CUDA KDA backend (k3/cuda_kda.hpp) against the FP32 reference and the CPU backend: prefill
// over variable lengths (empty and length-1 sequences, lengths that are not a multiple of
// anything), both state layouts, BF16 and FP32 inputs, every gate; decode and verify on a state
// pool (unnamed slots untouched); the non-finite policy; determinism; CUDA-graph capture and
// replay; the device-side refusals (status word). Needs a CUDA device: without one every test
// skips with the reason. Ran on an H200 (2026-12-04): pass.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "k3/harness/kda_case.hpp"
#include "cuda/kda_test_util.hpp"
#include "k3/backend.hpp"
#include "k3/cpu_kda.hpp"
#include "k3/cuda.hpp"
#include "k3/cuda_kda.hpp"
#include "k3/formats.hpp"

namespace k3::kda {
namespace {

using test::cfg;
using test::Out;
using test::run_gpu;
using test::run_ref;
using test::same_bits;

class CudaKda : public test::CudaDeviceTest {};

std::vector<float> pool_of(const KdaConfig& c, int64_t slots, uint64_t seed) {
  CaseSpec s;
  s.cfg = c;
  s.seqlens = std::vector<int64_t>(static_cast<size_t>(slots), 0);
  s.seed = seed;
  return make_case(s).initial_state;
}

TEST_F(CudaKda, PrefillMatchesTheReference) {
  struct Shape { int64_t h, k, v; std::vector<int64_t> lens; std::vector<int64_t> resets; };
  const Shape shapes[] = {{3, 60, 100, {63}, {}},
                          {2, 32, 48, {15, 40, 0, 17}, {20, 21}},
                          {1, 100, 20, {37}, {5, 36}},
                          {2, 128, 128, {1, 0, 130}, {}},
                          {1, 512, 64, {9}, {}}};
  for (const auto& sh : shapes) {
    for (GateMode gate : {GateMode::kLogDecay, GateMode::kSafe, GateMode::kSoftplus}) {
      for (StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst}) {
        for (bool bf16 : {true, false}) {
          CaseSpec s;
          s.cfg = cfg(sh.h, sh.k, sh.v, gate, layout);
          s.seqlens = sh.lens;
          s.resets = sh.resets;
          s.bf16 = bf16;
          s.seed = 11 + sh.k;
          const KdaCase c = make_case(s);
          const Out ref = run_ref(c), out = run_gpu(c);
          const std::string what = std::string(gate_mode_name(gate)) + " " + state_layout_name(layout) +
                                   (bf16 ? " bf16 K=" : " fp32 K=") + std::to_string(sh.k);
          EXPECT_LT(compare(out.o, ref.o).err_ratio, kTolFp32) << what;
          EXPECT_LT(compare(out.f, ref.f).err_ratio, kTolFp32) << what;
        }
      }
    }
  }
}

TEST_F(CudaKda, PrefillWithoutInitialStateOrL2NormAndWithAScale) {
  CaseSpec s;
  s.cfg = cfg(2, 64, 64, GateMode::kSafe);
  s.cfg.l2norm_qk = false;
  s.cfg.scale = 0.25f;
  s.cfg.beta_logits = false;
  s.seqlens = {5, 19};
  s.initial_state = false;
  const KdaCase c = make_case(s);
  const Out ref = run_ref(c), out = run_gpu(c);
  EXPECT_LT(compare(out.o, ref.o).err_ratio, kTolFp32);
  EXPECT_LT(compare(out.f, ref.f).err_ratio, kTolFp32);
}

TEST_F(CudaKda, PrefillIsBitIdenticalAcrossRuns) {
  CaseSpec s;
  s.cfg = cfg(4, 128, 128, GateMode::kSafe);
  s.seqlens = {200, 3, 77};
  const KdaCase c = make_case(s);
  const Out a = run_gpu(c), b = run_gpu(c);
  EXPECT_TRUE(same_bits(a.o, b.o));
  EXPECT_TRUE(same_bits(a.f, b.f));
}

TEST_F(CudaKda, DecodeMatchesTheCpuAndTouchesOnlyNamedSlots) {
  for (StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst}) {
    for (int64_t v : {int64_t{32}, int64_t{20}, int64_t{128}}) {
      const KdaConfig k = cfg(3, 64, v, GateMode::kSafe, layout);
      CaseSpec s;
      s.cfg = k;
      s.seqlens = {4};
      s.initial_state = false;
      const KdaCase c = make_case(s);
      const std::vector<float> before = pool_of(k, 7, 5);
      std::vector<float> pool_cpu = before, pool_gpu = before;
      const std::vector<int32_t> idx = {5, -1, 0, 2};
      std::vector<float> o_cpu(c.o_size(), 7.0f), o_gpu(c.o_size(), 7.0f);
      ASSERT_TRUE(cpu::decode(k, {c.inputs(), pool_cpu, idx, o_cpu}).is_ok());
      const Status st = cuda::decode_host(k, {c.inputs(), pool_gpu, idx, o_gpu});
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      const int64_t block = 3 * 64 * v;
      for (int64_t slot = 0; slot < 7; ++slot) {
        const std::vector<float> g(pool_gpu.begin() + slot * block, pool_gpu.begin() + (slot + 1) * block);
        const std::vector<float> cc(pool_cpu.begin() + slot * block, pool_cpu.begin() + (slot + 1) * block);
        const std::vector<float> b(before.begin() + slot * block, before.begin() + (slot + 1) * block);
        if (slot == 1 || slot == 3 || slot == 4 || slot == 6) {
          EXPECT_TRUE(same_bits(g, b)) << "slot " << slot << " was not named";
        } else {
          EXPECT_LT(compare(g, cc).err_ratio, 1e-5) << "slot " << slot;
        }
      }
      EXPECT_LT(compare(o_gpu, o_cpu).err_ratio, 1e-5);
      for (int64_t j = 3 * v; j < 6 * v; ++j) ASSERT_EQ(o_gpu[j], 0.0f) << "padding row";
    }
  }
}

TEST_F(CudaKda, VerifyWritesEveryPrefixStateLikeTheCpu) {
  const int64_t T = 4;
  for (StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst}) {
    const KdaConfig k = cfg(2, 24, 40, GateMode::kSoftplus, layout);
    CaseSpec s;
    s.cfg = k;
    s.seqlens = {3 * T};
    s.initial_state = false;
    s.bf16 = false;
    const KdaCase c = make_case(s);
    const std::vector<float> before = pool_of(k, 14, 9);
    std::vector<float> pool_cpu = before, pool_gpu = before;
    const std::vector<int32_t> idx = {0, 1, 2, 3, 4, 5, -1, 6, -1, -1, -1, -1};
    const std::vector<int32_t> acc = {3, 1, 2};
    std::vector<float> o_cpu(c.o_size(), 7.0f), o_gpu(c.o_size(), 7.0f);
    ASSERT_TRUE(cpu::verify(k, {c.inputs(), T, pool_cpu, idx, acc, o_cpu}).is_ok());
    const Status st = cuda::verify_host(k, {c.inputs(), T, pool_gpu, idx, acc, o_gpu});
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    EXPECT_LT(compare(o_gpu, o_cpu).err_ratio, 1e-5);
    const int64_t block = 2 * 24 * 40;
    for (int64_t slot = 0; slot < 14; ++slot) {
      const std::vector<float> g(pool_gpu.begin() + slot * block, pool_gpu.begin() + (slot + 1) * block);
      const std::vector<float> cc(pool_cpu.begin() + slot * block, pool_cpu.begin() + (slot + 1) * block);
      if (slot >= 7) {
        EXPECT_TRUE(same_bits(g, cc)) << "slot " << slot << " is nobody's";
      } else {
        EXPECT_LT(compare(g, cc).err_ratio, 1e-5) << "slot " << slot;
      }
    }
  }
}

// BF16 state storage (FP32 math): against the CPU on the widened FP32 pool, within the BF16
// rounding of the stored state; unnamed slots keep their bits.
TEST_F(CudaKda, DecodeAndVerifyWithBf16StateStorage) {
  const KdaConfig k = cfg(3, 128, 128, GateMode::kSafe);
  CaseSpec s;
  s.cfg = k;
  s.seqlens = {6};
  s.initial_state = false;
  const KdaCase c = make_case(s);
  const std::vector<float> pool0 = pool_of(k, 9, 4);
  std::vector<uint16_t> pool16(pool0.size());
  std::vector<float> widened(pool0.size());
  for (size_t i = 0; i < pool0.size(); ++i) {
    pool16[i] = bf16_from_f32(pool0[i]);
    widened[i] = bf16_to_f32(pool16[i]);
  }
  const std::vector<uint16_t> before16 = pool16;
  const int64_t block = 3 * 128 * 128;
  {
    const std::vector<int32_t> idx = {8, 0, -1, 5, 2, 6};
    std::vector<float> pool_cpu = widened, o_cpu(c.o_size()), o_gpu(c.o_size());
    ASSERT_TRUE(cpu::decode(k, {c.inputs(), pool_cpu, idx, o_cpu}).is_ok());
    DecodeArgs a{c.inputs(), {}, idx, o_gpu};
    a.state_pool_bf16 = pool16;
    const Status st = cuda::decode_host(k, a);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    EXPECT_LT(compare(o_gpu, o_cpu).err_ratio, kTolBf16State);
    for (int64_t slot = 0; slot < 9; ++slot) {
      const bool named = slot == 8 || slot == 0 || slot == 5 || slot == 2 || slot == 6;
      std::vector<float> got(block), want(pool_cpu.begin() + slot * block, pool_cpu.begin() + (slot + 1) * block);
      for (int64_t i = 0; i < block; ++i) got[i] = bf16_to_f32(pool16[slot * block + i]);
      if (named) {
        EXPECT_LT(compare(got, want).err_ratio, kTolBf16State) << "slot " << slot;
      } else {
        EXPECT_TRUE(std::equal(pool16.begin() + slot * block, pool16.begin() + (slot + 1) * block,
                               before16.begin() + slot * block))
            << "slot " << slot << " was not named";
      }
    }
  }
  {
    pool16 = before16;
    const std::vector<int32_t> idx = {0, 1, 2, 3, 4, 5};  // 2 sequences x 3 draft tokens
    const std::vector<int32_t> acc = {2, 1};
    std::vector<float> pool_cpu = widened, o_cpu(c.o_size()), o_gpu(c.o_size());
    ASSERT_TRUE(cpu::verify(k, {c.inputs(), 3, pool_cpu, idx, acc, o_cpu}).is_ok());
    VerifyArgs a{c.inputs(), 3, {}, idx, acc, o_gpu};
    a.state_pool_bf16 = pool16;
    const Status st = cuda::verify_host(k, a);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    EXPECT_LT(compare(o_gpu, o_cpu).err_ratio, kTolBf16State);
  }
}

// The non-finite policy of docs/kda.md: the same NaN entries as the CPU backend.
TEST_F(CudaKda, NonFiniteInputsPoisonTheSameEntriesAsTheCpu) {
  CaseSpec s;
  s.cfg = cfg(2, 32, 40, GateMode::kLogDecay);
  s.seqlens = {12, 9};
  s.bf16 = false;
  KdaCase c = make_case(s);
  const int64_t H = 2, K = 32, V = 40;
  c.q32[(3 * H + 1) * K + 5] = NAN;       // o row (3, head 1)
  c.v32[(6 * H + 0) * V + 7] = INFINITY;  // column 7 of head 0 from token 6 in sequence 0
  c.k32[(14 * H + 1) * K + 2] = NAN;      // the whole write of head 1 from token 14 (sequence 1)
  c.g[(16 * H + 0) * K + 1] = 100.0f;     // poisons head 0's write at token 16
  Out cpu_out{std::vector<float>(c.o_size()), std::vector<float>(c.state_size())};
  ASSERT_TRUE(cpu::prefill(c.spec.cfg, c.inputs(), {cpu_out.o, cpu_out.f}).is_ok());
  const Out gpu = run_gpu(c);
  int poisoned = 0;
  for (size_t i = 0; i < gpu.o.size(); ++i) {
    ASSERT_EQ(std::isnan(gpu.o[i]), std::isnan(cpu_out.o[i])) << "o element " << i;
    ASSERT_FALSE(std::isinf(gpu.o[i])) << "o element " << i;
    poisoned += std::isnan(gpu.o[i]) ? 1 : 0;
  }
  for (size_t i = 0; i < gpu.f.size(); ++i) ASSERT_EQ(std::isnan(gpu.f[i]), std::isnan(cpu_out.f[i])) << "state " << i;
  EXPECT_GT(poisoned, 0);
}

// The device calls enqueue only: a decode captured in a CUDA graph and replayed gives the eager
// call's bits.
TEST_F(CudaKda, DecodeCapturedInAGraphReplaysTheEagerBits) {
  const KdaConfig k = cfg(4, 128, 128, GateMode::kSafe);
  CaseSpec s;
  s.cfg = k;
  s.seqlens = {8};
  s.initial_state = false;
  const KdaCase c = make_case(s);
  const std::vector<float> pool0 = pool_of(k, 10, 3);
  const std::vector<int32_t> idx = {9, 0, 4, -1, 2, 7, 1, 3};
  cuda::KdaOptions opt;
  opt.device = cuda::device_caps(0).value();
  opt.max_seqs = 8;
  auto p = cuda::plan(k, opt);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  auto dev = [](size_t bytes) {
    void* ptr = nullptr;
    EXPECT_EQ(cudaMalloc(&ptr, bytes), cudaSuccess);
    return ptr;
  };
  const size_t qk = c.q16.size() * 2, vb = c.v16.size() * 2, gb = c.g.size() * 4, bb = c.beta.size() * 4;
  auto* dq = static_cast<uint16_t*>(dev(qk));
  auto* dk = static_cast<uint16_t*>(dev(qk));
  auto* dv = static_cast<uint16_t*>(dev(vb));
  auto* dg = static_cast<float*>(dev(gb));
  auto* db = static_cast<float*>(dev(bb));
  auto* da = static_cast<float*>(dev(c.a_log.size() * 4));
  auto* dpool = static_cast<float*>(dev(pool0.size() * 4));
  auto* didx = static_cast<int32_t*>(dev(idx.size() * 4));
  auto* dout = static_cast<float*>(dev(c.o_size() * 4));
  void* ws = dev(static_cast<size_t>(p->workspace_bytes));
  cudaMemcpy(dq, c.q16.data(), qk, cudaMemcpyHostToDevice);
  cudaMemcpy(dk, c.k16.data(), qk, cudaMemcpyHostToDevice);
  cudaMemcpy(dv, c.v16.data(), vb, cudaMemcpyHostToDevice);
  cudaMemcpy(dg, c.g.data(), gb, cudaMemcpyHostToDevice);
  cudaMemcpy(db, c.beta.data(), bb, cudaMemcpyHostToDevice);
  cudaMemcpy(da, c.a_log.data(), c.a_log.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(didx, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice);
  DecodeArgs a;
  a.in.q = ActSpan::of(std::span<const uint16_t>(dq, c.q16.size()));
  a.in.k = ActSpan::of(std::span<const uint16_t>(dk, c.k16.size()));
  a.in.v = ActSpan::of(std::span<const uint16_t>(dv, c.v16.size()));
  a.in.g = {dg, c.g.size()};
  a.in.beta = {db, c.beta.size()};
  a.in.a_log = {da, c.a_log.size()};
  a.state_pool = {dpool, pool0.size()};
  a.state_indices = {didx, idx.size()};
  a.o = {dout, static_cast<size_t>(c.o_size())};
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  auto read = [&](std::vector<float>* pool, std::vector<float>* o) {
    pool->resize(pool0.size());
    o->resize(static_cast<size_t>(c.o_size()));
    cudaMemcpy(pool->data(), dpool, pool0.size() * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(o->data(), dout, o->size() * 4, cudaMemcpyDeviceToHost);
  };
  cudaMemcpy(dpool, pool0.data(), pool0.size() * 4, cudaMemcpyHostToDevice);
  ASSERT_TRUE(cuda::decode(*p, a, ws, stream).is_ok());
  ASSERT_TRUE(cuda::kda_status(*p, ws, stream).is_ok());
  std::vector<float> eager_pool, eager_o;
  read(&eager_pool, &eager_o);

  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  const Status cap = cuda::decode(*p, a, ws, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(cap.is_ok()) << cap.to_string();
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) {
    cudaMemcpy(dpool, pool0.data(), pool0.size() * 4, cudaMemcpyHostToDevice);
    cudaMemset(dout, 0, c.o_size() * 4);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<float> gp, go;
    read(&gp, &go);
    EXPECT_TRUE(same_bits(gp, eager_pool)) << "replay " << replay;
    EXPECT_TRUE(same_bits(go, eager_o)) << "replay " << replay;
  }

  // Device-side refusal: slot 9 written twice. Both sequences' rows are NaN, the pool is
  // untouched there, the others run, and kda_status names the problem.
  const std::vector<int32_t> dup = {9, 0, 4, -1, 9, 7, 1, 3};
  cudaMemcpy(didx, dup.data(), dup.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dpool, pool0.data(), pool0.size() * 4, cudaMemcpyHostToDevice);
  ASSERT_TRUE(cuda::decode(*p, a, ws, stream).is_ok());
  const Status st = cuda::kda_status(*p, ws, stream);
  EXPECT_NE(st.message().find("state slot written twice"), std::string::npos) << st.to_string();
  std::vector<float> dp, dout_h;
  read(&dp, &dout_h);
  const int64_t row = 4 * 128, block = 4 * 128 * 128;
  for (int64_t n : {0, 4}) {
    for (int64_t j = 0; j < row; ++j) ASSERT_TRUE(std::isnan(dout_h[n * row + j])) << "row " << n;
  }
  EXPECT_TRUE(std::equal(dp.begin() + 9 * block, dp.begin() + 10 * block, pool0.begin() + 9 * block));
  EXPECT_TRUE(std::equal(dp.begin() + 7 * block, dp.begin() + 8 * block, eager_pool.begin() + 7 * block));
  // A slot past the pool.
  const std::vector<int32_t> far = {10, 0, 4, -1, 2, 7, 1, 3};
  cudaMemcpy(didx, far.data(), far.size() * 4, cudaMemcpyHostToDevice);
  ASSERT_TRUE(cuda::decode(*p, a, ws, stream).is_ok());
  EXPECT_NE(cuda::kda_status(*p, ws, stream).message().find("state slot past the pool"), std::string::npos);
  // The next good call clears the status.
  cudaMemcpy(didx, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice);
  ASSERT_TRUE(cuda::decode(*p, a, ws, stream).is_ok());
  EXPECT_TRUE(cuda::kda_status(*p, ws, stream).is_ok());

  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  for (void* ptr : {static_cast<void*>(dq), static_cast<void*>(dk), static_cast<void*>(dv), static_cast<void*>(dg),
                    static_cast<void*>(db), static_cast<void*>(da), static_cast<void*>(dpool),
                    static_cast<void*>(didx), static_cast<void*>(dout), ws}) {
    cudaFree(ptr);
  }
}

// Malformed cu_seqlens on the device: no output row is written, the final states are NaN, and the
// status names it.
TEST_F(CudaKda, BadSeqlensOnTheDeviceAreReportedNotFollowed) {
  CaseSpec s;
  s.cfg = cfg(2, 32, 32, GateMode::kLogDecay);
  s.seqlens = {5, 7};
  s.bf16 = false;
  const KdaCase c = make_case(s);
  cuda::KdaOptions opt;
  opt.device = cuda::device_caps(0).value();
  opt.max_seqs = 4;
  auto p = cuda::plan(s.cfg, opt);
  ASSERT_TRUE(p.is_ok());
  auto up = [](const auto& v) {
    void* ptr = nullptr;
    const size_t bytes = v.size() * sizeof(v[0]);
    EXPECT_EQ(cudaMalloc(&ptr, bytes), cudaSuccess);
    cudaMemcpy(ptr, v.data(), bytes, cudaMemcpyHostToDevice);
    return ptr;
  };
  const std::vector<int64_t> good_cu = {0, 9, 12};
  const std::vector<int64_t> worse_cu = {0, 13, 12};  // 13 > T
  std::vector<float> o(c.o_size(), 7.0f), f(c.state_size(), 0.0f);
  auto* dq = static_cast<const float*>(up(c.q32));
  auto* dk = static_cast<const float*>(up(c.k32));
  auto* dv = static_cast<const float*>(up(c.v32));
  auto* dg = static_cast<const float*>(up(c.g));
  auto* db = static_cast<const float*>(up(c.beta));
  auto* dcu = static_cast<int64_t*>(up(worse_cu));
  auto* dcu_ok = static_cast<const int64_t*>(up(good_cu));
  auto* dof = static_cast<float*>(up(o));
  auto* dff = static_cast<float*>(up(f));
  void* ws = nullptr;
  ASSERT_EQ(cudaMalloc(&ws, static_cast<size_t>(p->workspace_bytes)), cudaSuccess);
  KdaInputs in;
  in.q = ActSpan::of(std::span<const float>(dq, c.q32.size()));
  in.k = ActSpan::of(std::span<const float>(dk, c.k32.size()));
  in.v = ActSpan::of(std::span<const float>(dv, c.v32.size()));
  in.g = {dg, c.g.size()};
  in.beta = {db, c.beta.size()};
  in.cu_seqlens = {dcu, 3};
  ASSERT_TRUE(cuda::prefill(*p, in, {{dof, o.size()}, {dff, f.size()}}, ws, nullptr).is_ok());
  const Status st = cuda::kda_status(*p, ws, nullptr);
  EXPECT_NE(st.message().find("bad cu_seqlens"), std::string::npos) << st.to_string();
  std::vector<float> o2(o.size()), f2(f.size());
  cudaMemcpy(o2.data(), dof, o2.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(f2.data(), dff, f2.size() * 4, cudaMemcpyDeviceToHost);
  for (float x : o2) ASSERT_EQ(x, 7.0f);
  for (float x : f2) ASSERT_TRUE(std::isnan(x));
  in.cu_seqlens = {dcu_ok, 3};
  ASSERT_TRUE(cuda::prefill(*p, in, {{dof, o.size()}, {dff, f.size()}}, ws, nullptr).is_ok());
  EXPECT_TRUE(cuda::kda_status(*p, ws, nullptr).is_ok());
  for (const void* ptr : {static_cast<const void*>(dq), static_cast<const void*>(dk), static_cast<const void*>(dv),
                          static_cast<const void*>(dg), static_cast<const void*>(db), static_cast<const void*>(dcu),
                          static_cast<const void*>(dcu_ok), static_cast<const void*>(dof),
                          static_cast<const void*>(dff), static_cast<const void*>(ws)}) {
    cudaFree(const_cast<void*>(ptr));
  }
}

// The grid does not depend on the token split: a prefill captured with one cu_seqlens replays
// with other values written into the same device buffer (same N, same buffers), and gives the
// bits of an eager call with those values. Both algorithms.
TEST_F(CudaKda, PrefillGraphReplaysWithNewSeqlensValues) {
  CaseSpec s;
  s.cfg = cfg(4, 128, 128, GateMode::kSafe);
  s.seqlens = {40, 1, 23};  // T = 64
  s.bf16 = false;
  const KdaCase c = make_case(s);
  const std::vector<int64_t> cu_a = {0, 40, 41, 64}, cu_b = {0, 7, 7, 64};
  for (Algorithm algo : {Algorithm::kRecurrent, Algorithm::kChunked}) {
    SCOPED_TRACE(algorithm_name(algo));
    cuda::KdaOptions opt;
    opt.device = cuda::device_caps(0).value();
    opt.max_seqs = 3;
    opt.algorithm = algo;
    auto p = cuda::plan(s.cfg, opt);
    ASSERT_TRUE(p.is_ok()) << p.status().to_string();
    std::vector<void*> owned;
    auto up = [&](const void* src, size_t bytes) {
      void* ptr = nullptr;
      EXPECT_EQ(cudaMalloc(&ptr, bytes), cudaSuccess);
      if (src != nullptr) cudaMemcpy(ptr, src, bytes, cudaMemcpyHostToDevice);
      owned.push_back(ptr);
      return ptr;
    };
    KdaInputs in;
    in.q = ActSpan::of(std::span<const float>(static_cast<const float*>(up(c.q32.data(), c.q32.size() * 4)), c.q32.size()));
    in.k = ActSpan::of(std::span<const float>(static_cast<const float*>(up(c.k32.data(), c.k32.size() * 4)), c.k32.size()));
    in.v = ActSpan::of(std::span<const float>(static_cast<const float*>(up(c.v32.data(), c.v32.size() * 4)), c.v32.size()));
    in.g = {static_cast<const float*>(up(c.g.data(), c.g.size() * 4)), c.g.size()};
    in.beta = {static_cast<const float*>(up(c.beta.data(), c.beta.size() * 4)), c.beta.size()};
    in.a_log = {static_cast<const float*>(up(c.a_log.data(), c.a_log.size() * 4)), c.a_log.size()};
    // The reference runs the safe gate with dt_bias too (the first H200 run, 2026-12-04, failed
    // here with err_ratio 0.19 on both algorithms: the test had left dt_bias out).
    in.dt_bias = {static_cast<const float*>(up(c.dt_bias.data(), c.dt_bias.size() * 4)), c.dt_bias.size()};
    in.initial_state = {static_cast<const float*>(up(c.initial_state.data(), c.initial_state.size() * 4)),
                        c.initial_state.size()};
    auto* dcu = static_cast<int64_t*>(up(cu_a.data(), 4 * 8));
    in.cu_seqlens = {dcu, 4};
    auto* o = static_cast<float*>(up(nullptr, static_cast<size_t>(c.o_size()) * 4));
    auto* f = static_cast<float*>(up(nullptr, static_cast<size_t>(c.state_size()) * 4));
    void* ws = up(nullptr, static_cast<size_t>(p->workspace_bytes));
    const KdaOutputs out{{o, static_cast<size_t>(c.o_size())}, {f, static_cast<size_t>(c.state_size())}};
    auto read = [&]() {
      std::vector<float> r(static_cast<size_t>(c.o_size() + c.state_size()));
      cudaMemcpy(r.data(), o, static_cast<size_t>(c.o_size()) * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(r.data() + c.o_size(), f, static_cast<size_t>(c.state_size()) * 4, cudaMemcpyDeviceToHost);
      return r;
    };
    cudaMemcpy(dcu, cu_b.data(), 4 * 8, cudaMemcpyHostToDevice);
    ASSERT_TRUE(cuda::prefill(*p, in, out, ws, nullptr).is_ok());
    ASSERT_TRUE(cuda::kda_status(*p, ws, nullptr).is_ok());
    const std::vector<float> eager_b = read();
    cudaMemcpy(dcu, cu_a.data(), 4 * 8, cudaMemcpyHostToDevice);
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    cudaGraph_t graph;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    const Status cap = cuda::prefill(*p, in, out, ws, stream);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_TRUE(cap.is_ok()) << cap.to_string();
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    cudaMemcpy(dcu, cu_b.data(), 4 * 8, cudaMemcpyHostToDevice);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_TRUE(same_bits(read(), eager_b));
    // And the values the graph was captured with still give the reference's result.
    cudaMemcpy(dcu, cu_a.data(), 4 * 8, cudaMemcpyHostToDevice);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<float> got = read();
    const Out ref = run_ref(c);
    EXPECT_LT(compare(std::vector<float>(got.begin(), got.begin() + c.o_size()), ref.o).err_ratio, kTolFp32);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    for (void* ptr : owned) cudaFree(ptr);
  }
}

// Through the registry, as `k3 validate --op kda --backend cuda` and the bindings call it.
TEST_F(CudaKda, RegistryEntriesRunTheBackend) {
  const KdaBackend& b = *find_kda_backend("cuda").value();
  ASSERT_TRUE(b.available().is_ok()) << b.available().to_string();
  CaseSpec s;
  s.cfg = cfg(2, 64, 64, GateMode::kSafe);
  s.seqlens = {10, 30};
  const KdaCase c = make_case(s);
  std::vector<float> o(c.o_size()), f(c.state_size());
  ASSERT_TRUE(run_kda_prefill(b, s.cfg, c.inputs(), {o, f}).is_ok());
  const Out ref = run_ref(c);
  EXPECT_LT(compare(o, ref.o).err_ratio, kTolFp32);
  BackendOptions chunked;
  chunked.kda_algorithm = Algorithm::kChunked;
  // algorithm = chunked reaches the chunked kernel (tests/cuda/test_cuda_kda_chunked.cpp).
  std::fill(o.begin(), o.end(), 7.0f);
  const Status st = run_kda_prefill(b, s.cfg, c.inputs(), {o, f}, chunked);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_LT(compare(o, ref.o).err_ratio, kTolBf16VsFp32);
  EXPECT_LT(compare(f, ref.f).err_ratio, kTolBf16VsFp32);
}

}  // namespace
}  // namespace k3::kda
