// KDA speculative verify without snapshots: verify_replay + commit against decode run token by
// token (bit for bit), on every SIMD level and several thread counts; the fold-order guard; the
// refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "k3/harness/kda_case.hpp"
#include "cpu/kda/kernels.hpp"
#include "k3/cpu_kda.hpp"
#include "k3/formats.hpp"
#include "k3/kda.hpp"

namespace k3::kda {
namespace {

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// One random replay problem: N sequences of draft tokens (varlen, each in [1, Tw]) over a pool of
// `slots` states; sequence n runs from slot idx[n] (< 0: padding) and accepts acc[n] tokens.
struct Replay {
  KdaCase c;  // the draft tokens (c.cu_seqlens) and, as c.initial_state, the pool's states
  int64_t tw = 1, slots = 0;
  std::vector<int32_t> idx, acc;
  std::vector<float> pool;
};

Replay make_replay(uint64_t seed, std::mt19937_64& rng) {
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  Replay r;
  CaseSpec s;
  const int64_t ks[] = {16, 20, 32, 64}, vs[] = {16, 24, 32, 48};
  s.cfg.num_heads = pick(1, 3);
  s.cfg.head_k = ks[pick(0, 3)];
  s.cfg.head_v = vs[pick(0, 3)];
  s.cfg.gate = static_cast<GateMode>(pick(0, 2));
  s.cfg.layout = pick(0, 1) == 0 ? StateLayout::kKFirst : StateLayout::kVFirst;
  s.cfg.l2norm_qk = pick(0, 7) != 0;
  s.bf16 = pick(0, 1) == 0;
  s.varlen = true;
  s.seed = seed;
  r.tw = pick(1, 6);
  const int64_t n = pick(0, 9) == 0 ? 64 : pick(1, 12);
  s.seqlens.clear();
  for (int64_t i = 0; i < n; ++i) s.seqlens.push_back(pick(1, r.tw));
  r.c = make_case(s);
  // Non-finite inputs in a quarter of the cases (docs/kda.md, "Non-finite values").
  if (pick(0, 3) == 0) {
    const float bad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                         -std::numeric_limits<float>::infinity()};
    for (int hits = 0; hits < 3; ++hits) {
      const float x = bad[pick(0, 2)];
      switch (pick(0, 4)) {
        case 0: if (s.bf16) r.c.q16[pick(0, r.c.q16.size() - 1)] = bf16_from_f32(x); else r.c.q32[pick(0, r.c.q32.size() - 1)] = x; break;
        case 1: if (s.bf16) r.c.k16[pick(0, r.c.k16.size() - 1)] = bf16_from_f32(x); else r.c.k32[pick(0, r.c.k32.size() - 1)] = x; break;
        case 2: if (s.bf16) r.c.v16[pick(0, r.c.v16.size() - 1)] = bf16_from_f32(x); else r.c.v32[pick(0, r.c.v32.size() - 1)] = x; break;
        case 3: r.c.g[pick(0, r.c.g.size() - 1)] = x; break;
        default: r.c.beta[pick(0, r.c.beta.size() - 1)] = x; break;
      }
    }
  }
  // The pool: the case's N initial states plus a few spare slots; sequences get shuffled slots.
  const int64_t block = s.cfg.num_heads * s.cfg.head_k * s.cfg.head_v;
  r.slots = n + pick(0, 3);
  r.pool.assign(r.slots * block, 0.5f);
  std::copy(r.c.initial_state.begin(), r.c.initial_state.end(), r.pool.begin());
  std::vector<int32_t> perm(r.slots);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int64_t i = 0; i < n; ++i) {
    r.idx.push_back(pick(0, 7) == 0 ? -1 : perm[i]);
    r.acc.push_back(static_cast<int32_t>(pick(0, r.c.cu_seqlens[i + 1] - r.c.cu_seqlens[i])));
  }
  return r;
}

// Rows [first, first + 1) of every per-token tensor of `in`, gathered for a decode step.
struct StepInputs {
  std::vector<uint16_t> q16, k16, v16;
  std::vector<float> q32, k32, v32, g, beta;
  KdaInputs view(const KdaInputs& base) const {
    KdaInputs in = base;
    in.cu_seqlens = {};
    in.initial_state = {};
    in.q = base.q.is_bf16() ? ActSpan::of(std::span<const uint16_t>(q16)) : ActSpan::of(std::span<const float>(q32));
    in.k = base.k.is_bf16() ? ActSpan::of(std::span<const uint16_t>(k16)) : ActSpan::of(std::span<const float>(k32));
    in.v = base.v.is_bf16() ? ActSpan::of(std::span<const uint16_t>(v16)) : ActSpan::of(std::span<const float>(v32));
    in.g = g;
    in.beta = beta;
    return in;
  }
};

