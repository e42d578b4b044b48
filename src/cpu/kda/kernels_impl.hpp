// KDA CPU kernels, written once against a SIMD abstraction `VF` and compiled per ISA.
// No include guard on purpose: kernels_<isa>.cpp includes this file inside its own namespace,
// after `#pragma GCC target(...)` and after defining VF with:
//   V, W (lanes), MR / NR (GEMM register tile: rows x vectors), zero, set1, load, store, add,
//   sub, mul, fmadd(a, b, c) = a*b + c, max, reduce_add, exp.
// Only k3::cpu::kda_detail types and plain functions are used here; std headers come from the includer.

using Vec = typename VF::V;
constexpr int64_t kW = VF::W;

// Span of the cumulative log decay inside a chunk above which the factorized form
// (q e^{gc}) . (k e^{-gc}) could overflow: e^60 ~ 1e26 keeps every factor and every 128-term
// dot product far from FLT_MAX (3.4e38) and e^-60 far above the smallest normal (1.2e-38).
constexpr float kFactorizedSpanMax = 60.0f;

// Vectorized over full vectors, the tail (n not a multiple of the width) element by element.
inline void load_row(const uint16_t* b, const float* f, int64_t off, int64_t n, int64_t np, float* dst) {
  const int64_t nv = n / kW * kW;
  if (b != nullptr) {
    for (int64_t i = 0; i < nv; i += kW) VF::store(dst + i, VF::load_bf16(b + off + i));
    for (int64_t i = nv; i < n; ++i) dst[i] = k3::bf16_to_f32(b[off + i]);
  } else {
    for (int64_t i = 0; i < nv; i += kW) VF::store(dst + i, VF::load(f + off + i));
    for (int64_t i = nv; i < n; ++i) dst[i] = f[off + i];
  }
  for (int64_t i = n; i < np; ++i) dst[i] = 0.0f;
}

inline float dot(const float* a, const float* b, int64_t np) {
  Vec acc0 = VF::zero(), acc1 = VF::zero();
  int64_t i = 0;
  for (; i + 2 * kW <= np; i += 2 * kW) {
    acc0 = VF::fmadd(VF::load(a + i), VF::load(b + i), acc0);
    acc1 = VF::fmadd(VF::load(a + i + kW), VF::load(b + i + kW), acc1);
  }
  if (i < np) acc0 = VF::fmadd(VF::load(a + i), VF::load(b + i), acc0);
  return VF::reduce_add(VF::add(acc0, acc1));
}

inline void scale_row(float* x, float s, int64_t np) {
  const Vec sv = VF::set1(s);
  for (int64_t i = 0; i < np; i += kW) VF::store(x + i, VF::mul(VF::load(x + i), sv));
}

inline void exp_row(const float* x, float* y, int64_t np) {
  for (int64_t i = 0; i < np; i += kW) VF::store(y + i, VF::exp(VF::load(x + i)));
}

// y = a * b (elementwise)
inline void mul_rows(const float* a, const float* b, float* y, int64_t np) {
  for (int64_t i = 0; i < np; i += kW) VF::store(y + i, VF::mul(VF::load(a + i), VF::load(b + i)));
}

// y -= s * x
inline void axpy_neg(float s, const float* x, float* y, int64_t np) {
  const Vec sv = VF::set1(-s);
  for (int64_t i = 0; i < np; i += kW) VF::store(y + i, VF::fmadd(sv, VF::load(x + i), VF::load(y + i)));
}

// True when every element of x[0, np) is finite: x * 0 is NaN exactly for Inf and NaN.
inline bool row_finite(const float* x, int64_t np) {
  const Vec z = VF::zero();
  Vec acc = VF::zero();
  for (int64_t i = 0; i < np; i += kW) acc = VF::add(acc, VF::mul(VF::load(x + i), z));
  return VF::reduce_add(acc) == 0.0f;
}

// True when no log decay of g[0, np) poisons (detail::decay_poisons: NaN or above kMaxLogDecay).
inline bool decay_row_ok(const float* g, int64_t np) {
  const Vec lim = VF::set1(kMaxLogDecay), z = VF::zero();
  Vec acc = VF::zero();
  for (int64_t i = 0; i < np; i += kW) acc = VF::add(acc, VF::max(VF::sub(VF::load(g + i), lim), z));
  return VF::reduce_add(acc) == 0.0f;
}

inline void fill_row(float* x, float value, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = value;
}

