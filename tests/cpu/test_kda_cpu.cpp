// KDA CPU backend: recurrent and chunked prefill, decode and verify against the references, on
// every SIMD level this CPU has; determinism over runs and thread counts; error paths.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "k3/harness/kda_case.hpp"
#include "k3/cpu_kda.hpp"
#include "k3/kda.hpp"
#include "scoped_env.hpp"

namespace k3::kda {
namespace {

std::vector<IsaLevel> levels() {
  std::vector<IsaLevel> l;
  for (int i = 0; i <= static_cast<int>(best_isa_level()); ++i) l.push_back(static_cast<IsaLevel>(i));
  return l;
}


KdaConfig cfg(int64_t h, int64_t k, int64_t v, GateMode gate, StateLayout layout = StateLayout::kKFirst) {
  KdaConfig c;
  c.num_heads = h;
  c.head_k = k;
  c.head_v = v;
  c.gate = gate;
  c.layout = layout;
  return c;
}

struct Result2 {
  std::vector<float> o, f;
};

Result2 run_cpu(const KdaCase& c, const cpu::KdaOptions& o) {
  Result2 r{std::vector<float>(c.o_size()), std::vector<float>(c.state_size())};
  const Status st = cpu::prefill(c.spec.cfg, c.inputs(), {r.o, r.f}, o);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return r;
}

Result2 run_ref32(const KdaCase& c) {
  Result2 r{std::vector<float>(c.o_size()), std::vector<float>(c.state_size())};
  EXPECT_TRUE(reference_fp32(c.spec.cfg, c.inputs(), {r.o, r.f}).is_ok());
  return r;
}

// Every gate, layout, dtype and both algorithms on odd shapes, with resets and varlen, on every
// SIMD level; against the FP32 reference.
TEST(KdaCpu, PrefillMatchesReferenceOnEveryLevel) {
  struct Shape { int64_t h, k, v; std::vector<int64_t> lens; std::vector<int64_t> resets; };
  const Shape shapes[] = {{3, 60, 100, {63}, {}}, {2, 32, 48, {15, 40, 0, 17}, {20, 21}}, {1, 100, 20, {37}, {5, 36}}};
  for (const auto& sh : shapes) {
    for (GateMode gate : {GateMode::kLogDecay, GateMode::kSafe, GateMode::kSoftplus}) {
      for (StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst}) {
        for (bool bf16 : {true, false}) {
          CaseSpec s;
          s.cfg = cfg(sh.h, sh.k, sh.v, gate, layout);
          s.seqlens = sh.lens;
          s.resets = sh.resets;
          s.bf16 = bf16;
          s.seed = 7 + sh.k;
          const KdaCase c = make_case(s);
          const Result2 ref = run_ref32(c);
          for (IsaLevel isa : levels()) {
            for (Algorithm algo : {Algorithm::kRecurrent, Algorithm::kChunked}) {
              const Result2 out = run_cpu(c, cpu_options_at(isa, algo));
              const auto eo = compare(out.o, ref.o), ef = compare(out.f, ref.f);
              const std::string what = std::string(isa_level_name(isa)) + " " + algorithm_name(algo) + " " +
                                       gate_mode_name(gate) + " " + state_layout_name(layout) +
                                       (bf16 ? " bf16 K=" : " fp32 K=") + std::to_string(sh.k);
              EXPECT_LT(eo.err_ratio, 2e-5) << what;
              EXPECT_LT(ef.err_ratio, 2e-5) << what;
            }
          }
        }
      }
    }
  }
}

TEST(KdaCpu, ChunkedHandlesHardResetsInsideChunksAndStrongDecay) {
  // Resets at chunk starts, ends and middles; log decays of -1000 with a strong gate elsewhere.
  CaseSpec s;
  s.cfg = cfg(2, 128, 128, GateMode::kLogDecay);
  s.seqlens = {100};
  s.resets = {0, 15, 16, 40, 99};
  KdaCase c = make_case(s);
  for (size_t i = 60 * 2 * 128; i < 80 * 2 * 128; ++i) c.g[i] = -30.0f;  // span far above 60 per chunk
  const Result2 ref = run_ref32(c);
  for (IsaLevel isa : levels()) {
    const Result2 out = run_cpu(c, cpu_options_at(isa, Algorithm::kChunked));
    EXPECT_LT(compare(out.o, ref.o).err_ratio, 2e-5) << isa_level_name(isa);
    EXPECT_LT(compare(out.f, ref.f).err_ratio, 2e-5) << isa_level_name(isa);
  }
}

TEST(KdaCpu, BitIdenticalAcrossRunsAndThreadCounts) {
  CaseSpec s;
  s.cfg = cfg(5, 64, 32, GateMode::kSafe, StateLayout::kVFirst);
  s.seqlens = {70, 9, 33};
  const KdaCase c = make_case(s);
  for (IsaLevel isa : levels()) {
    for (Algorithm algo : {Algorithm::kRecurrent, Algorithm::kChunked, Algorithm::kAuto}) {
      const Result2 base = run_cpu(c, cpu_options_at(isa, algo, 1));
      for (int threads : {1, 2, 3}) {
        const Result2 r = run_cpu(c, cpu_options_at(isa, algo, threads));
        EXPECT_EQ(r.o, base.o) << isa_level_name(isa) << " threads " << threads;
        EXPECT_EQ(r.f, base.f) << isa_level_name(isa) << " threads " << threads;
      }
    }
  }
}

// Chunks above the factorized span bound (60) take the recursive split: decays of -4.5 per token
// (chunk span 72, halves within the bound), -9 (quarters), -20 and -45 (down to pairs), with
// per-channel variation; against the FP32 reference with the same bound as every other case.
TEST(KdaCpu, StrongDecayChunksSplitRecursivelyAndStayAccurate) {
  for (float decay : {-4.5f, -9.0f, -20.0f, -45.0f}) {
    CaseSpec s;
    s.cfg = cfg(2, 64, 48, GateMode::kLogDecay);
    s.seqlens = {53};
    KdaCase c = make_case(s);
    for (size_t i = 0; i < c.g.size(); ++i) c.g[i] = decay * (0.75f + 0.5f * static_cast<float>((i * 7919) % 101) / 100.0f);
    const Result2 ref = run_ref32(c);
    for (IsaLevel isa : levels()) {
      const Result2 out = run_cpu(c, cpu_options_at(isa, Algorithm::kChunked));
      EXPECT_LT(compare(out.o, ref.o).err_ratio, 2e-5) << isa_level_name(isa) << " decay " << decay;
      EXPECT_LT(compare(out.f, ref.f).err_ratio, 2e-5) << isa_level_name(isa) << " decay " << decay;
    }
  }
}

// A chunked prefill runs chunk-major over groups of heads when there are at least as many heads
// as threads, head by head otherwise: both give the same bits (H = 2 with 3 threads takes the
// head-by-head path, H = 9 splits into uneven head ranges and a partial group of 4).
TEST(KdaCpu, ChunkMajorAndHeadByHeadPrefillGiveTheSameBits) {
  for (int64_t heads : {2, 9}) {
    CaseSpec s;
    s.cfg = cfg(heads, 32, 48, GateMode::kSafe);
    s.seqlens = {40, 3, 17};
    const KdaCase c = make_case(s);
    for (IsaLevel isa : levels()) {
      const Result2 base = run_cpu(c, cpu_options_at(isa, Algorithm::kChunked, 1));
      for (int threads : {2, 3, 4}) {
        const Result2 r = run_cpu(c, cpu_options_at(isa, Algorithm::kChunked, threads));
        EXPECT_EQ(r.o, base.o) << isa_level_name(isa) << " H " << heads << " threads " << threads;
        EXPECT_EQ(r.f, base.f) << isa_level_name(isa) << " H " << heads << " threads " << threads;
      }
    }
  }
}

TEST(KdaCpu, AutoPicksChunkedFromTheThresholdOn) {
  CaseSpec s;
  s.cfg = cfg(2, 32, 32, GateMode::kLogDecay);
  s.seqlens = {10, 30};
  const KdaCase c = make_case(s);
  cpu::KdaOptions o = cpu_options_at(best_isa_level(), Algorithm::kAuto);
  o.chunk_min_tokens = 20;
  const Result2 a = run_cpu(c, o);
  const Result2 rec = run_cpu(c, cpu_options_at(best_isa_level(), Algorithm::kRecurrent));
  const Result2 chk = run_cpu(c, cpu_options_at(best_isa_level(), Algorithm::kChunked));
  const int64_t split = 10 * 2 * 32;  // o elements of the first sequence
  EXPECT_TRUE(std::equal(a.o.begin(), a.o.begin() + split, rec.o.begin()));
  EXPECT_TRUE(std::equal(a.o.begin() + split, a.o.end(), chk.o.begin() + split));
  EXPECT_FALSE(std::equal(rec.o.begin() + split, rec.o.end(), chk.o.begin() + split));  // the two paths round differently
}

TEST(KdaCpu, WithoutInitialStateOrFinalStateOrL2Norm) {
  CaseSpec s;
  s.cfg = cfg(2, 24, 40, GateMode::kLogDecay);
  s.cfg.l2norm_qk = false;
  s.cfg.beta_logits = false;
  s.cfg.scale = 0.5f;
  s.seqlens = {33};
  s.initial_state = false;
  s.bf16 = false;
  KdaCase c = make_case(s);
  for (auto& x : c.q32) x *= 0.2f;  // unnormalized inputs of a moderate size
  for (auto& x : c.k32) x *= 0.2f;
  for (auto& b : c.beta) b = 0.5f + 0.4f * std::tanh(b);
  const Result2 ref = run_ref32(c);
  for (Algorithm algo : {Algorithm::kRecurrent, Algorithm::kChunked}) {
    std::vector<float> o(c.o_size());
    ASSERT_TRUE(cpu::prefill(c.spec.cfg, c.inputs(), {o, {}}, cpu_options_at(best_isa_level(), algo)).is_ok());
    EXPECT_LT(compare(o, ref.o).err_ratio, 2e-5) << algorithm_name(algo);
  }
}

// ---- decode and verify -----------------------------------------------------------------------
struct Pool {
  std::vector<float> states;
  int64_t slots;
};

Pool make_pool(const KdaConfig& c, int64_t slots, uint64_t seed) {
  CaseSpec s;
  s.cfg = c;
  s.seqlens = std::vector<int64_t>(static_cast<size_t>(slots), 0);
  s.seed = seed;
  return {make_case(s).initial_state, slots};
}

// The tokens [n T, n T + t] of sequence n from `state` (one slot), by the FP32 reference.
Result2 ref_from_state(const KdaCase& c, int64_t first, int64_t count, const float* state) {
  const KdaConfig& k = c.spec.cfg;
  const int64_t H = k.num_heads, K = k.head_k, V = k.head_v;
  KdaInputs in = c.inputs();
  auto cut = [&](ActSpan a, int64_t d) {
    if (a.is_bf16()) a.bf16 = a.bf16.subspan(first * H * d, count * H * d);
    else a.f32 = a.f32.subspan(first * H * d, count * H * d);
    return a;
  };
  in.q = cut(in.q, K);
  in.k = cut(in.k, K);
  in.v = cut(in.v, V);
  in.g = in.g.subspan(first * H * K, count * H * K);
  in.beta = in.beta.subspan(first * H, count * H);
  in.initial_state = {state, static_cast<size_t>(H * K * V)};
  Result2 r{std::vector<float>(count * H * V), std::vector<float>(H * K * V)};
  EXPECT_TRUE(reference_fp32(k, in, {r.o, r.f}).is_ok());
  return r;
}

TEST(KdaCpu, DecodeUpdatesNamedSlotsInPlaceAndNothingElse) {
  for (IsaLevel isa : levels()) {
    for (StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst}) {
      for (int64_t v : {int64_t{32}, int64_t{20}}) {  // 32: in place in the pool (K-first); 20: staged
        const KdaConfig k = cfg(3, 16, v, GateMode::kSafe, layout);
        CaseSpec s;
        s.cfg = k;
        s.seqlens = {4};  // 4 decode rows = 4 tokens
        s.initial_state = false;
        const KdaCase c = make_case(s);
        Pool pool = make_pool(k, 7, 5);
        const Pool before = pool;
        const std::vector<int32_t> idx = {5, -1, 0, 2};
        std::vector<float> o(c.o_size(), 7.0f);
        DecodeArgs a{c.inputs(), pool.states, idx, o};
        ASSERT_TRUE(cpu::decode(k, a, cpu_options_at(isa, Algorithm::kAuto)).is_ok());
        const int64_t block = 3 * 16 * v;
        for (int64_t slot = 0; slot < 7; ++slot) {
          const auto row = [&](const Pool& p) {
            return std::vector<float>(p.states.begin() + slot * block, p.states.begin() + (slot + 1) * block);
          };
          int64_t n = -1;
          for (int64_t i = 0; i < 4; ++i) n = idx[i] == slot ? i : n;
          if (n < 0) {
            EXPECT_EQ(row(pool), row(before)) << "slot " << slot << " was not named";
            continue;
          }
          const Result2 ref = ref_from_state(c, n, 1, before.states.data() + slot * block);
          EXPECT_LT(compare(row(pool), ref.f).err_ratio, 2e-6) << isa_level_name(isa) << " slot " << slot;
          const std::vector<float> on(o.begin() + n * 3 * v, o.begin() + (n + 1) * 3 * v);
          EXPECT_LT(compare(on, ref.o).err_ratio, 2e-6) << isa_level_name(isa) << " row " << n;
        }
        for (int64_t j = 3 * v; j < 6 * v; ++j) EXPECT_EQ(o[j], 0.0f) << "padding row";
      }
    }
  }
}