void append_row(const ActSpan& a, int64_t t, int64_t width, std::vector<uint16_t>& b, std::vector<float>& f) {
  if (a.is_bf16()) {
    b.insert(b.end(), a.bf16.begin() + t * width, a.bf16.begin() + (t + 1) * width);
  } else {
    f.insert(f.end(), a.f32.begin() + t * width, a.f32.begin() + (t + 1) * width);
  }
}

// What decode gives, token by token: the outputs of every draft token, and each sequence's slot
// state after its first acc[n] tokens (the pool after all steps for the other slots).
struct Expected {
  std::vector<float> o, pool;
};

Expected decode_token_by_token(const Replay& r, const cpu::KdaOptions& opt) {
  const KdaConfig& cfg = r.c.spec.cfg;
  const int64_t H = cfg.num_heads, K = cfg.head_k, V = cfg.head_v, block = H * K * V;
  const int64_t n = static_cast<int64_t>(r.idx.size());
  const KdaInputs in = r.c.inputs();
  Expected e{std::vector<float>(r.c.num_tokens * H * V, 0.0f), r.pool};
  std::vector<float> run = r.pool;  // every draft token runs here; the accepted prefix is saved into e.pool
  for (int64_t t = 0; t <= r.tw; ++t) {
    for (int64_t i = 0; i < n; ++i) {
      if (r.idx[i] >= 0 && r.acc[i] == t) {
        std::copy(run.begin() + r.idx[i] * block, run.begin() + (r.idx[i] + 1) * block, e.pool.begin() + r.idx[i] * block);
      }
    }
    if (t == r.tw) break;
    StepInputs st;
    std::vector<int32_t> step_idx;
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t tok = r.c.cu_seqlens[i] + t;
      if (tok >= r.c.cu_seqlens[i + 1]) continue;
      append_row(in.q, tok, H * K, st.q16, st.q32);
      append_row(in.k, tok, H * K, st.k16, st.k32);
      append_row(in.v, tok, H * V, st.v16, st.v32);
      st.g.insert(st.g.end(), in.g.begin() + tok * H * K, in.g.begin() + (tok + 1) * H * K);
      st.beta.insert(st.beta.end(), in.beta.begin() + tok * H, in.beta.begin() + (tok + 1) * H);
      step_idx.push_back(r.idx[i]);
      rows.push_back(tok);
    }
    if (rows.empty()) continue;
    std::vector<float> o(rows.size() * H * V);
    DecodeArgs d{st.view(in), run, step_idx, o};
    const Status s = cpu::decode(cfg, d, opt);
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    for (size_t j = 0; j < rows.size(); ++j) {
      std::copy(o.begin() + j * H * V, o.begin() + (j + 1) * H * V, e.o.begin() + rows[j] * H * V);
    }
  }
  return e;
}

std::vector<IsaLevel> levels() {
  std::vector<IsaLevel> l;
  for (int i = 0; i <= static_cast<int>(best_isa_level()); ++i) l.push_back(static_cast<IsaLevel>(i));
  return l;
}