// What prep_token found non-finite in one token (docs/kda.md, "Non-finite values"). The token's
// rows are returned sanitized (those values replaced by 0) so that nothing else is touched; the
// caller then sets the entries that depend on them to NaN.
struct TokenPoison {
  bool q = false;      // q: this token's output row is NaN
  bool whole = false;  // k, beta or the log decay: the token's write poisons every column
  bool v = false;      // some v[j]: vbad[j] = 1 marks the poisoned columns
};

inline void fill_bias(const HeadCtx& x, float* bias) {
  const int64_t kp = x.lay.kp;
  for (int64_t d = 0; d < kp; ++d) bias[d] = (x.dt_bias != nullptr && d < x.head_k) ? x.dt_bias[d] : 0.0f;
}

// q (L2-normalized, scaled), k (L2-normalized), v, the log decay g and beta of token t; rows
// padded with zeros. `bias` is the padded dt_bias row. Non-finite inputs are reported in `p` and
// replaced by 0; v is checked only when `vbad` ([vp], the bad columns) is given.
inline float prep_token(const HeadCtx& x, int64_t t, const float* bias, float* q, float* k, float* v, float* g,
                        TokenPoison& p, float* vbad) {
  const int64_t K = x.head_k, V = x.head_v, kp = x.lay.kp, vp = x.lay.vp;
  const int64_t qk_off = (t * x.num_heads + x.head) * K;
  load_row(x.q16, x.q32, qk_off, K, kp, q);
  load_row(x.k16, x.k32, qk_off, K, kp, k);
  load_row(x.v16, x.v32, (t * x.num_heads + x.head) * V, V, vp, v);
  p = TokenPoison{};
  // Non-finite checks, a pass over a row only where needed: with the L2 norm, the finite sum of
  // squares it computes anyway proves the row finite.
  float qq = 0.0f, kk = 0.0f;
  if (x.l2norm) {
    qq = dot(q, q, kp);
    kk = dot(k, k, kp);
  }
  if (!(x.l2norm && std::isfinite(qq)) && !row_finite(q, kp)) {
    p.q = true;
    fill_row(q, 0.0f, kp);
    qq = 0.0f;
  }
  if (!(x.l2norm && std::isfinite(kk)) && !row_finite(k, kp)) p.whole = true;
  // v: the chunked path only (vbad given); the recurrent path sees a non-finite v in v'.
  if (vbad != nullptr && !row_finite(v, vp)) {
    p.v = true;
    for (int64_t j = 0; j < vp; ++j) {
      const bool bad = !std::isfinite(v[j]);
      vbad[j] = bad ? 1.0f : 0.0f;
      if (bad) v[j] = 0.0f;
    }
  }
  if (p.whole) {
    fill_row(k, 0.0f, kp);
    kk = 0.0f;
  }
  if (x.l2norm) {
    // eps inside the square root, as fla's l2norm
    scale_row(q, x.scale / std::sqrt(qq + 1e-6f), kp);
    scale_row(k, 1.0f / std::sqrt(kk + 1e-6f), kp);
  } else {
    scale_row(q, x.scale, kp);
  }
  const float* f = x.g + qk_off;
  switch (x.gate) {
    case GateMode::kLogDecay:
      for (int64_t d = 0; d < K; ++d) g[d] = f[d] < kMinLogDecay ? kMinLogDecay : f[d];
      break;
    case GateMode::kSafe: {
      // lb * sigmoid(a (f + bias)), vectorized; the padding is reset below.
      for (int64_t d = 0; d < K; ++d) g[d] = f[d];
      for (int64_t d = K; d < kp; ++d) g[d] = 0.0f;
      const Vec av = VF::set1(-x.a), one = VF::set1(1.0f), lb = VF::set1(x.lower_bound);
      const Vec gmin = VF::set1(kMinLogDecay);
      for (int64_t d = 0; d < kp; d += kW) {
        const Vec e = VF::exp(VF::mul(av, VF::add(VF::load(g + d), VF::load(bias + d))));
        VF::store(g + d, VF::max(VF::div(lb, VF::add(one, e)), gmin));
      }
      break;
    }
    case GateMode::kSoftplus:
      for (int64_t d = 0; d < K; ++d) g[d] = k3::kda::detail::log_decay<float>(x.gate, f[d], x.a, bias[d], x.lower_bound);
      break;
  }
  for (int64_t d = K; d < kp; ++d) g[d] = 0.0f;
  const float b = x.beta[t * x.num_heads + x.head];
  const float beta = x.beta_logits ? 1.0f / (1.0f + std::exp(-b)) : b;
  if (!p.whole && decay_row_ok(g, kp) && std::isfinite(beta)) return beta;
  p.whole = true;  // the write is replaced by NaN: compute it as a no-op
  fill_row(k, 0.0f, kp);
  fill_row(g, 0.0f, kp);
  return 0.0f;
}