TEST(KdaCpu, VerifyWritesEveryPrefixStateToItsSlot) {
  const int64_t T = 4;
  for (IsaLevel isa : levels()) {
    for (StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst}) {
      const KdaConfig k = cfg(2, 24, 40, GateMode::kSoftplus, layout);
      CaseSpec s;
      s.cfg = k;
      s.seqlens = {3 * T};
      s.initial_state = false;
      s.bf16 = false;
      const KdaCase c = make_case(s);
      Pool pool = make_pool(k, 14, 9);
      const Pool before = pool;
      // Sequence 0 continues from its 3rd slot (which it overwrites later), sequence 1 from its
      // 1st, sequence 2 is padding; slot 13 belongs to nobody; sequence 1 does not keep token 2.
      const std::vector<int32_t> idx = {0, 1, 2, 3, 4, 5, -1, 6, -1, -1, -1, -1};
      const std::vector<int32_t> acc = {3, 1, 2};
      std::vector<float> o(c.o_size(), 7.0f);
      VerifyArgs a{c.inputs(), T, pool.states, idx, acc, o};
      const Status st = cpu::verify(k, a, cpu_options_at(isa, Algorithm::kAuto, 3));
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      const int64_t block = 2 * 24 * 40, hv = 2 * 40;
      auto slot_of = [&](const Pool& p, int64_t slot) {
        return std::vector<float>(p.states.begin() + slot * block, p.states.begin() + (slot + 1) * block);
      };
      for (int64_t n = 0; n < 2; ++n) {
        const int64_t read = idx[n * T + acc[n] - 1];
        for (int64_t t = 0; t < T; ++t) {
          const Result2 ref = ref_from_state(c, n * T, t + 1, before.states.data() + read * block);
          const std::vector<float> ot(o.begin() + (n * T + t) * hv, o.begin() + (n * T + t + 1) * hv);
          const std::vector<float> rt(ref.o.end() - hv, ref.o.end());
          EXPECT_LT(compare(ot, rt).err_ratio, 2e-6) << isa_level_name(isa) << " n " << n << " t " << t;
          if (idx[n * T + t] >= 0) {
            EXPECT_LT(compare(slot_of(pool, idx[n * T + t]), ref.f).err_ratio, 2e-6) << "n " << n << " t " << t;
          }
        }
      }
      for (int64_t slot : {7, 8, 9, 10, 11, 12, 13}) EXPECT_EQ(slot_of(pool, slot), slot_of(before, slot)) << slot;
      for (int64_t j = 2 * T * hv; j < 3 * T * hv; ++j) ASSERT_EQ(o[j], 0.0f) << "padding sequence";
    }
  }
}

