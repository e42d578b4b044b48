// The chunked prefill kernel of the CUDA KDA backend (algorithm = chunked; src/cuda/kda/
// kda_chunked.cu) against the FP32 reference, the token-recurrent kernel and the CPU backend:
// varlen batches (an empty sequence, length 1, lengths that are no multiple of 16), resets
// (g = -1000), the safe gate at its -5 bound (strong decay: the exact-ratio tree), both layouts,
// BF16 and FP32 inputs, every gate, the non-finite policy, bad cu_seqlens, determinism. Needs a
// CUDA device: without one every test skips with the reason. Ran on an H200 (2026-12-04): pass.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "k3/harness/kda_case.hpp"
#include "core/kda/kda_chunk_math.hpp"
#include "cuda/kda_test_util.hpp"
#include "k3/cpu_kda.hpp"
#include "k3/cuda.hpp"
#include "k3/cuda_kda.hpp"

namespace k3::kda {
namespace {

using test::cfg;
using test::Out;
using test::run_gpu;
using test::run_ref;

class CudaKdaChunked : public test::CudaDeviceTest {};

double tol(bool bf16) { return bf16 ? kTolBf16VsFp32 : kTolFp32; }

TEST_F(CudaKdaChunked, MatchesTheFp32ReferenceOnVarlenBatches) {
  struct Shape {
    int64_t h, k, v;
    std::vector<int64_t> lens, resets;
  };
  const Shape shapes[] = {{2, 128, 128, {37, 0, 1, 16, 130}, {5, 20, 21, 100}},
                          {3, 60, 100, {63}, {}},
                          {2, 32, 48, {15, 40, 0, 17}, {20, 21}},
                          {1, 256, 64, {50}, {17}}};
  const int64_t optin = cuda::device_caps(0).value().smem_per_block_optin;
  for (const auto& sh : shapes) {
    if (chunk::smem_bytes(static_cast<int>(sh.k)) > optin) {  // K = 256 does not fit a 99 KB part (sm_120)
      std::printf("[ info ] K = %lld skipped: the chunked kernel needs more shared memory than %lld B\n",
                  static_cast<long long>(sh.k), static_cast<long long>(optin));
      continue;
    }
    for (GateMode gate : {GateMode::kLogDecay, GateMode::kSafe, GateMode::kSoftplus}) {
      for (StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst}) {
        for (bool bf16 : {true, false}) {
          CaseSpec s;
          s.cfg = cfg(sh.h, sh.k, sh.v, gate, layout);
          s.seqlens = sh.lens;
          s.resets = sh.resets;
          s.bf16 = bf16;
          s.seed = 21 + static_cast<uint64_t>(sh.k);
          const KdaCase c = make_case(s);
          const Out ref = run_ref(c), out = run_gpu(c, Algorithm::kChunked);
          const std::string what = std::string(gate_mode_name(gate)) + " " + state_layout_name(layout) +
                                   (bf16 ? " bf16 K=" : " fp32 K=") + std::to_string(sh.k);
          EXPECT_LT(compare(out.o, ref.o).err_ratio, tol(bf16)) << what;
          EXPECT_LT(compare(out.f, ref.f).err_ratio, tol(bf16)) << what;
        }
      }
    }
  }
}

// The safe gate saturated at its -5 bound: 16 tokens span 80 > 60, so the chunks take the tree
// of exact ratios (kda_chunk_math.hpp).
TEST_F(CudaKdaChunked, StrongDecayAtTheSafeGateBound) {
  for (bool bf16 : {true, false}) {
    CaseSpec s;
    s.cfg = cfg(4, 128, 128, GateMode::kSafe);
    s.seqlens = {200, 33};
    s.bf16 = bf16;
    KdaCase c = make_case(s);
    for (size_t i = 0; i < c.g.size(); ++i) {
      if (i % 3 != 0) c.g[i] = 40.0f;
    }
    const Out ref = run_ref(c), out = run_gpu(c, Algorithm::kChunked);
    EXPECT_LT(compare(out.o, ref.o).err_ratio, tol(bf16));
    EXPECT_LT(compare(out.f, ref.f).err_ratio, tol(bf16));
  }
}

TEST_F(CudaKdaChunked, AgreesWithTheRecurrentKernel) {
  for (StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst}) {
    CaseSpec s;
    s.cfg = cfg(4, 128, 128, GateMode::kSafe, layout);
    s.seqlens = {300, 1, 0, 77};
    s.resets = {150};
    const KdaCase c = make_case(s);
    const Out chk = run_gpu(c, Algorithm::kChunked), rec = run_gpu(c, Algorithm::kRecurrent);
    EXPECT_LT(compare(chk.o, rec.o).err_ratio, kTolFp32);
    EXPECT_LT(compare(chk.f, rec.f).err_ratio, kTolFp32);
  }
}

TEST_F(CudaKdaChunked, IsBitIdenticalAcrossRuns) {
  CaseSpec s;
  s.cfg = cfg(4, 128, 128, GateMode::kSafe);
  s.seqlens = {200, 3, 77};
  const KdaCase c = make_case(s);
  const Out a = run_gpu(c, Algorithm::kChunked), b = run_gpu(c, Algorithm::kChunked);
  ASSERT_EQ(a.o.size(), b.o.size());
  EXPECT_EQ(std::memcmp(a.o.data(), b.o.data(), a.o.size() * 4), 0);
  EXPECT_EQ(std::memcmp(a.f.data(), b.f.data(), a.f.size() * 4), 0);
}