// Recurrent path: the poisoned columns of v' become NaN, which makes the same columns of the
// state and of this token's output NaN in pass 2. A non-finite v' comes from a non-finite v, a
// non-finite state entry in its column (or an overflow): it becomes NaN, never +-Inf.
inline void poison_vnew(const HeadCtx& x, const TokenPoison& p, float* vnew, int64_t vw) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t V = x.head_v;
  if (p.whole) {
    fill_row(vnew, nan, V);
    return;
  }
  if (!row_finite(vnew, vw)) {
    for (int64_t j = 0; j < V; ++j) {
      if (!std::isfinite(vnew[j])) vnew[j] = nan;
    }
  }
}

// The rows of token t are H * K elements apart from those of token t - 1 (24 KiB at H = 96,
// K = 128, BF16): too far for the hardware prefetcher, so the inputs of upcoming tokens are
// prefetched explicitly (prep_token was bound by these misses: ~20 % of a chunked prefill).
using k3::cpu::detail::prefetch_bytes;  // inline assembly: GCC dropped __builtin_prefetch here
inline void prefetch_token(const HeadCtx& x, int64_t t) {
  const int64_t qk = (t * x.num_heads + x.head) * x.head_k, vo = (t * x.num_heads + x.head) * x.head_v;
  if (x.q16 != nullptr) {
    prefetch_bytes(x.q16 + qk, x.head_k * 2);
  } else {
    prefetch_bytes(x.q32 + qk, x.head_k * 4);
  }
  if (x.k16 != nullptr) {
    prefetch_bytes(x.k16 + qk, x.head_k * 2);
  } else {
    prefetch_bytes(x.k32 + qk, x.head_k * 4);
  }
  if (x.v16 != nullptr) {
    prefetch_bytes(x.v16 + vo, x.head_v * 2);
  } else {
    prefetch_bytes(x.v32 + vo, x.head_v * 4);
  }
  prefetch_bytes(x.g + qk, x.head_k * 4);
}

inline void store_out(const HeadCtx& x, int64_t t, const float* row) {
  float* dst = x.o + (t * x.num_heads + x.head) * x.head_v;
  for (int64_t j = 0; j < x.head_v; ++j) dst[j] = row[j];
}

// ---- recurrent path ----------------------------------------------------------------------
// acc[0..NB) = sum_{d<K} ak[d] s[d, j0 ..]; vnew = beta (v - acc)
// (kReversed: d from K - 1 down, the commit's kReversedForTest fold only.)
template <int NB, bool kReversed = false>
inline void rec_pass1(const float* s, int64_t lds, int64_t K, int64_t j0, const float* ak, const float* v, float beta,
                      float* vnew) {
  Vec acc[NB];
  for (int i = 0; i < NB; ++i) acc[i] = VF::zero();
  for (int64_t e = 0; e < K; ++e) {
    const int64_t d = kReversed ? K - 1 - e : e;
    const Vec a = VF::set1(ak[d]);
    const float* row = s + d * lds + j0;
    for (int i = 0; i < NB; ++i) acc[i] = VF::fmadd(a, VF::load(row + i * kW), acc[i]);
  }
  const Vec bv = VF::set1(beta);
  for (int i = 0; i < NB; ++i) {
    VF::store(vnew + j0 + i * kW, VF::mul(bv, VF::sub(VF::load(v + j0 + i * kW), acc[i])));
  }
}

// s[d, j0 ..] = alpha[d] s + k[d] vnew; out[j0 ..] = sum_d q[d] s[d, j0 ..]
template <int NB>
inline void rec_pass2(float* s, int64_t lds, int64_t K, int64_t j0, const float* alpha, const float* k,
                      const float* q, const float* vnew, float* out) {
  Vec vn[NB], acc[NB];
  for (int i = 0; i < NB; ++i) {
    vn[i] = VF::load(vnew + j0 + i * kW);
    acc[i] = VF::zero();
  }
  for (int64_t d = 0; d < K; ++d) {
    const Vec a = VF::set1(alpha[d]), kd = VF::set1(k[d]), qd = VF::set1(q[d]);
    float* row = s + d * lds + j0;
    for (int i = 0; i < NB; ++i) {
      const Vec sv = VF::fmadd(kd, vn[i], VF::mul(a, VF::load(row + i * kW)));
      VF::store(row + i * kW, sv);
      acc[i] = VF::fmadd(qd, sv, acc[i]);
    }
  }
  for (int i = 0; i < NB; ++i) VF::store(out + j0 + i * kW, acc[i]);
}

