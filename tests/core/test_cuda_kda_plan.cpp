// Host-side planning of the CUDA KDA backend and the size checks of its device calls: no GPU
// needed (k3_core). The device calls must not read device memory on the host, so the size checks
// are given spans over addresses that would fault if read.
#include <gtest/gtest.h>

#include <cstdint>
#include <span>
#include <string>

#include "core/kda/kda_chunk_math.hpp"
#include "k3/cuda_kda.hpp"

namespace k3 {
namespace {

cuda::DeviceCaps h200() {
  cuda::DeviceCaps c;
  c.name = "NVIDIA H200 (by hand)";
  c.cc_major = 9;
  c.cc_minor = 0;
  c.sm_count = 132;
  c.smem_per_block_optin = 232448;
  c.compiled_archs = {90, 120};
  return c;
}

kda::KdaConfig kimi() { return kda::KdaConfig{}; }  // H 96, K = V = 128, safe gate

cuda::KdaOptions opts(int64_t max_seqs = 64) {
  cuda::KdaOptions o;
  o.device = h200();
  o.max_seqs = max_seqs;
  return o;
}

bool has(const Status& s, const std::string& text) { return s.message().find(text) != std::string::npos; }

// Spans over device memory: the host must only look at their sizes. 0x1000 is never mapped.
template <typename T>
std::span<T> dev(int64_t n) {
  return n == 0 ? std::span<T>() : std::span<T>(reinterpret_cast<T*>(uintptr_t{0x1000}), static_cast<size_t>(n));
}

TEST(CudaKdaPlan, ReplanPolicyGrowsToAtLeast1024AndKeepsACoveringPlan) {
  EXPECT_EQ(cuda::kda_replan_max_seqs(0, 1).value(), 1024);        // no plan yet
  EXPECT_EQ(cuda::kda_replan_max_seqs(0, 3000).value(), 3000);
  EXPECT_EQ(cuda::kda_replan_max_seqs(1024, 1024).value(), 0);     // covered: keep it
  EXPECT_EQ(cuda::kda_replan_max_seqs(1024, 1025).value(), 1025);
  EXPECT_EQ(cuda::kda_replan_max_seqs(4096, 7).value(), 0);
  const auto bad = cuda::kda_replan_max_seqs(0, cuda::kKdaMaxSeqs + 1);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("sequences = 65536 must be in [1, 65535]"), std::string::npos);
  EXPECT_FALSE(cuda::kda_replan_max_seqs(0, 0).is_ok());
}

TEST(CudaKdaPlan, GeometryFollowsTheHeadDims) {
  auto p = cuda::plan(kimi(), opts());
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->warps, 4);
  EXPECT_EQ(p->rows_per_thread, 32);
  EXPECT_EQ(p->v_tiles, 4);
  EXPECT_EQ(p->algorithm, kda::Algorithm::kRecurrent);
  struct Dims { int64_t k, v; int warps, rows, vt; };
  for (const Dims d : {Dims{60, 100, 2, 30, 4}, Dims{512, 512, 16, 32, 16}, Dims{1, 1, 1, 1, 1}, Dims{33, 32, 2, 17, 1},
                       Dims{96, 64, 3, 32, 2}}) {
    kda::KdaConfig c = kimi();
    c.head_k = d.k;
    c.head_v = d.v;
    auto q = cuda::plan(c, opts());
    ASSERT_TRUE(q.is_ok()) << q.status().to_string();
    EXPECT_EQ(q->warps, d.warps) << "K " << d.k;
    EXPECT_EQ(q->rows_per_thread, d.rows) << "K " << d.k;
    EXPECT_EQ(q->v_tiles, d.vt) << "V " << d.v;
    // Every row has a thread: warps * rows covers K, and the last warp owns at least one row.
    EXPECT_GE(q->warps * q->rows_per_thread, d.k);
    EXPECT_LT((q->warps - 1) * q->rows_per_thread, d.k);
    EXPECT_LE(q->warps * 32, 512);
    EXPECT_LE(q->smem_bytes, 48 * 1024);  // static shared memory, no opt-in needed
  }
}