// >= 1000 random cases: every gate, both layouts, BF16 and FP32 inputs, varlen windows of 1..6
// tokens, num_accepted 0..len, 1..64 requests, padding rows, non-finite inputs; every SIMD level
// and 1..3 threads in turn. verify_replay's outputs and commit's states are decode's, bit for bit;
// the state pool is not written by verify_replay.
TEST(KdaReplay, CommitEqualsDecodeTokenByTokenBitForBit) {
  std::mt19937_64 rng(2026);
  const auto isas = levels();
  int cases = 0, accepted_tokens = 0, nonfinite_states = 0;
  for (uint64_t seed = 1; seed <= 1000; ++seed) {
    Replay r = make_replay(seed, rng);
    const KdaConfig& cfg = r.c.spec.cfg;
    const cpu::KdaOptions opt = cpu_options_at(isas[seed % isas.size()], Algorithm::kAuto, 1 + static_cast<int>(seed % 3));
    const Expected e = decode_token_by_token(r, opt);
    const int64_t per = replay_window_floats(cfg, r.tw).value();
    std::vector<float> window(r.slots * per, 0.0f), o(r.c.o_size(), -1.0f);
    const std::vector<float> before = r.pool;
    const std::string what = "seed " + std::to_string(seed) + " isa " + isa_level_name(*opt.isa) + " threads " +
                             std::to_string(opt.threads) + " gate " + gate_mode_name(cfg.gate) + " " +
                             state_layout_name(cfg.layout) + " K " + std::to_string(cfg.head_k) + " V " +
                             std::to_string(cfg.head_v) + " N " + std::to_string(r.idx.size()) + " Tw " +
                             std::to_string(r.tw);
    ReplayVerifyArgs va{r.c.inputs(), r.tw, r.pool, r.idx, window, o};
    va.in.initial_state = {};
    Status st = cpu::verify_replay(cfg, va, opt);
    ASSERT_TRUE(st.is_ok()) << what << ": " << st.to_string();
    ASSERT_TRUE(same_bits(r.pool, before)) << what << ": verify_replay wrote the state pool";
    // Padding sequences get zero rows; every other row is decode's.
    std::vector<float> want_o = e.o;
    for (size_t i = 0; i < r.idx.size(); ++i) {
      if (r.idx[i] >= 0) continue;
      const int64_t row = cfg.num_heads * cfg.head_v;
      std::fill(want_o.begin() + r.c.cu_seqlens[i] * row, want_o.begin() + r.c.cu_seqlens[i + 1] * row, 0.0f);
    }
    ASSERT_TRUE(same_bits(o, want_o)) << what << ": outputs differ from decode";
    CommitArgs ca{r.tw, r.pool, window, r.idx, r.acc};
    st = cpu::commit(cfg, ca, opt);
    ASSERT_TRUE(st.is_ok()) << what << ": " << st.to_string();
    // Padding rows' slots are not touched: e.pool keeps them as they were, as does commit.
    std::vector<float> want_pool = e.pool;
    const int64_t block = cfg.num_heads * cfg.head_k * cfg.head_v;
    for (int64_t s = 0; s < r.slots; ++s) {
      if (std::find(r.idx.begin(), r.idx.end(), s) == r.idx.end()) {
        std::copy(before.begin() + s * block, before.begin() + (s + 1) * block, want_pool.begin() + s * block);
      }
    }
    ASSERT_TRUE(same_bits(r.pool, want_pool)) << what << ": committed states differ from decode";
    for (auto a : r.acc) accepted_tokens += a;
    nonfinite_states += std::any_of(r.pool.begin(), r.pool.end(), [](float x) { return !std::isfinite(x); });
    ++cases;
  }
  EXPECT_EQ(cases, 1000);
  EXPECT_GT(accepted_tokens, 3000);
  EXPECT_GT(nonfinite_states, 20) << "the non-finite policy was exercised in too few cases";
}

// The 96-head K3 shape at K = V = 128 with a 4-token window: one case per level, both layouts.
TEST(KdaReplay, K3ShapeBitIdenticalOnEveryLevel) {
  std::mt19937_64 rng(7);
  for (IsaLevel isa : levels()) {
    for (StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst}) {
      Replay r;
      CaseSpec s;
      s.cfg.num_heads = 96;
      s.cfg.layout = layout;
      s.seqlens = {4, 4, 4};
      s.varlen = true;
      s.seed = 11;
      r.c = make_case(s);
      r.tw = 4;
      r.slots = 5;
      const int64_t block = 96 * 128 * 128;
      r.pool.assign(r.slots * block, 0.0f);
      std::copy(r.c.initial_state.begin(), r.c.initial_state.end(), r.pool.begin() + 2 * block);
      r.idx = {2, 3, 4};
      r.acc = {0, 4, 2};
      const cpu::KdaOptions opt = cpu_options_at(isa, Algorithm::kAuto, 2);
      const Expected e = decode_token_by_token(r, opt);
      std::vector<float> window(r.slots * replay_window_floats(s.cfg, 4).value(), 0.0f), o(r.c.o_size());
      ReplayVerifyArgs va{r.c.inputs(), 4, r.pool, r.idx, window, o};
      va.in.initial_state = {};
      ASSERT_TRUE(cpu::verify_replay(s.cfg, va, opt).is_ok());
      EXPECT_TRUE(same_bits(o, e.o)) << isa_level_name(isa);
      ASSERT_TRUE(cpu::commit(s.cfg, CommitArgs{4, r.pool, window, r.idx, r.acc}, opt).is_ok());
      EXPECT_TRUE(same_bits(r.pool, e.pool)) << isa_level_name(isa) << " " << state_layout_name(layout);
    }
  }
}