// verify_replay: the update inputs of token t (relative to the window's first token, t0 of the
// sequence: x.window points at that token's row) as the commit reads them back.
inline int64_t window_row_floats(const HeadCtx& x) { return 2 * x.head_k + x.head_v + kReplayRowExtra; }
inline void keep_window_row(const HeadCtx& x, int64_t t, const float* k, const float* alpha, const float* v,
                            float beta, bool poisoned) {
  float* row = x.window + t * x.num_heads * window_row_floats(x);
  const int64_t K = x.head_k, V = x.head_v;
  for (int64_t d = 0; d < K; ++d) row[d] = k[d];
  for (int64_t d = 0; d < K; ++d) row[K + d] = alpha[d];
  for (int64_t j = 0; j < V; ++j) row[2 * K + j] = v[j];
  row[2 * K + V] = beta;
  row[2 * K + V + 1] = poisoned ? 1.0f : 0.0f;
}

// rec_pass2's state update without the output: s[d, j0 ..] = alpha[d] s + k[d] vnew.
template <int NB>
inline void rec_pass2_state(float* s, int64_t lds, int64_t K, int64_t j0, const float* alpha, const float* k,
                            const float* vnew) {
  Vec vn[NB];
  for (int i = 0; i < NB; ++i) vn[i] = VF::load(vnew + j0 + i * kW);
  for (int64_t d = 0; d < K; ++d) {
    const Vec a = VF::set1(alpha[d]), kd = VF::set1(k[d]);
    float* row = s + d * lds + j0;
    for (int i = 0; i < NB; ++i) VF::store(row + i * kW, VF::fmadd(kd, vn[i], VF::mul(a, VF::load(row + i * kW))));
  }
}

inline void recurrent_impl(const HeadCtx& x, int64_t t0, int64_t t1, float* s, int64_t lds, int64_t vw,
                           float* scratch) {
  const ScratchLayout& L = x.lay;
  float *q = scratch + L.q, *k = scratch + L.k, *v = scratch + L.v, *g = scratch + L.g;
  float *alpha = scratch + L.alpha, *ak = scratch + L.ak, *vnew = scratch + L.vnew, *out = scratch + L.out;
  float* bias = scratch + L.bias;
  const int64_t K = x.head_k, kp = L.kp;
  constexpr int64_t kBlock = 4 * kW;
  fill_bias(x, bias);
  constexpr int64_t kAhead = 4;  // tokens prefetched ahead
  for (int64_t t = t0; t < t0 + kAhead && t < t1; ++t) prefetch_token(x, t);
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kAhead < t1) prefetch_token(x, t + kAhead);
    TokenPoison p;
    const float beta = prep_token(x, t, bias, q, k, v, g, p, nullptr);
    exp_row(g, alpha, kp);
    mul_rows(alpha, k, ak, kp);
    int64_t j = 0;
    for (; j + kBlock <= vw; j += kBlock) rec_pass1<4>(s, lds, K, j, ak, v, beta, vnew);
    for (; j < vw; j += kW) rec_pass1<1>(s, lds, K, j, ak, v, beta, vnew);
    poison_vnew(x, p, vnew, vw);
    if (x.window != nullptr) keep_window_row(x, t - t0, k, alpha, v, beta, p.whole);
    j = 0;
    for (; j + kBlock <= vw; j += kBlock) rec_pass2<4>(s, lds, K, j, alpha, k, q, vnew, out);
    for (; j < vw; j += kW) rec_pass2<1>(s, lds, K, j, alpha, k, q, vnew, out);
    if (p.q) fill_row(out, std::numeric_limits<float>::quiet_NaN(), x.head_v);
    store_out(x, t, out);
  }
}