TEST(CudaKdaPlan, WorkspaceHoldsTheStatusWordAndOneFlagPerSequence) {
  for (int64_t seqs : {int64_t{1}, int64_t{64}, int64_t{65}, int64_t{1000}, cuda::kKdaMaxSeqs}) {
    auto p = cuda::plan(kimi(), opts(seqs));
    ASSERT_TRUE(p.is_ok());
    EXPECT_EQ(p->ws_status, 0);
    EXPECT_EQ(p->ws_seq_flags % 256, 0);
    EXPECT_GE(p->workspace_bytes - p->ws_seq_flags, seqs * 4);
    EXPECT_EQ(p->workspace_bytes % 256, 0);
  }
}

TEST(CudaKdaPlan, DescribeNamesTheChoicesAndSaysUnverified) {
  auto p = cuda::plan(kimi(), opts());
  ASSERT_TRUE(p.is_ok());
  const std::string d = p->describe();
  for (const char* s : {"H 96", "K 128", "V 128", "checked on an H200 (sm_90, 2026-12-04), never on sm_120", "prefill recurrent", "4 warp(s) x 32", "sm_90",
                        "workspace"}) {
    EXPECT_NE(d.find(s), std::string::npos) << s << " not in: " << d;
  }
}

TEST(CudaKdaPlan, RefusalsNameTheProblem) {
  cuda::KdaOptions o = opts();
  o.device = {};
  EXPECT_TRUE(has(cuda::plan(kimi(), o).status(), "options.device is empty"));
  o = opts();
  o.device.compiled_archs = {120};
  auto st = cuda::plan(kimi(), o).status();
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_TRUE(has(st, "sm_90")) << st.to_string();
  EXPECT_TRUE(has(st, "sm_120")) << st.to_string();
  for (int64_t bad : {int64_t{0}, int64_t{-1}, cuda::kKdaMaxSeqs + 1}) {
    st = cuda::plan(kimi(), opts(bad)).status();
    EXPECT_TRUE(has(st, "max_seqs = " + std::to_string(bad))) << st.to_string();
  }
  // Chunked: the kernel's shared memory must fit the device's opt-in limit (K = 512 needs ~348 KB).
  o = opts();
  o.algorithm = kda::Algorithm::kChunked;
  kda::KdaConfig big = kimi();
  big.head_k = 512;
  st = cuda::plan(big, o).status();
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_TRUE(has(st, "chunked")) << st.to_string();
  EXPECT_TRUE(has(st, std::to_string(kda::chunk::smem_bytes(512)) + " B")) << st.to_string();
  EXPECT_TRUE(has(st, "K = 512")) << st.to_string();
  EXPECT_TRUE(has(st, "232448")) << st.to_string();
  EXPECT_TRUE(has(st, "recurrent")) << st.to_string();
  kda::KdaConfig c = kimi();
  c.head_k = 513;
  EXPECT_TRUE(has(cuda::plan(c, opts()).status(), "head_k = 513"));
}

TEST(CudaKdaPlan, ChunkedPlanHasItsGeometry) {
  cuda::KdaOptions o = opts();
  o.algorithm = kda::Algorithm::kChunked;
  auto p = cuda::plan(kimi(), o);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->algorithm, kda::Algorithm::kChunked);
  EXPECT_EQ(p->chunk_size, 16);
  EXPECT_EQ(p->chunk_size, kda::kChunk);
  EXPECT_EQ(p->chunk_v_tile, 32);
  EXPECT_EQ(p->chunk_warps, 4);
  EXPECT_EQ(p->v_tiles, 4);
  EXPECT_EQ(p->chunk_smem_bytes, kda::chunk::smem_bytes(128));
  // K = 128 fits the 99 KB opt-in of sm_120 parts as well as the H200's 227 KB.
  EXPECT_GT(p->chunk_smem_bytes, 48 * 1024);
  EXPECT_LE(p->chunk_smem_bytes, 101376);
  EXPECT_GT(p->workspace_bytes, 0);
  const std::string d = p->describe();
  const std::string smem = "dynamic smem " + std::to_string(p->chunk_smem_bytes) + " B";
  for (const std::string& s : {std::string("prefill chunked"), std::string("slower than recurrent on an H200"), std::string("3xTF32"),
                              std::string("chunks of 16 tokens"), std::string("4 warps"),
                              std::string("V tile(s) of 32"), smem}) {
    EXPECT_NE(d.find(s), std::string::npos) << s << " not in: " << d;
  }
  // The smem grows with K; at K = 256 it fits the H200 but not a 99 KB part.
  kda::KdaConfig c = kimi();
  c.head_k = 256;
  auto q = cuda::plan(c, o);
  ASSERT_TRUE(q.is_ok()) << q.status().to_string();
  EXPECT_GT(q->chunk_smem_bytes, p->chunk_smem_bytes);
  o.device.smem_per_block_optin = 101376;
  EXPECT_EQ(cuda::plan(c, o).status().code(), StatusCode::kUnsupported);
  // Auto and recurrent leave the chunked fields empty, and auto stays recurrent while unverified.
  for (kda::Algorithm a : {kda::Algorithm::kAuto, kda::Algorithm::kRecurrent}) {
    o = opts();
    o.algorithm = a;
    auto r = cuda::plan(kimi(), o);
    ASSERT_TRUE(r.is_ok());
    EXPECT_EQ(r->algorithm, kda::Algorithm::kRecurrent);
    EXPECT_EQ(r->chunk_smem_bytes, 0);
    EXPECT_EQ(r->chunk_size, 0);
  }
}

