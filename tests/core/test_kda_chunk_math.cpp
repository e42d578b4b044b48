// The chunk math of the CUDA chunked KDA prefill (core/kda/kda_chunk_math.hpp), run on the host:
// the same phase functions the kernel runs, with the tensor-core tiles emulated lane by lane
// from the mma.m16n8k8 fragment maps (chunk::HostExec). A host staging that mirrors the kernel's
// (src/cuda/kda/kda_chunked.cu) feeds it, and the result is compared with the FP64 reference and
// with the CPU backend's NaN pattern. What this cannot check: the real fragment layout of the
// hardware (the maps are read from the PTX ISA), the device staging code itself, barriers.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "k3/harness/kda_case.hpp"
#include "core/kda/kda_chunk_math.hpp"
#include "core/kda/kda_math.hpp"
#include "k3/cpu_kda.hpp"

namespace k3::kda {
namespace {

namespace ch = chunk;

struct Out {
  std::vector<float> o, f;
};

// The chunked prefill of kda_chunked.cu, block by block on the host.
Out emulate(const KdaCase& kc) {
  const KdaConfig& cfg = kc.spec.cfg;
  const KdaInputs in = kc.inputs();
  const int K = static_cast<int>(cfg.head_k), V = static_cast<int>(cfg.head_v), H = static_cast<int>(cfg.num_heads);
  const int64_t T = kc.num_tokens;
  std::vector<int64_t> cu(in.cu_seqlens.begin(), in.cu_seqlens.end());
  if (cu.empty()) cu = {0, T};
  const int64_t N = static_cast<int64_t>(cu.size()) - 1;
  const int64_t he = int64_t{K} * V;
  const bool kfirst = cfg.layout == StateLayout::kKFirst;
  const float scale = cfg.effective_scale(), nan = std::nanf("");
  Out r{std::vector<float>(static_cast<size_t>(T * H * V), 7.0f), std::vector<float>(static_cast<size_t>(N * H * he))};
  std::vector<float> mem(static_cast<size_t>(ch::layout(K).floats));
  ch::View s = ch::make_view(mem.data(), K);
  const int kp = s.kp, ldk = s.ldk;
  ch::HostExec ex;
  for (int64_t n = 0; n < N; ++n) {
    for (int h = 0; h < H; ++h) {
      for (int j0 = 0; j0 < V; j0 += ch::kVt) {
        const bool gated = cfg.gate != GateMode::kLogDecay;
        const float a = gated ? detail::gate_exp(in.a_log[static_cast<size_t>(h)]) : 0.0f;
        for (int d = 0; d < kp; ++d) {
          s.bias[d] = (gated && !in.dt_bias.empty() && d < K) ? in.dt_bias[static_cast<size_t>(h * K + d)] : 0.0f;
        }
        for (int d = 0; d < kp; ++d) {
          for (int jj = 0; jj < ch::kVt; ++jj) {
            const int j = j0 + jj;
            const int64_t at = (n * H + h) * he + (kfirst ? d * V + j : j * K + d);
            s.S[d * ch::kLdV + jj] =
                (!in.initial_state.empty() && d < K && j < V) ? in.initial_state[static_cast<size_t>(at)] : 0.0f;
          }
        }
        for (int64_t t = cu[n]; t < cu[n + 1]; t += ch::kC) {
          const int c = static_cast<int>(std::min<int64_t>(ch::kC, cu[n + 1] - t));
          s.c = c;
          for (int i = 0; i < ch::kC; ++i) {  // the kernel's staging, one row at a time
            const bool real = i < c;
            const int64_t tok = t + i, qk = (tok * H + h) * K;
            float sq = 0.0f, sk = 0.0f;
            bool qb = false, kb = false, gb = false;
            for (int d = 0; d < kp; ++d) {
              float qv = 0.0f, kv = 0.0f, gv = 0.0f;
              if (real && d < K) {
                qv = detail::act_at(in.q, qk + d);
                kv = detail::act_at(in.k, qk + d);
                gv = detail::log_decay<float>(cfg.gate, in.g[static_cast<size_t>(qk + d)], a, s.bias[d],
                                              cfg.gate_lower_bound);
              }
              qb = qb || !ch::finite(qv);
              kb = kb || !ch::finite(kv);
              gb = gb || detail::decay_poisons(gv);
              s.q[i * ldk + d] = qv;
              s.k[i * ldk + d] = kv;
              s.g[i * ldk + d] = gv;
              sq += qv * qv;
              sk += kv * kv;
            }
            float beta = 0.0f;
            if (real) {
              const float b = in.beta[static_cast<size_t>(tok * H + h)];
              beta = cfg.beta_logits ? detail::sigmoid<float>(b) : b;
            }
            const bool whole = real && (kb || gb || !ch::finite(beta));
            if (qb) sq = 0.0f;
            if (whole) sk = 0.0f;
            const float qs = cfg.l2norm_qk ? scale / std::sqrt(sq + 1e-6f) : scale;
            const float ks = cfg.l2norm_qk ? 1.0f / std::sqrt(sk + 1e-6f) : 1.0f;
            for (int d = 0; d < kp; ++d) {
              s.q[i * ldk + d] = qb ? 0.0f : s.q[i * ldk + d] * qs;
              s.k[i * ldk + d] = whole ? 0.0f : s.k[i * ldk + d] * ks;
              if (whole) s.g[i * ldk + d] = 0.0f;
            }
            uint32_t vmask = 0;
            for (int jj = 0; jj < ch::kVt; ++jj) {
              float vv = 0.0f;
              if (real && j0 + jj < V) vv = detail::act_at(in.v, (tok * H + h) * V + j0 + jj);
              const bool vb = !ch::finite(vv);
              s.vs[i * ch::kLdV + jj] = vb ? 0.0f : vv;
              if (vb) vmask |= 1u << jj;
            }
            s.beta[i] = whole ? 0.0f : beta;
            s.rowflag[i] = (real && qb ? ch::kRowQBad : 0) | (whole ? ch::kRowWhole : 0);
            s.vbad[i] = vmask;
          }
          ch::chunk_compute(s, ex);
          for (int i = 0; i < c; ++i) {
            for (int jj = 0; jj < ch::kVt && j0 + jj < V; ++jj) {
              const bool bad = (s.rowflag[i] & ch::kRowQBad) != 0 || i >= s.pstart[jj];
              r.o[static_cast<size_t>(((t + i) * H + h) * V + j0 + jj)] = bad ? nan : s.os[i * ch::kLdV + jj];
            }
          }
        }
        for (int d = 0; d < K; ++d) {
          for (int jj = 0; jj < ch::kVt && j0 + jj < V; ++jj) {
            const int j = j0 + jj;
            r.f[static_cast<size_t>((n * H + h) * he + (kfirst ? d * V + j : j * K + d))] = s.S[d * ch::kLdV + jj];
          }
        }
      }
    }
  }
  return r;
}

struct Ref {
  std::vector<double> o, f;
};
Ref ref64(const KdaCase& c) {
  Ref r{std::vector<double>(static_cast<size_t>(c.o_size())), std::vector<double>(static_cast<size_t>(c.state_size()))};
  EXPECT_TRUE(reference_fp64(c.spec.cfg, c.inputs(), r.o, r.f).is_ok());
  return r;
}

KdaConfig cfg_of(int64_t h, int64_t k, int64_t v, GateMode gate, StateLayout layout) {
  KdaConfig c;
  c.num_heads = h;
  c.head_k = k;
  c.head_v = v;
  c.gate = gate;
  c.layout = layout;
  return c;
}

TEST(KdaChunkMath, FragmentMapsCoverEveryElementOnce) {
  int a[16][8] = {}, b[8][8] = {}, c[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    for (int r = 0; r < 4; ++r) {
      ++a[ch::a_row(lane, r)][ch::a_col(lane, r)];
      ++c[ch::c_row(lane, r)][ch::c_col(lane, r)];
    }
    for (int r = 0; r < 2; ++r) ++b[ch::b_row(lane, r)][ch::b_col(lane, r)];
  }
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 8; ++j) {
      EXPECT_EQ(a[i][j], 1) << "A " << i << "," << j;
      EXPECT_EQ(c[i][j], 1) << "C " << i << "," << j;
      if (i < 8) {
        EXPECT_EQ(b[i][j], 1) << "B " << i << "," << j;
      }
    }
  }
}