// ---- chunked path --------------------------------------------------------------------------
// C[r, 0..vw) = (Cin ? rs[r] * Cin[r, ..] : 0) + sum_{p<P} A(r, p) B[p, ..],
// A(r, p) = A[r * ars + p * aps]; rs == nullptr means 1.
template <int MR, int NR>
inline void gemm_tile(int64_t P, const float* A, int64_t ars, int64_t aps, const float* B, int64_t ldb,
                      const float* cin, int64_t ldcin, const float* rs, float* C, int64_t ldc) {
  Vec acc[MR][NR];
  for (int r = 0; r < MR; ++r) {
    const Vec f = VF::set1(rs != nullptr ? rs[r] : 1.0f);
    for (int i = 0; i < NR; ++i) {
      acc[r][i] = cin != nullptr ? VF::mul(f, VF::load(cin + r * ldcin + i * kW)) : VF::zero();
    }
  }
  for (int64_t p = 0; p < P; ++p) {
    Vec b[NR];
    for (int i = 0; i < NR; ++i) b[i] = VF::load(B + p * ldb + i * kW);
    for (int r = 0; r < MR; ++r) {
      const Vec a = VF::set1(A[r * ars + p * aps]);
      for (int i = 0; i < NR; ++i) acc[r][i] = VF::fmadd(a, b[i], acc[r][i]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int i = 0; i < NR; ++i) VF::store(C + r * ldc + i * kW, acc[r][i]);
  }
}

template <int MR>
inline void gemm_rows(int64_t vw, int64_t P, const float* A, int64_t ars, int64_t aps, const float* B, int64_t ldb,
                      const float* cin, int64_t ldcin, const float* rs, float* C, int64_t ldc) {
  constexpr int64_t kBlock = VF::NR * kW;
  int64_t j = 0;
  for (; j + kBlock <= vw; j += kBlock) {
    gemm_tile<MR, VF::NR>(P, A, ars, aps, B + j, ldb, cin != nullptr ? cin + j : nullptr, ldcin, rs, C + j, ldc);
  }
  for (; j < vw; j += kW) {
    gemm_tile<MR, 1>(P, A, ars, aps, B + j, ldb, cin != nullptr ? cin + j : nullptr, ldcin, rs, C + j, ldc);
  }
}

inline void gemm(int64_t M, int64_t vw, int64_t P, const float* A, int64_t ars, int64_t aps, const float* B,
                 int64_t ldb, const float* cin, int64_t ldcin, const float* rs, float* C, int64_t ldc) {
  int64_t r = 0;
  for (; r + VF::MR <= M; r += VF::MR) {
    gemm_rows<VF::MR>(vw, P, A + r * ars, ars, aps, B, ldb, cin != nullptr ? cin + r * ldcin : nullptr, ldcin,
                      rs != nullptr ? rs + r : nullptr, C + r * ldc, ldc);
  }
  for (; r < M; ++r) {
    gemm_rows<1>(vw, P, A + r * ars, ars, aps, B, ldb, cin != nullptr ? cin + r * ldcin : nullptr, ldcin,
                 rs != nullptr ? rs + r : nullptr, C + r * ldc, ldc);
  }
}

// Rows of one chunk that the strong-decay ratio computation reads and writes.
struct RatioRows {
  const float *q, *k, *graw, *beta;  // [C, kp] normalized q / k, raw g rows; [C] beta
  float *cl, *caqk;                  // [C, C]
  float *f1, *f2, *f3;               // [C, kp] factor rows (scratch)
  float *run, *e;                    // [kp] scratch
  int64_t kp, head_k;
};

// cl[i][j] (j < i) and caqk[i][j] (j <= i) for a <= j <= i < b, with the ratio
// Gamma_i / Gamma_j = exp(sum_{s=j+1..i} g_s), when the chunk's span is above
// kFactorizedSpanMax. A range whose own span (relative to its first row) is within the bound
// is factorized around its first row: (x_i e^{gr_i}) . (k_j e^{-gr_j}), factors within e^+-60.
// Otherwise it is split at m: both halves recurse, and the cross pairs (j < m <= i) are
// factorized around m with both factors <= 1: e^{sum_{j+1..m} g} and e^{sum_{m+1..i} g}. Every
// exponent is a running sum of raw g rows, never a difference of large cumulative sums, so a
// -1e4 reset next to small terms loses nothing. A pair range of two rows always takes the
// cross form (its ratio is exactly exp(g_{a+1})). Exps: O(C log C) rows instead of C^2 / 2.
inline void ratios_range(const RatioRows& r, int64_t a, int64_t b) {
  const int64_t kp = r.kp;
  if (b - a == 1) {
    r.caqk[a * kChunk + a] = dot(r.q + a * kp, r.k + a * kp, kp);
    return;
  }
  for (int64_t d = 0; d < kp; ++d) r.run[d] = 0.0f;
  for (int64_t i = a + 1; i < b; ++i) {
    for (int64_t d = 0; d < kp; d += kW) VF::store(r.run + d, VF::add(VF::load(r.run + d), VF::load(r.graw + i * kp + d)));
  }
  float span = 0.0f;
  for (int64_t d = 0; d < r.head_k; ++d) span = -r.run[d] > span ? -r.run[d] : span;
  if (span <= kFactorizedSpanMax && b - a > 2) {
    for (int64_t d = 0; d < kp; ++d) r.run[d] = 0.0f;
    for (int64_t i = a; i < b; ++i) {
      if (i > a) {
        for (int64_t d = 0; d < kp; d += kW) {
          VF::store(r.run + d, VF::add(VF::load(r.run + d), VF::load(r.graw + i * kp + d)));
        }
      }
      exp_row(r.run, r.e, kp);
      mul_rows(r.q + i * kp, r.e, r.f1 + i * kp, kp);
      mul_rows(r.k + i * kp, r.e, r.f2 + i * kp, kp);
      for (int64_t d = 0; d < kp; d += kW) {
        VF::store(r.f3 + i * kp + d, VF::div(VF::load(r.k + i * kp + d), VF::load(r.e + d)));
      }
    }
    for (int64_t i = a; i < b; ++i) {
      for (int64_t j = a; j <= i; ++j) {
        if (j < i) r.cl[i * kChunk + j] = r.beta[i] * dot(r.f2 + i * kp, r.f3 + j * kp, kp);
        r.caqk[i * kChunk + j] = dot(r.f1 + i * kp, r.f3 + j * kp, kp);
      }
    }
    return;
  }
  const int64_t m = a + (b - a) / 2;
  ratios_range(r, a, m);
  ratios_range(r, m, b);
  for (int64_t d = 0; d < kp; ++d) r.run[d] = 0.0f;  // sum over (m, i]
  for (int64_t i = m; i < b; ++i) {
    if (i > m) {
      for (int64_t d = 0; d < kp; d += kW) VF::store(r.run + d, VF::add(VF::load(r.run + d), VF::load(r.graw + i * kp + d)));
    }
    exp_row(r.run, r.e, kp);
    mul_rows(r.q + i * kp, r.e, r.f1 + i * kp, kp);
    mul_rows(r.k + i * kp, r.e, r.f2 + i * kp, kp);
  }
  for (int64_t d = 0; d < kp; ++d) r.run[d] = 0.0f;  // sum over (j, m]
  for (int64_t j = m - 1; j >= a; --j) {
    for (int64_t d = 0; d < kp; d += kW) {
      VF::store(r.run + d, VF::add(VF::load(r.run + d), VF::load(r.graw + (j + 1) * kp + d)));
    }
    exp_row(r.run, r.e, kp);
    mul_rows(r.k + j * kp, r.e, r.f3 + j * kp, kp);
  }
  for (int64_t i = m; i < b; ++i) {
    for (int64_t j = a; j < m; ++j) {
      r.cl[i * kChunk + j] = r.beta[i] * dot(r.f2 + i * kp, r.f3 + j * kp, kp);
      r.caqk[i * kChunk + j] = dot(r.f1 + i * kp, r.f3 + j * kp, kp);
    }
  }
}

// One chunk of c <= kChunk tokens starting at t0 (derivation in docs/kda.md).
inline void chunk_step(const HeadCtx& x, int64_t t0, int64_t c, float* s, float* scratch) {
  const ScratchLayout& L = x.lay;
  const int64_t K = x.head_k, kp = L.kp, vp = L.vp;
  constexpr int64_t C = kChunk;
  float *cq = scratch + L.cq, *ck = scratch + L.ck, *cg = scratch + L.cg, *cqg = scratch + L.cqg;
  float *ckg = scratch + L.ckg, *cki = scratch + L.cki, *ckl = scratch + L.ckl, *cv = scratch + L.cv;
  float *cp1 = scratch + L.cp1, *cp2 = scratch + L.cp2, *co = scratch + L.co, *cl = scratch + L.cl;
  float *caqk = scratch + L.caqk, *beta = scratch + L.beta, *bias = scratch + L.bias;
  float *eg_last = scratch + L.alpha, *e = scratch + L.tmp, *ie = scratch + L.ak;
  float *vbad = scratch + L.vbad, *pstart = scratch + L.pstart;

  // Inputs; gc = inclusive cumulative sum of g inside the chunk; the raw g rows are kept in
  // cki for the exact path (overwritten by the factorized path). Non-finite inputs are replaced
  // by 0 (the chunk is computed without them); pstart[j] is the first row from which column j is
  // poisoned and q_bad the rows whose q was non-finite (docs/kda.md, "Non-finite values").
  bool poisoned = false, q_bad[C] = {};
  for (int64_t i = 0; i < c; ++i) {
    float* gi = cg + i * kp;
    TokenPoison p;
    beta[i] = prep_token(x, t0 + i, bias, cq + i * kp, ck + i * kp, cv + i * vp, gi, p, vbad);
    if (p.q || p.whole || p.v) {
      if (!poisoned) fill_row(pstart, static_cast<float>(C), x.head_v);
      poisoned = true;
      q_bad[i] = p.q;
      for (int64_t j = 0; j < x.head_v; ++j) {
        if ((p.whole || (p.v && vbad[j] != 0.0f)) && pstart[j] > static_cast<float>(i)) pstart[j] = static_cast<float>(i);
      }
    }
    for (int64_t d = 0; d < kp; d += kW) VF::store(cki + i * kp + d, VF::load(gi + d));
    if (i > 0) {
      for (int64_t d = 0; d < kp; d += kW) VF::store(gi + d, VF::add(VF::load(gi + d), VF::load(gi - kp + d)));
    }
  }
  const float* glast = cg + (c - 1) * kp;
  float span = 0.0f;
  for (int64_t d = 0; d < K; ++d) span = -glast[d] > span ? -glast[d] : span;
  exp_row(glast, eg_last, kp);
  for (int64_t i = 0; i < C * C; ++i) cl[i] = caqk[i] = 0.0f;

  if (span <= kFactorizedSpanMax) {
    // Gamma_i / Gamma_j factorized: (x_i e^{gc_i}) . (k_j e^{-gc_j}); all factors within e^+-60.
    for (int64_t i = 0; i < c; ++i) {
      exp_row(cg + i * kp, e, kp);
      mul_rows(cq + i * kp, e, cqg + i * kp, kp);
      mul_rows(ck + i * kp, e, ckg + i * kp, kp);
      for (int64_t d = 0; d < kp; d += kW) VF::store(ie + d, VF::div(VF::set1(1.0f), VF::load(e + d)));
      mul_rows(ck + i * kp, ie, cki + i * kp, kp);
      mul_rows(cki + i * kp, eg_last, ckl + i * kp, kp);
    }
    for (int64_t i = 0; i < c; ++i) {
      for (int64_t j = 0; j <= i; ++j) {
        if (j < i) cl[i * C + j] = beta[i] * dot(ckg + i * kp, cki + j * kp, kp);
        caqk[i * C + j] = dot(cqg + i * kp, cki + j * kp, kp);
      }
    }
  } else {
    // A hard reset or a very strong decay inside the chunk: every ratio Gamma_i / Gamma_j is
    // exp(sum of g over (j, i]) <= 1, summed from the raw g rows (not as gc_i - gc_j, which
    // would lose the small terms next to a -1e4 reset to FP32 rounding).
    const float* graw = cki;
    for (int64_t i = 0; i < c; ++i) {
      exp_row(cg + i * kp, e, kp);
      mul_rows(cq + i * kp, e, cqg + i * kp, kp);
      mul_rows(ck + i * kp, e, ckg + i * kp, kp);
    }
    float* r = ie;  // running sum of g over (i, c - 1]
    for (int64_t d = 0; d < kp; ++d) r[d] = 0.0f;
    for (int64_t i = c - 1; i >= 0; --i) {
      exp_row(r, e, kp);
      mul_rows(ck + i * kp, e, ckl + i * kp, kp);
      for (int64_t d = 0; d < kp; d += kW) VF::store(r + d, VF::add(VF::load(r + d), VF::load(graw + i * kp + d)));
    }
    const RatioRows rr{cq, ck, graw, beta, cl, caqk, scratch + L.cr1, scratch + L.cr2, scratch + L.cr3, r, e, kp, K};
    ratios_range(rr, 0, c);
  }

  // (I + L) W = beta k Gamma and (I + L) U = beta v by forward substitution, in place.
  for (int64_t i = 0; i < c; ++i) {
    float* wi = ckg + i * kp;
    float* ui = cv + i * vp;
    scale_row(wi, beta[i], kp);
    scale_row(ui, beta[i], vp);
    for (int64_t j = 0; j < i; ++j) {
      const float lij = cl[i * C + j];
      axpy_neg(lij, ckg + j * kp, wi, kp);
      axpy_neg(lij, cv + j * vp, ui, vp);
    }
  }
  // P1 = W S, P2 = (q Gamma) S; v_new = U - P1 (in place of U); o = P2 + Aqk v_new.
  gemm(c, vp, K, ckg, kp, 1, s, vp, nullptr, 0, nullptr, cp1, vp);
  gemm(c, vp, K, cqg, kp, 1, s, vp, nullptr, 0, nullptr, cp2, vp);
  for (int64_t i = 0; i < c * vp; i += kW) VF::store(cv + i, VF::sub(VF::load(cv + i), VF::load(cp1 + i)));
  // A non-finite v_new comes from the state (a non-finite entry in its column makes W S
  // non-finite in every row) or from an overflow: that column is poisoned from its first such row.
  if (!row_finite(cv, c * vp)) {
    if (!poisoned) fill_row(pstart, static_cast<float>(C), x.head_v);
    poisoned = true;
    for (int64_t j = 0; j < x.head_v; ++j) {
      for (int64_t i = 0; i < c; ++i) {
        if (!std::isfinite(cv[i * vp + j])) {
          if (pstart[j] > static_cast<float>(i)) pstart[j] = static_cast<float>(i);
          break;
        }
      }
    }
  }
  gemm(c, vp, c, caqk, C, 1, cv, vp, cp2, vp, nullptr, co, vp);
  // S = Diag(Gamma_last) S + (k Gamma_last / Gamma)^T v_new
  gemm(K, vp, c, ckl, 1, kp, cv, vp, s, vp, eg_last, s, vp);
  if (poisoned) {
    // Poisoned columns are NaN in the state and in the output rows from their first poisoned
    // row on (the rows before it do not depend on it); rows with a non-finite q are NaN.
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int64_t j = 0; j < x.head_v; ++j) {
      if (pstart[j] >= static_cast<float>(c)) continue;
      for (int64_t i = static_cast<int64_t>(pstart[j]); i < c; ++i) co[i * vp + j] = nan;
      for (int64_t d = 0; d < K; ++d) s[d * vp + j] = nan;
    }
    for (int64_t i = 0; i < c; ++i) {
      if (q_bad[i]) fill_row(co + i * vp, nan, x.head_v);
    }
  }
  for (int64_t i = 0; i < c; ++i) store_out(x, t0 + i, co + i * vp);
}