TEST(KdaCpu, DecodeAndVerifyAreBitIdenticalAcrossThreadCounts) {
  const KdaConfig k = cfg(4, 32, 32, GateMode::kSafe);
  CaseSpec s;
  s.cfg = k;
  s.seqlens = {6};
  s.initial_state = false;
  const KdaCase c = make_case(s);
  const Pool pool0 = make_pool(k, 8, 3);
  std::vector<float> base_pool, base_o;
  for (int threads : {1, 2, 3}) {
    Pool pool = pool0;
    std::vector<float> o(c.o_size());
    const std::vector<int32_t> idx = {7, 1, 3, 0, 2, 5};
    DecodeArgs a{c.inputs(), pool.states, idx, o};
    ASSERT_TRUE(cpu::decode(k, a, cpu_options_at(best_isa_level(), Algorithm::kAuto, threads)).is_ok());
    const std::vector<int32_t> vidx = {4, 6, 1, 3, 7, 0};
    const std::vector<int32_t> acc = {2, 3};
    VerifyArgs v{c.inputs(), 3, pool.states, vidx, acc, o};
    ASSERT_TRUE(cpu::verify(k, v, cpu_options_at(best_isa_level(), Algorithm::kAuto, threads)).is_ok());
    if (threads == 1) {
      base_pool = pool.states;
      base_o = o;
    } else {
      EXPECT_EQ(pool.states, base_pool) << threads;
      EXPECT_EQ(o, base_o) << threads;
    }
  }
}