// The non-finite policy of docs/kda.md: the same NaN entries as the CPU backend (chunked).
TEST_F(CudaKdaChunked, NonFiniteInputsPoisonTheSameEntriesAsTheCpu) {
  for (StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst}) {
    CaseSpec s;
    s.cfg = cfg(2, 32, 40, GateMode::kLogDecay, layout);
    s.seqlens = {45, 20, 0};
    s.bf16 = false;
    KdaCase c = make_case(s);
    const int64_t H = 2, K = 32, V = 40;
    c.q32[(3 * H + 0) * K + 5] = NAN;
    c.k32[(20 * H + 1) * K + 7] = INFINITY;
    c.v32[(30 * H + 0) * V + 33] = NAN;
    c.g[(50 * H + 1) * K + 2] = 100.0f;
    c.beta[60 * H + 0] = NAN;
    c.initial_state[1 * H * K * V + 0 * K * V + 4] = INFINITY;
    c.initial_state[2 * H * K * V + 1 * K * V + 9] = NAN;  // empty sequence: returned unchanged
    Out cpu_out{std::vector<float>(c.o_size()), std::vector<float>(c.state_size())};
    ASSERT_TRUE(cpu::prefill(c.spec.cfg, c.inputs(), {cpu_out.o, cpu_out.f}).is_ok());
    const Out gpu = run_gpu(c, Algorithm::kChunked);
    int poisoned = 0;
    for (size_t i = 0; i < gpu.o.size(); ++i) {
      ASSERT_EQ(std::isnan(gpu.o[i]), std::isnan(cpu_out.o[i])) << "o element " << i;
      ASSERT_FALSE(std::isinf(gpu.o[i])) << "o element " << i;
      poisoned += std::isnan(gpu.o[i]) ? 1 : 0;
    }
    for (size_t i = 0; i < gpu.f.size(); ++i) {
      ASSERT_EQ(std::isnan(gpu.f[i]), std::isnan(cpu_out.f[i])) << "state " << i;
    }
    EXPECT_GT(poisoned, 100);
  }
}

// Bad cu_seqlens seen on the device: no output row written, the final state NaN, the status bit.
TEST_F(CudaKdaChunked, BadSeqlensAreReportedNotFollowed) {
  CaseSpec s;
  s.cfg = cfg(2, 32, 32, GateMode::kLogDecay);
  s.seqlens = {5, 7};
  s.bf16 = false;
  const KdaCase c = make_case(s);
  cuda::KdaOptions opt;
  opt.device = cuda::device_caps(0).value();
  opt.max_seqs = 4;
  opt.algorithm = Algorithm::kChunked;
  auto p = cuda::plan(s.cfg, opt);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  auto up = [](const auto& v) {
    void* ptr = nullptr;
    const size_t bytes = v.size() * sizeof(v[0]);
    EXPECT_EQ(cudaMalloc(&ptr, bytes), cudaSuccess);
    cudaMemcpy(ptr, v.data(), bytes, cudaMemcpyHostToDevice);
    return ptr;
  };
  const std::vector<int64_t> bad_cu = {0, 13, 12};  // 13 > T
  std::vector<float> o(c.o_size(), 7.0f), f(c.state_size(), 0.0f);
  std::vector<void*> owned = {up(c.q32), up(c.k32), up(c.v32), up(c.g), up(c.beta), up(bad_cu), up(o), up(f)};
  void* ws = nullptr;
  ASSERT_EQ(cudaMalloc(&ws, static_cast<size_t>(p->workspace_bytes)), cudaSuccess);
  owned.push_back(ws);
  KdaInputs in;
  in.q = ActSpan::of(std::span<const float>(static_cast<const float*>(owned[0]), c.q32.size()));
  in.k = ActSpan::of(std::span<const float>(static_cast<const float*>(owned[1]), c.k32.size()));
  in.v = ActSpan::of(std::span<const float>(static_cast<const float*>(owned[2]), c.v32.size()));
  in.g = {static_cast<const float*>(owned[3]), c.g.size()};
  in.beta = {static_cast<const float*>(owned[4]), c.beta.size()};
  in.cu_seqlens = {static_cast<const int64_t*>(owned[5]), 3};
  auto* dof = static_cast<float*>(owned[6]);
  auto* dff = static_cast<float*>(owned[7]);
  ASSERT_TRUE(cuda::prefill(*p, in, {{dof, o.size()}, {dff, f.size()}}, ws, nullptr).is_ok());
  const Status st = cuda::kda_status(*p, ws, nullptr);
  EXPECT_NE(st.message().find("bad cu_seqlens"), std::string::npos) << st.to_string();
  std::vector<float> o2(o.size()), f2(f.size());
  cudaMemcpy(o2.data(), dof, o2.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(f2.data(), dff, f2.size() * 4, cudaMemcpyDeviceToHost);
  for (float x : o2) ASSERT_EQ(x, 7.0f);
  for (float x : f2) ASSERT_TRUE(std::isnan(x));
  for (void* ptr : owned) cudaFree(ptr);
}

}  // namespace
}  // namespace k3::kda