// The "do not reorder" contract is guarded: the same fold with the k-sum of S^T (alpha k) run
// backwards is as accurate, but its bits differ from decode's, and the comparison above sees it.
TEST(KdaReplay, AReorderedFoldBreaksTheBitIdentity) {
  std::mt19937_64 rng(3);
  int differing = 0, total = 0;
  for (IsaLevel isa : levels()) {
    CaseSpec s;
    s.cfg.num_heads = 4;
    s.seqlens = {4, 4};
    s.varlen = true;
    s.seed = 5;
    Replay r;
    r.c = make_case(s);
    r.tw = 4;
    r.slots = 2;
    r.pool = r.c.initial_state;
    r.idx = {0, 1};
    r.acc = {4, 3};
    const cpu::KdaOptions opt = cpu_options_at(isa, Algorithm::kAuto, 2);
    const Expected e = decode_token_by_token(r, opt);
    auto committed = [&](cpu::kda_detail::FoldOrder order) {
      std::vector<float> pool = r.pool, o(r.c.o_size());
      std::vector<float> window(r.slots * replay_window_floats(s.cfg, 4).value(), 0.0f);
      ReplayVerifyArgs va{r.c.inputs(), 4, pool, r.idx, window, o};
      va.in.initial_state = {};
      EXPECT_TRUE(cpu::verify_replay(s.cfg, va, opt).is_ok());
      const auto p = cpu::plan(s.cfg, opt).value();
      std::vector<uint8_t> ws(p.workspace_bytes);
      EXPECT_TRUE(cpu::kda_detail::commit_with_order(p, CommitArgs{4, pool, window, r.idx, r.acc}, ws, order).is_ok());
      return pool;
    };
    const std::vector<float> good = committed(cpu::kda_detail::FoldOrder::kDecode);
    const std::vector<float> bad = committed(cpu::kda_detail::FoldOrder::kReversedForTest);
    EXPECT_TRUE(same_bits(good, e.pool)) << isa_level_name(isa);
    EXPECT_FALSE(same_bits(bad, e.pool)) << isa_level_name(isa) << ": the reordered fold gave decode's bits";
    double num = 0, den = 0;
    for (size_t i = 0; i < bad.size(); ++i) {
      differing += bad[i] != e.pool[i];
      num += (double(bad[i]) - e.pool[i]) * (double(bad[i]) - e.pool[i]);
      den += double(e.pool[i]) * e.pool[i];
    }
    total += static_cast<int>(bad.size());
    EXPECT_LT(std::sqrt(num / den), 1e-6) << "the reordered fold is a rounding difference, not a bug";
  }
  EXPECT_GT(differing, total / 100) << differing << " of " << total << " state entries differ";
}

// ---- refusals -----------------------------------------------------------------------------------
struct Small {
  KdaConfig cfg;
  KdaCase c;
  std::vector<float> pool, window, o;
  Small() {
    CaseSpec s;
    s.cfg.num_heads = 2;
    s.cfg.head_k = 16;
    s.cfg.head_v = 16;
    s.seqlens = {3, 3};
    s.varlen = true;
    cfg = s.cfg;
    c = make_case(s);
    pool = c.initial_state;
    pool.resize(pool.size() * 2, 0.0f);  // 4 slots
    window.assign(4 * replay_window_floats(cfg, 3).value(), 0.0f);
    o.assign(c.o_size(), 0.0f);
  }
  ReplayVerifyArgs verify_args(std::span<const int32_t> idx) {
    ReplayVerifyArgs a{c.inputs(), 3, pool, idx, window, o};
    a.in.initial_state = {};
    return a;
  }
};