TEST(KdaChunkMath, Tf32SplitIsExactAndRoundsLikeCvtRna) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1000.0f, 1000.0f);
  for (int i = 0; i < 10000; ++i) {
    const float x = u(rng);
    uint32_t big, small;
    ch::split_tf32(x, big, small);
    EXPECT_EQ(big & 0x1fffu, 0u);
    EXPECT_EQ(small & 0x1fffu, 0u);
    EXPECT_LE(std::fabs(x - ch::u2f(big)), std::ldexp(std::fabs(x), -11));
    // big + small is x to about 2^-22 relative (the small part keeps 11 more bits)
    EXPECT_LE(std::fabs(static_cast<double>(x) - ch::u2f(big) - ch::u2f(small)), std::ldexp(std::fabs(x), -21));
  }
  EXPECT_EQ(ch::tf32_bits(1.0f + std::ldexp(1.0f, -11)), ch::f2u(1.0f + std::ldexp(1.0f, -10)));  // tie: away
  EXPECT_EQ(ch::tf32_bits(-1.0f - std::ldexp(1.0f, -11)), ch::f2u(-1.0f - std::ldexp(1.0f, -10)));
  uint32_t big, small;
  ch::split_tf32(INFINITY, big, small);
  EXPECT_TRUE(std::isinf(ch::u2f(big)));
  EXPECT_TRUE(std::isnan(ch::u2f(small)));  // so a product with Inf is NaN, never finite
}