struct DevPrefill {
  kda::KdaInputs in;
  kda::KdaOutputs out;
};

// A well-formed prefill of T tokens, N sequences, every span over unmapped "device" memory.
DevPrefill dev_prefill(const kda::KdaConfig& c, int64_t t, int64_t n) {
  const int64_t h = c.num_heads, k = c.head_k, v = c.head_v;
  DevPrefill d;
  d.in.q = kda::ActSpan::of(dev<const uint16_t>(t * h * k));
  d.in.k = kda::ActSpan::of(dev<const uint16_t>(t * h * k));
  d.in.v = kda::ActSpan::of(dev<const uint16_t>(t * h * v));
  d.in.g = dev<const float>(t * h * k);
  d.in.beta = dev<const float>(t * h);
  d.in.a_log = dev<const float>(h);
  d.in.dt_bias = dev<const float>(h * k);
  d.in.cu_seqlens = dev<const int64_t>(n + 1);
  d.in.initial_state = dev<const float>(n * h * k * v);
  d.out.o = dev<float>(t * h * v);
  d.out.final_state = dev<float>(n * h * k * v);
  return d;
}

TEST(CudaKdaPlan, PrefillSizeChecksReadNoDeviceValue) {
  kda::KdaConfig c = kimi();
  c.num_heads = 4;
  auto p = cuda::plan(c, opts(8));
  ASSERT_TRUE(p.is_ok());
  DevPrefill d = dev_prefill(c, 100, 8);
  // cu_seqlens and a_log point at unmapped memory: reading either would crash this test.
  EXPECT_TRUE(cuda::check_prefill_sizes(*p, d.in, d.out).is_ok());
  d = dev_prefill(c, 100, 9);
  auto st = cuda::check_prefill_sizes(*p, d.in, d.out);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
  EXPECT_TRUE(has(st, "9 sequences, more than the plan's max_seqs = 8")) << st.to_string();
  d = dev_prefill(c, 100, 2);
  d.out.o = dev<float>(100 * 4 * 128 - 1);
  EXPECT_TRUE(has(cuda::check_prefill_sizes(*p, d.in, d.out), "o has 51199 elements, expected 51200"));
  d = dev_prefill(c, 100, 2);
  d.in.cu_seqlens = dev<const int64_t>(1);
  EXPECT_TRUE(has(cuda::check_prefill_sizes(*p, d.in, d.out), "cu_seqlens has 1 entries"));
  d = dev_prefill(c, 100, 2);
  d.in.a_log = dev<const float>(3);
  EXPECT_TRUE(has(cuda::check_prefill_sizes(*p, d.in, d.out), "a_log has 3 elements"));
  d = dev_prefill(c, 100, 2);
  d.out.final_state = dev<float>(5);
  EXPECT_TRUE(has(cuda::check_prefill_sizes(*p, d.in, d.out), "final_state has 5 elements"));
  d = dev_prefill(c, 100, 2);
  d.in.beta = dev<const float>(399);
  EXPECT_TRUE(has(cuda::check_prefill_sizes(*p, d.in, d.out), "beta has 399 elements"));
  EXPECT_TRUE(has(cuda::check_prefill_sizes(cuda::KdaPlan{}, d.in, d.out), "plan is empty"));
}