// ---- errors ------------------------------------------------------------------------------------
TEST(KdaCpu, PoolErrorsNameTheProblem) {
  const KdaConfig k = cfg(2, 16, 16, GateMode::kLogDecay);
  CaseSpec s;
  s.cfg = k;
  s.seqlens = {4};
  s.initial_state = false;
  const KdaCase c = make_case(s);
  Pool pool = make_pool(k, 5, 1);
  std::vector<float> o(c.o_size());
  auto dec = [&](std::vector<int32_t> idx, std::span<float> states) {
    return cpu::decode(k, DecodeArgs{c.inputs(), states, idx, o}, cpu_options_at(best_isa_level(), Algorithm::kAuto)).message();
  };
  EXPECT_NE(dec({0, 1, 2, 5}, pool.states).find("state_indices[3] = 5 is past the pool's 5 slots"), std::string::npos);
  EXPECT_NE(dec({0, 1, 1, 3}, pool.states).find("state_indices: state slot 1 is written twice"), std::string::npos);
  EXPECT_NE(dec({0, 1, 2}, pool.states).find("state_indices has 3 entries, expected N = 4"), std::string::npos);
  EXPECT_NE(dec({0, 1, 2, 3}, std::span<float>(pool.states).first(100)).find("state_pool has 100 elements"),
            std::string::npos);
  KdaInputs bad = c.inputs();
  const std::vector<int64_t> cu = {0, 4};
  bad.cu_seqlens = cu;
  const std::vector<int32_t> idx4 = {0, 1, 2, 3};
  EXPECT_NE(cpu::decode(k, DecodeArgs{bad, pool.states, idx4, o}).message().find("cu_seqlens and initial_state must be empty"),
            std::string::npos);

  auto ver = [&](std::vector<int32_t> idx, std::vector<int32_t> acc, int64_t t) {
    return cpu::verify(k, VerifyArgs{c.inputs(), t, pool.states, idx, acc, o}).message();
  };
  EXPECT_NE(ver({0, 1, 2, 3}, {3, 1}, 2).find("num_accepted[0] = 3 must be in [1, T = 2]"), std::string::npos);
  EXPECT_NE(ver({0, 1, 2, 3}, {0, 1}, 2).find("num_accepted[0] = 0"), std::string::npos);
  EXPECT_NE(ver({0, 1, 2, 3}, {1, 1}, 3).find("draft_tokens = 3 must be >= 1 and divide the token count 4"),
            std::string::npos);
  EXPECT_NE(ver({0, 1, 2, 3}, {1}, 2).find("num_accepted has 1 entries"), std::string::npos);
  EXPECT_NE(ver({0, 1, 2}, {1, 1}, 2).find("state_indices has 3 entries, expected N * T = 4"), std::string::npos);
  EXPECT_NE(ver({0, 1, 9, 3}, {1, 1}, 2).find("state_indices[1, 0] = 9 is past"), std::string::npos);
  EXPECT_NE(ver({0, 1, 1, 3}, {1, 1}, 2).find("state_indices: state slot 1 is written twice"), std::string::npos);

  // BF16 state storage is a cuda-backend option: refused by name, nothing touched.
  std::vector<uint16_t> pool16(pool.states.size(), 0x3f80);
  const std::vector<uint16_t> pool16_before = pool16;
  const std::vector<float> o_before = o;
  DecodeArgs d16{c.inputs(), {}, idx4, o};
  d16.state_pool_bf16 = pool16;
  Status st = cpu::decode(k, d16);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("state_pool_bf16: BF16 state storage is an option of the cuda backend"), std::string::npos)
      << st.message();
  const std::vector<int32_t> acc = {1, 1};
  VerifyArgs v16{c.inputs(), 2, {}, idx4, acc, o};
  v16.state_pool_bf16 = pool16;
  EXPECT_EQ(cpu::verify(k, v16).code(), StatusCode::kUnsupported);
  EXPECT_EQ(pool16, pool16_before);
  EXPECT_EQ(o, o_before);
  d16.state_pool = pool.states;  // both pools
  EXPECT_EQ(kda::check_decode_args(k, d16, /*bf16_pool_ok=*/true).status().message(),
            "state_pool and state_pool_bf16 are both given: pass exactly one");
}