// A 16 x 8 tile over K = 128 of random rows: 3xTF32 is within a few FP32 ulp of FP64, far below
// what one TF32 product would give (so the test can tell them apart).
TEST(KdaChunkMath, MmaTileIn3xTf32IsNearFp32) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  const int kd = 128;
  std::vector<float> A(16 * kd), B(kd * 8);
  for (auto& x : A) x = nd(rng);
  for (auto& x : B) x = nd(rng);
  float D[16][8];
  ch::mma_tile(
      ch::kAllLanes, kd, [&](int r, int p) { return A[r * kd + p]; }, [&](int p, int n) { return B[p * 8 + n]; },
      [](int r, int n) { return 0.25f * static_cast<float>(r - n); }, [&](int r, int n, float v) { D[r][n] = v; });
  double worst = 0, worst_tf32 = 0;
  for (int r = 0; r < 16; ++r) {
    for (int n = 0; n < 8; ++n) {
      double ref = 0.25 * (r - n), tf = ref, mag = 0;
      for (int p = 0; p < kd; ++p) {
        ref += static_cast<double>(A[r * kd + p]) * B[p * 8 + n];
        tf += static_cast<double>(ch::u2f(ch::tf32_bits(A[r * kd + p]))) * ch::u2f(ch::tf32_bits(B[p * 8 + n]));
        mag += std::fabs(static_cast<double>(A[r * kd + p]) * B[p * 8 + n]);
      }
      worst = std::max(worst, std::fabs(D[r][n] - ref) / mag);
      worst_tf32 = std::max(worst_tf32, std::fabs(tf - ref) / mag);
    }
  }
  EXPECT_LT(worst, 2e-6) << "3xTF32";
  EXPECT_GT(worst_tf32, 2e-5) << "plain TF32 (the contrast)";
}

// The emulated chunked kernel against the FP64 reference: varlen batches with an empty and a
// length-1 sequence and lengths that are no multiple of 16, resets (g = -1000), both layouts,
// BF16 and FP32 inputs, every gate, K and V that are no multiple of 16 / 32.
TEST(KdaChunkMath, EmulatedChunkedPrefillMatchesTheFp64Reference) {
  struct Shape {
    int64_t h, k, v;
    std::vector<int64_t> lens, resets;
  };
  const Shape shapes[] = {{2, 64, 64, {37, 0, 1, 16, 50}, {5, 20, 21, 60}},
                          {1, 60, 100, {33}, {}},
                          {1, 128, 32, {70}, {16, 40}}};
  for (const auto& sh : shapes) {
    for (GateMode gate : {GateMode::kLogDecay, GateMode::kSafe, GateMode::kSoftplus}) {
      for (StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst}) {
        for (bool bf16 : {true, false}) {
          CaseSpec s;
          s.cfg = cfg_of(sh.h, sh.k, sh.v, gate, layout);
          s.seqlens = sh.lens;
          s.resets = sh.resets;
          s.bf16 = bf16;
          s.seed = 7 + static_cast<uint64_t>(sh.k);
          const KdaCase c = make_case(s);
          const Ref ref = ref64(c);
          const Out out = emulate(c);
          const std::string what = std::string(gate_mode_name(gate)) + " " + state_layout_name(layout) +
                                   (bf16 ? " bf16" : " fp32") + " K=" + std::to_string(sh.k) + " V=" +
                                   std::to_string(sh.v);
          const ErrorStats eo = compare(out.o, ref.o), ef = compare(out.f, ref.f);
          EXPECT_LT(eo.err_ratio, kTolFp32) << what;
          EXPECT_LT(ef.err_ratio, kTolFp32) << what;
        }
      }
    }
  }
}