TEST(CudaKdaPlan, DecodeAndVerifySizeChecksReadNoDeviceValue) {
  kda::KdaConfig c = kimi();
  c.num_heads = 2;
  c.head_k = 64;
  c.head_v = 32;
  auto p = cuda::plan(c, opts(16));
  ASSERT_TRUE(p.is_ok());
  const int64_t per_slot = 2 * 64 * 32;
  DevPrefill t = dev_prefill(c, 12, 1);
  kda::DecodeArgs a;
  a.in = t.in;
  a.in.cu_seqlens = {};
  a.in.initial_state = {};
  a.state_pool = dev<float>(40 * per_slot);
  a.state_indices = dev<const int32_t>(12);
  a.o = t.out.o;
  EXPECT_TRUE(cuda::check_decode_sizes(*p, a).is_ok());
  a.state_indices = dev<const int32_t>(11);
  EXPECT_TRUE(has(cuda::check_decode_sizes(*p, a), "state_indices has 11 entries, expected N = 12"));
  a.state_indices = dev<const int32_t>(12);
  a.state_pool = dev<float>(40 * per_slot + 1);
  EXPECT_TRUE(has(cuda::check_decode_sizes(*p, a), "state_pool has"));
  a.state_pool = {};
  a.state_pool_bf16 = dev<uint16_t>(40 * per_slot);  // BF16 state storage: a cuda option
  EXPECT_TRUE(cuda::check_decode_sizes(*p, a).is_ok());
  a.state_pool = dev<float>(40 * per_slot);
  EXPECT_TRUE(has(cuda::check_decode_sizes(*p, a), "state_pool and state_pool_bf16 are both given"));
  a.state_pool_bf16 = dev<uint16_t>(40 * per_slot - 2);
  a.state_pool = {};
  EXPECT_TRUE(has(cuda::check_decode_sizes(*p, a), "state_pool_bf16 has"));
  a.state_pool_bf16 = {};
  a.state_pool = dev<float>(40 * per_slot);
  a.in.cu_seqlens = dev<const int64_t>(2);
  EXPECT_TRUE(has(cuda::check_decode_sizes(*p, a), "decode: cu_seqlens and initial_state must be empty"));
  a.in.cu_seqlens = {};

  kda::VerifyArgs v;
  v.in = a.in;
  v.in.cu_seqlens = {};
  v.draft_tokens = 4;
  v.state_pool = dev<float>(40 * per_slot);
  v.state_indices = dev<const int32_t>(12);
  v.num_accepted = dev<const int32_t>(3);
  v.o = t.out.o;
  EXPECT_TRUE(cuda::check_verify_sizes(*p, v).is_ok());
  v.num_accepted = dev<const int32_t>(4);
  EXPECT_TRUE(has(cuda::check_verify_sizes(*p, v), "num_accepted has 4 entries, expected N = 3"));
  v.num_accepted = dev<const int32_t>(3);
  for (int64_t bad : {int64_t{0}, int64_t{5}, cuda::kKdaMaxDraftTokens + 1}) {
    v.draft_tokens = bad;
    EXPECT_TRUE(has(cuda::check_verify_sizes(*p, v), "draft_tokens = " + std::to_string(bad))) << bad;
  }
  // 12 tokens of 1 draft token each: 12 sequences <= 16.
  v.draft_tokens = 1;
  v.num_accepted = dev<const int32_t>(12);
  EXPECT_TRUE(cuda::check_verify_sizes(*p, v).is_ok());
  auto small = cuda::plan(c, opts(11));
  ASSERT_TRUE(small.is_ok());
  EXPECT_TRUE(has(cuda::check_verify_sizes(*small, v), "12 sequences, more than the plan's max_seqs = 11"));
  EXPECT_TRUE(has(cuda::check_decode_sizes(*small, a), "12 sequences, more than the plan's max_seqs = 11"));
}

TEST(CudaKdaPlan, StatusBitsHaveNames) {
  EXPECT_EQ(cuda::kda_status_string(0), "ok");
  EXPECT_EQ(cuda::kda_status_string(cuda::kKdaBadSeqlens), "bad cu_seqlens");
  EXPECT_EQ(cuda::kda_status_string(cuda::kKdaDuplicateSlot | cuda::kKdaBadAccepted),
            "state slot written twice, num_accepted outside [1, T]");
  EXPECT_NE(cuda::kda_status_string(cuda::kKdaSlotOutOfRange | 64u).find("unknown bits 64"), std::string::npos);
}

}  // namespace
}  // namespace k3