TEST(KdaCpu, PlanAndWorkspaceErrors) {
  const KdaConfig k = cfg(2, 16, 16, GateMode::kLogDecay);
  cpu::KdaOptions o;
  o.threads = -1;
  EXPECT_NE(cpu::plan(k, o).status().message().find("threads = -1"), std::string::npos);
  o = {};
  o.chunk_min_tokens = 0;
  EXPECT_NE(cpu::plan(k, o).status().message().find("chunk_min_tokens = 0"), std::string::npos);
  auto plan = cpu::plan(k, cpu_options_at(best_isa_level(), Algorithm::kAuto, 2));
  ASSERT_TRUE(plan.is_ok());
  CaseSpec s;
  s.cfg = k;
  s.seqlens = {5};
  const KdaCase c = make_case(s);
  std::vector<float> out(c.o_size());
  std::vector<uint8_t> ws(plan->workspace_bytes - 1);
  const Status st = cpu::prefill(plan.value(), c.inputs(), {out, {}}, ws);
  EXPECT_NE(st.message().find("workspace has"), std::string::npos) << st.message();
  cpu::KdaPlan forged = plan.value();
  forged.workspace_bytes = 1;
  std::vector<uint8_t> ws_big(plan->workspace_bytes);
  EXPECT_NE(cpu::prefill(forged, c.inputs(), {out, {}}, ws_big).message().find("is below"), std::string::npos);
}