// The safe gate at its -5 bound (f large): a chunk spans 80 > 60, so every full chunk takes the
// tree of exact ratios; checked against FP64 and shown to take that path.
TEST(KdaChunkMath, StrongDecayChunksTakeTheTreeAndStayExact) {
  for (bool bf16 : {true, false}) {
    CaseSpec s;
    s.cfg = cfg_of(2, 128, 64, GateMode::kSafe, StateLayout::kKFirst);
    s.seqlens = {100, 40};
    s.bf16 = bf16;
    KdaCase c = make_case(s);
    for (size_t i = 0; i < c.g.size(); ++i) {
      if (i % 3 != 0) c.g[i] = 40.0f;  // sigmoid saturates: g = -5 in two thirds of the channels
    }
    // The path: a full chunk of these gates has span 16 * 5 = 80 in some column.
    {
      std::vector<float> mem(static_cast<size_t>(ch::layout(128).floats));
      ch::View v = ch::make_view(mem.data(), 128);
      for (int i = 0; i < ch::kC; ++i) {
        for (int d = 0; d < v.kp; ++d) v.g[i * v.ldk + d] = detail::log_decay<float>(GateMode::kSafe, 40.0f, 1.0f, 0.0f, -5.0f);
      }
      ch::HostExec ex;
      EXPECT_TRUE(ex.columns_or(v.kp, [&](int d) { return ch::prep_column(v, d); }));
    }
    const Ref ref = ref64(c);
    const Out out = emulate(c);
    EXPECT_LT(compare(out.o, ref.o).err_ratio, kTolFp32) << (bf16 ? "bf16" : "fp32");
    EXPECT_LT(compare(out.f, ref.f).err_ratio, kTolFp32) << (bf16 ? "bf16" : "fp32");
  }
}

// Non-finite inputs: the emulated kernel's NaN pattern equals the CPU backend's (chunked), and
// the finite entries agree with it.
TEST(KdaChunkMath, NonFiniteInputsPoisonWhatTheCpuPoisons) {
  for (StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst}) {
    CaseSpec s;
    s.cfg = cfg_of(2, 32, 40, GateMode::kLogDecay, layout);
    s.seqlens = {45, 20, 0};
    s.bf16 = false;
    KdaCase c = make_case(s);
    const int64_t H = 2, K = 32, V = 40;
    c.q32[static_cast<size_t>((3 * H + 0) * K + 5)] = NAN;         // q: row 3, head 0
    c.k32[static_cast<size_t>((20 * H + 1) * K + 7)] = INFINITY;   // k: token 20, head 1 (second chunk)
    c.v32[static_cast<size_t>((30 * H + 0) * V + 33)] = NAN;       // v: token 30, column 33 (second tile)
    c.g[static_cast<size_t>((50 * H + 1) * K + 2)] = NAN;          // g: token 50 (2nd sequence), head 1
    c.beta[static_cast<size_t>(60 * H + 0)] = NAN;                 // beta: token 60, head 0
    c.initial_state[static_cast<size_t>(1 * H * K * V + 0 * K * V + 4)] = INFINITY;  // state of seq 1, head 0
    c.initial_state[static_cast<size_t>(2 * H * K * V + 1 * K * V + 9)] = NAN;       // empty sequence: unchanged
    Out cpu{std::vector<float>(static_cast<size_t>(c.o_size())), std::vector<float>(static_cast<size_t>(c.state_size()))};
    ASSERT_TRUE(
        cpu::prefill(s.cfg, c.inputs(), {cpu.o, cpu.f}, cpu_options_at(IsaLevel::kScalar, Algorithm::kChunked, 1))
            .is_ok());
    const Out out = emulate(c);
    int nans = 0;
    for (size_t i = 0; i < cpu.o.size(); ++i) {
      ASSERT_EQ(std::isnan(out.o[i]), std::isnan(cpu.o[i])) << "o[" << i << "] " << out.o[i] << " vs " << cpu.o[i];
      nans += std::isnan(cpu.o[i]) ? 1 : 0;
      if (!std::isnan(cpu.o[i])) {
        EXPECT_NEAR(out.o[i], cpu.o[i], 1e-4f + 1e-4f * std::fabs(cpu.o[i])) << i;
      }
    }
    for (size_t i = 0; i < cpu.f.size(); ++i) {
      ASSERT_EQ(std::isnan(out.f[i]), std::isnan(cpu.f[i])) << "final[" << i << "] " << out.f[i] << " vs " << cpu.f[i];
      ASSERT_EQ(std::isinf(out.f[i]), std::isinf(cpu.f[i])) << "final[" << i << "]";
    }
    EXPECT_GT(nans, 100);
  }
}

}  // namespace
}  // namespace k3::kda