inline void chunked_impl(const HeadCtx& x, int64_t t0, int64_t t1, float* s, float* scratch) {
  fill_bias(x, scratch + x.lay.bias);
  for (int64_t t = t0; t < t0 + kChunk && t < t1; ++t) prefetch_token(x, t);
  for (int64_t t = t0; t < t1; t += kChunk) {
    // The next chunk's inputs arrive while this chunk computes.
    for (int64_t u = t + kChunk; u < t + 2 * kChunk && u < t1; ++u) prefetch_token(x, u);
    chunk_step(x, t, t1 - t < kChunk ? t1 - t : kChunk, s, scratch);
  }
}

// The commit (KernelTable::commit). DO NOT REORDER: per token, the operations of recurrent_impl
// on the state in its order (alpha k; pass 1 over d ascending; the poison rule; pass 2), each
// state column on its own, so that the state's bits are decode's.
inline void commit_impl(const HeadCtx& x, const float* rows, int64_t tokens, float* s, int64_t lds, int64_t vw,
                        float* scratch, FoldOrder order) {
  const ScratchLayout& L = x.lay;
  float *k = scratch + L.k, *v = scratch + L.v, *alpha = scratch + L.alpha, *ak = scratch + L.ak;
  float* vnew = scratch + L.vnew;
  const int64_t K = x.head_k, V = x.head_v, kp = L.kp, vp = L.vp;
  const int64_t stride = x.num_heads * window_row_floats(x);
  constexpr int64_t kBlock = 4 * kW;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = rows + t * stride;
    load_row(nullptr, row, 0, K, kp, k);
    load_row(nullptr, row, K, K, kp, alpha);
    load_row(nullptr, row, 2 * K, V, vp, v);
    const float beta = row[2 * K + V];
    TokenPoison p;
    p.whole = row[2 * K + V + 1] != 0.0f;
    mul_rows(alpha, k, ak, kp);
    int64_t j = 0;
    if (order == FoldOrder::kDecode) {
      for (; j + kBlock <= vw; j += kBlock) rec_pass1<4>(s, lds, K, j, ak, v, beta, vnew);
      for (; j < vw; j += kW) rec_pass1<1>(s, lds, K, j, ak, v, beta, vnew);
    } else {
      for (; j < vw; j += kW) rec_pass1<1, true>(s, lds, K, j, ak, v, beta, vnew);
    }
    poison_vnew(x, p, vnew, vw);
    j = 0;
    for (; j + kBlock <= vw; j += kBlock) rec_pass2_state<4>(s, lds, K, j, alpha, k, vnew);
    for (; j < vw; j += kW) rec_pass2_state<1>(s, lds, K, j, alpha, k, vnew);
  }
}

inline const KernelTable& table() {
  static const KernelTable kTable{recurrent_impl, chunked_impl, commit_impl};
  return kTable;
}