TEST(KdaReplay, RefusalsNameTheArgument) {
  Small t;
  const int32_t idx[] = {1, 2};
  ASSERT_TRUE(cpu::verify_replay(t.cfg, t.verify_args(idx)).is_ok());
  auto commit_msg = [&](std::vector<int32_t> slots, std::vector<int32_t> acc, int64_t tw = 3) {
    return cpu::commit(t.cfg, CommitArgs{tw, t.pool, t.window, slots, acc}).message();
  };
  EXPECT_EQ(commit_msg({1, 2}, {4, 0}), "num_accepted[0] = 4 must be in [0, window_tokens = 3]");
  EXPECT_EQ(commit_msg({1, 2}, {0, -1}), "num_accepted[1] = -1 must be in [0, window_tokens = 3]");
  EXPECT_EQ(commit_msg({1, 1}, {1, 1}), "state_indices: state slot 1 is named twice (sequences 0 and 1)");
  EXPECT_EQ(commit_msg({1, 9}, {1, 1}), "state_indices[1] = 9 is past the pool's 4 slots");
  EXPECT_EQ(commit_msg({1, 2}, {1}), "num_accepted has 1 entries, expected N = 2 (one per state_indices entry)");
  EXPECT_NE(commit_msg({1, 2}, {1, 1}, 4).find("window_pool has"), std::string::npos);
  EXPECT_EQ(commit_msg({3}, {1}),
            "num_accepted[0] = 1 exceeds the 0 draft tokens verified into window slot 3 and not yet committed (a "
            "window is committed once, after its verify_replay)");
  // A refused call changed nothing; the good one consumes the windows: a second commit is refused.
  const std::vector<float> pool = t.pool;
  EXPECT_TRUE(cpu::commit(t.cfg, CommitArgs{3, t.pool, t.window, std::vector<int32_t>{1, 2}, std::vector<int32_t>{3, 2}}).is_ok());
  EXPECT_FALSE(same_bits(pool, t.pool));
  EXPECT_EQ(commit_msg({1}, {1}),
            "num_accepted[0] = 1 exceeds the 0 draft tokens verified into window slot 1 and not yet committed (a "
            "window is committed once, after its verify_replay)");
  EXPECT_TRUE(cpu::commit(t.cfg, CommitArgs{3, t.pool, t.window, std::vector<int32_t>{1}, std::vector<int32_t>{0}}).is_ok());
  // A corrupt count.
  t.window[replay_window_floats(t.cfg, 3).value() - 1] = 1.5f;
  EXPECT_NE(commit_msg({0}, {1}).find("window slot 0 holds a draft-token count of 1.5"), std::string::npos);

  // verify_replay's refusals.
  const int32_t twice[] = {2, 2};
  EXPECT_EQ(cpu::verify_replay(t.cfg, t.verify_args(twice)).message(),
            "state_indices: state slot 2 is named twice (sequences 0 and 1)");
  const int32_t one[] = {1};
  EXPECT_EQ(cpu::verify_replay(t.cfg, t.verify_args(one)).message(), "state_indices has 1 entries, expected N = 2 ([N])");
  ReplayVerifyArgs a = t.verify_args(idx);
  a.window_tokens = 2;
  EXPECT_EQ(cpu::verify_replay(t.cfg, a).message().substr(0, 35), "window_pool has 1204 floats, expect");
  a.window_tokens = 65;
  EXPECT_EQ(cpu::verify_replay(t.cfg, a).message(),
            "window_tokens = 65 must be in [1, 64] (draft tokens a window slot holds)");
  std::vector<float> w2(4 * replay_window_floats(t.cfg, 2).value(), 0.0f);
  a.window_tokens = 2;
  a.window_pool = w2;
  EXPECT_EQ(cpu::verify_replay(t.cfg, a).message(),
            "sequence 0 has 3 draft tokens (cu_seqlens), more than window_tokens = 2");
  a = t.verify_args(idx);
  a.in.cu_seqlens = {};
  a.window_tokens = 4;
  std::vector<float> w4(4 * replay_window_floats(t.cfg, 4).value(), 0.0f);
  a.window_pool = w4;
  EXPECT_EQ(cpu::verify_replay(t.cfg, a).message(),
            "the token count 6 is not a multiple of window_tokens = 4 (without cu_seqlens every sequence has Tw "
            "draft tokens)");
}

// Without cu_seqlens every sequence has Tw tokens; padding rows give zero outputs and leave their
// window alone.
TEST(KdaReplay, EqualLengthWindowsAndPadding) {
  Small t;
  const int32_t idx[] = {-1, 3};
  ReplayVerifyArgs a = t.verify_args(idx);
  a.in.cu_seqlens = {};
  std::fill(t.o.begin(), t.o.end(), 7.0f);
  ASSERT_TRUE(cpu::verify_replay(t.cfg, a).is_ok());
  const int64_t row = 2 * 16;
  EXPECT_TRUE(std::all_of(t.o.begin(), t.o.begin() + 3 * row, [](float x) { return x == 0.0f; }));
  EXPECT_TRUE(std::none_of(t.o.begin() + 3 * row, t.o.end(), [](float x) { return x == 7.0f; }));
  const int64_t per = replay_window_floats(t.cfg, 3).value();
  EXPECT_EQ(t.window[4 * per - 1], 3.0f);
  EXPECT_TRUE(std::all_of(t.window.begin(), t.window.begin() + 3 * per, [](float x) { return x == 0.0f; }));
}

}  // namespace
}  // namespace k3::kda