// The workspace is bytes of any alignment (the backend aligns inside it); the plan prints itself.
TEST(KdaCpu, WorkspaceOfAnyAlignmentGivesTheSameBits) {
  const KdaConfig k = cfg(2, 32, 16, GateMode::kSafe);
  auto plan = cpu::plan(k, cpu_options_at(best_isa_level(), Algorithm::kChunked, 2));
  ASSERT_TRUE(plan.is_ok());
  const std::string d = plan->describe();
  EXPECT_NE(d.find("H 2, K 32, V 16"), std::string::npos) << d;
  EXPECT_NE(d.find("algorithm chunked"), std::string::npos) << d;
  EXPECT_NE(d.find("workspace " + std::to_string(plan->workspace_bytes) + " B"), std::string::npos) << d;
  CaseSpec s;
  s.cfg = k;
  s.seqlens = {40, 7};
  const KdaCase c = make_case(s);
  std::vector<uint8_t> ws(static_cast<size_t>(plan->workspace_bytes) + 8);
  std::vector<float> want(c.o_size()), got(c.o_size());
  ASSERT_TRUE(cpu::prefill(plan.value(), c.inputs(), {want, {}}, std::span<uint8_t>(ws).first(plan->workspace_bytes)).is_ok());
  for (size_t off = 1; off < 8; ++off) {
    std::fill(ws.begin(), ws.end(), uint8_t{0xFF});  // NaN garbage: nothing may read it before writing
    const std::span<uint8_t> shifted = std::span<uint8_t>(ws).subspan(off, static_cast<size_t>(plan->workspace_bytes));
    ASSERT_TRUE(cpu::prefill(plan.value(), c.inputs(), {got, {}}, shifted).is_ok());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << "offset " << off;
  }
}

// The library reads no environment: cpu::plan's defaults are hardware facts (the `k3` tool
// passes K3_ISA / K3_NUM_THREADS in explicitly).
TEST(KdaCpu, PlanDefaultsAreHardwareFactsNotTheEnvironment) {
  test::ScopedEnv isa("K3_ISA", "avx9000");
  test::ScopedEnv k3_threads("K3_NUM_THREADS", "3");
  const KdaConfig k = cfg(1, 8, 8, GateMode::kLogDecay);
  auto p = cpu::plan(k);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->isa, best_isa_level());
  EXPECT_EQ(p->threads, std::min(hardware_thread_count(), cpu::kKdaMaxThreads));
  test::ScopedEnv scalar("K3_ISA", "scalar");
  p = cpu::plan(k);
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(p->isa, best_isa_level());
  cpu::KdaOptions o;
  o.isa = IsaLevel::kScalar;
  o.threads = 3;
  p = cpu::plan(k, o);
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(p->isa, IsaLevel::kScalar);
  EXPECT_EQ(p->threads, 3);
}

}  // namespace
}  // namespace k3::kda
