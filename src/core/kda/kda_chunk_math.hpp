// The per-chunk math of the CUDA chunked KDA prefill (src/cuda/kda/kda_chunked.cu), written once
// for the device and for a host emulation that runs the same phase functions without a GPU
// (tests/core/test_kda_chunk_math.cpp). Internal. The kernel using it ran on an H200 (2026-12-04).
//
// One thread block owns kVt = 32 state columns of one head of one sequence and walks the
// sequence in chunks of kC = 16 tokens (docs/kda.md, "CUDA chunked prefill"). The chunk's rows
// live in shared memory (View); a chunk is a fixed sequence of phases separated by block
// barriers (chunk_compute). Each phase is either
//   - a column phase: independent work items (a column d of the K side, a state column j ...),
//     run by thread tid for items tid, tid + kThreads, ... on a device, one after another on the
//     host; or
//   - a tile phase: m16n8 output tiles of a tensor-core product, tile t on warp t % kWarps. On a
//     device the 32 lanes of the warp call mma_tile together; on the host mma_tile is called once
//     per tile and emulates the 32 lanes from the same fragment maps.
// No phase reads what another item of the same phase writes, so the host's sequential order
// computes what the device computes (up to the tensor core's FP32 accumulation order).
//
// Precision: every product runs as 3xTF32 (x = big + small, both TF32; a b ~ a_s b_b + a_b b_s +
// a_b b_b, FP32 accumulation): close to FP32 accuracy, so the FP32-input case meets the 1e-4
// err_ratio bound and BF16 inputs need no separate path.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/kda/kda_math.hpp"
#include "k3/config.hpp"

// Full unrolling on the device (register arrays indexed by loop counters stay in registers);
// nothing on the host, whose compiler would warn about the pragma.
#if defined(__CUDA_ARCH__)
#define K3_CHUNK_UNROLL _Pragma("unroll")
#else
#define K3_CHUNK_UNROLL
#endif

namespace k3::kda::chunk {

inline constexpr int kC = 16;        // tokens per chunk (= kda::kChunk)
inline constexpr int kVt = 32;       // state columns per block
inline constexpr int kWarps = 4;     // warps per block
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kLdV = kVt + 8;  // row stride of [.., kVt] tiles (B fragments without bank conflicts)
inline constexpr int kLdM = kC + 4;   // row stride of the 16 x 16 matrices L and Aqk
inline constexpr int kAllLanes = -1;  // mma_tile on the host: all 32 lanes at once
// Largest chunk span max_d(-sum g) for which the ratios Gamma_i / Gamma_j are factorized as
// (x_i e^{gc_i}) . (k_j e^{-gc_j}) (the CPU's kFactorizedSpanMax, docs/kda.md).
inline constexpr float kSpanMax = 60.0f;
// rowflag bits
inline constexpr int kRowQBad = 1;   // the row's q was non-finite: its output row is NaN
inline constexpr int kRowWhole = 2;  // k, beta or g poisoned the write: every column from this row

static_assert(kC == kda::kChunk, "the CUDA chunk is the CPU chunk");
static_assert(kVt == 32, "vbad holds one bit per tile column in a uint32");

// K rounded up to the m16 tile of the state update.
K3_HOST_DEVICE constexpr int padded_k(int k) { return (k + 15) / 16 * 16; }

// Shared-memory layout (in floats) for head dim K; every region 16-byte aligned.
struct Layout {
  int kp = 0, ldk = 0, ldl = 0;
  int s = 0, q = 0, k = 0, g = 0, qg = 0, wk = 0, fg = 0, fq = 0, fk = 0, vs = 0, lm = 0, am = 0, eg = 0, bias = 0,
      beta = 0, rowflag = 0, vbad = 0, pstart = 0;
  int floats = 0;
};

K3_HOST_DEVICE constexpr int round4(int x) { return (x + 3) / 4 * 4; }
K3_HOST_DEVICE constexpr int imax(int a, int b) { return a > b ? a : b; }

K3_HOST_DEVICE constexpr Layout layout(int k) {
  Layout l;
  l.kp = padded_k(k);
  l.ldk = l.kp + 4;  // A / B fragment rows of [16, kp] tiles: banks 4 g + t, no conflict
  l.ldl = l.kp + 8;  // kl read column-major in the update: banks 8 t + g
  int at = 0;
  auto take = [&at](int n) {
    const int o = at;
    at += round4(n);
    return o;
  };
  const int rows = kC * l.ldk;
  l.s = take(l.kp * kLdV);  // S [kp, kLdV] the state slice, FP32
  l.q = take(rows);         // [16, ldk] normalized, scaled q (sanitized)
  l.k = take(rows);         // [16, ldk] normalized k (sanitized)
  l.g = take(rows);         // [16, ldk] log decay (sanitized, padding rows 0)
  l.qg = take(rows);        // q e^{gc}
  l.wk = take(rows);        // beta k e^{gc}, then W (forward substitution in place)
  l.fg = take(rows);        // j-side factor rows
  l.fq = take(imax(rows, kC * l.ldl));  // i-side q factors; then kl = k e^{gc_last - gc} [16, ldl]
  l.fk = take(imax(rows, kC * kLdV));   // i-side beta k factors; then os = the output tile [16, kLdV]
  l.vs = take(kC * kLdV);   // v, then U, then v_new
  l.lm = take(kC * kLdM);   // L (strictly lower)
  l.am = take(kC * kLdM);   // Aqk (lower with diagonal)
  l.eg = take(l.kp);        // e^{gc_last}
  l.bias = take(l.kp);      // dt_bias row (gated modes)
  l.beta = take(kC);
  l.rowflag = take(kC);     // int
  l.vbad = take(kC);        // uint32: bit j = v[i, j] was non-finite
  l.pstart = take(kVt);     // int: first poisoned row of column j (kC: none)
  l.floats = at;
  return l;
}

inline constexpr int64_t smem_bytes(int k) { return int64_t{layout(k).floats} * 4; }

// Pointers into one block's shared memory, and the chunk's token count c (1..16).
struct View {
  int kp = 0, ldk = 0, ldl = 0, c = 0;
  float *S, *q, *k, *g, *qg, *wk, *fg, *fq, *kl, *fk, *os, *vs, *lm, *am, *eg, *bias, *beta;
  int *rowflag, *pstart;
  uint32_t* vbad;
};

K3_HOST_DEVICE inline View make_view(float* base, int k) {
  const Layout l = layout(k);
  View v;
  v.kp = l.kp;
  v.ldk = l.ldk;
  v.ldl = l.ldl;
  v.S = base + l.s;
  v.q = base + l.q;
  v.k = base + l.k;
  v.g = base + l.g;
  v.qg = base + l.qg;
  v.wk = base + l.wk;
  v.fg = base + l.fg;
  v.fq = base + l.fq;
  v.kl = base + l.fq;  // alias: fq is dead once the level products are done
  v.fk = base + l.fk;
  v.os = base + l.fk;  // alias: fk is dead once the level products are done
  v.vs = base + l.vs;
  v.lm = base + l.lm;
  v.am = base + l.am;
  v.eg = base + l.eg;
  v.bias = base + l.bias;
  v.beta = base + l.beta;
  v.rowflag = reinterpret_cast<int*>(base + l.rowflag);
  v.vbad = reinterpret_cast<uint32_t*>(base + l.vbad);
  v.pstart = reinterpret_cast<int*>(base + l.pstart);
  return v;
}

// ---- 3xTF32 -------------------------------------------------------------------------------------

K3_HOST_DEVICE inline uint32_t f2u(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}
K3_HOST_DEVICE inline float u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

// x rounded to TF32 (10 explicit mantissa bits, the low 13 bits zero), to nearest with ties away
// from zero, as cvt.rna.tf32.f32; Inf and NaN pass unchanged. The same bits on host and device.
K3_HOST_DEVICE inline uint32_t tf32_bits(float x) {
  const uint32_t u = f2u(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return u;
  return (u + 0x1000u) & 0xffffe000u;
}

// x = big + small with both TF32 (small = the rounding error of big, exact in FP32). A
// non-finite x gives a NaN small part, so a product with it is NaN (never a silent finite value).
K3_HOST_DEVICE inline void split_tf32(float x, uint32_t& big, uint32_t& small) {
  big = tf32_bits(x);
  small = tf32_bits(x - u2f(big));
}

K3_HOST_DEVICE inline bool finite(float x) { return x - x == 0.0f; }

// ---- mma.sync.m16n8k8 (TF32 in, FP32 accumulate) fragment maps (PTX ISA, "Matrix fragments for
// mma.m16n8k8", .tf32): lane = 4 group + tig. A 16 x 8 row-major: a[r] at row group + 8 (r & 1),
// column tig + 4 (r >> 1). B 8 x 8 "col": b[r] at k = tig + 4 r, n = group. C / D 16 x 8:
// c[r] at row group + 8 (r >> 1), column 2 tig + (r & 1).
K3_HOST_DEVICE constexpr int a_row(int lane, int r) { return (lane >> 2) + 8 * (r & 1); }
K3_HOST_DEVICE constexpr int a_col(int lane, int r) { return (lane & 3) + 4 * (r >> 1); }
K3_HOST_DEVICE constexpr int b_row(int lane, int r) { return (lane & 3) + 4 * r; }
K3_HOST_DEVICE constexpr int b_col(int lane, int /*r*/) { return lane >> 2; }
K3_HOST_DEVICE constexpr int c_row(int lane, int r) { return (lane >> 2) + 8 * (r >> 1); }
K3_HOST_DEVICE constexpr int c_col(int lane, int r) { return 2 * (lane & 3) + (r & 1); }

#if defined(__CUDA_ARCH__)
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#else
// Host emulation of one mma over the 32 lanes' fragments: the A and B tiles are rebuilt from the
// fragments through the maps above, the products of TF32 values are exact in FP32.
inline void emulate_mma(float (&d)[32][4], const uint32_t (&a)[32][4], const uint32_t (&b)[32][2]) {
  float at[16][8] = {}, bt[8][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    for (int r = 0; r < 4; ++r) at[a_row(lane, r)][a_col(lane, r)] = u2f(a[lane][r]);
    for (int r = 0; r < 2; ++r) bt[b_row(lane, r)][b_col(lane, r)] = u2f(b[lane][r]);
  }
  for (int lane = 0; lane < 32; ++lane) {
    for (int r = 0; r < 4; ++r) {
      float acc = d[lane][r];
      for (int p = 0; p < 8; ++p) acc += at[c_row(lane, r)][p] * bt[p][c_col(lane, r)];
      d[lane][r] = acc;
    }
  }
}
#endif

// One 16 x 8 output tile: D(r, n) = init(r, n) + sum_{p < kdim} a(r, p) b(p, n), kdim a multiple
// of 8, in 3xTF32; then out(r, n, D) for every element. On a device every lane of the warp calls
// it with its lane (warp-collective); on the host, once with kAllLanes.
template <class A, class B, class Init, class Out>
K3_HOST_DEVICE inline void mma_tile([[maybe_unused]] int lane, int kdim, A a, B b, Init init, Out out) {
#if defined(__CUDA_ARCH__)
  float d[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) d[r] = init(c_row(lane, r), c_col(lane, r));
  for (int k0 = 0; k0 < kdim; k0 += 8) {
    uint32_t ab[4], as[4], bb[2], bs[2];
#pragma unroll
    for (int r = 0; r < 4; ++r) split_tf32(a(a_row(lane, r), k0 + a_col(lane, r)), ab[r], as[r]);
#pragma unroll
    for (int r = 0; r < 2; ++r) split_tf32(b(k0 + b_row(lane, r), b_col(lane, r)), bb[r], bs[r]);
    mma_tf32(d, as, bb);  // small terms first
    mma_tf32(d, ab, bs);
    mma_tf32(d, ab, bb);
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) out(c_row(lane, r), c_col(lane, r), d[r]);
#else
  float d[32][4];
  for (int l = 0; l < 32; ++l) {
    for (int r = 0; r < 4; ++r) d[l][r] = init(c_row(l, r), c_col(l, r));
  }
  for (int k0 = 0; k0 < kdim; k0 += 8) {
    uint32_t ab[32][4], as[32][4], bb[32][2], bs[32][2];
    for (int l = 0; l < 32; ++l) {
      for (int r = 0; r < 4; ++r) split_tf32(a(a_row(l, r), k0 + a_col(l, r)), ab[l][r], as[l][r]);
      for (int r = 0; r < 2; ++r) split_tf32(b(k0 + b_row(l, r), b_col(l, r)), bb[l][r], bs[l][r]);
    }
    emulate_mma(d, as, bb);
    emulate_mma(d, ab, bs);
    emulate_mma(d, ab, bb);
  }
  for (int l = 0; l < 32; ++l) {
    for (int r = 0; r < 4; ++r) out(c_row(l, r), c_col(l, r), d[l][r]);
  }
#endif
}

K3_HOST_DEVICE inline void sync_warp() {
#if defined(__CUDA_ARCH__)
  __syncwarp();
#endif
}

// ---- phases ---------------------------------------------------------------------------------------
// Inputs staged by the caller for rows i < 16 (rows >= c all zero): q (L2-normalized and scaled,
// non-finite rows zeroed), k (normalized; zero for a poisoned write), g (the clamped log decay;
// zero for a poisoned write), beta (0 for a poisoned write), vs = v (non-finite entries zeroed),
// rowflag / vbad (what was poisoned), and the state S.

// Column d < kp: qg = q e^{gc}, wk = beta k e^{gc}, fg = k e^{-gc} (used when the chunk is
// factorized), eg = e^{gc_last}; zeroes column d of L and Aqk (d < 16). Returns whether the
// chunk's span in this column is above kSpanMax (strong decay: the ratios go through the tree).
K3_HOST_DEVICE inline bool prep_column(const View& s, int d) {
  const int ldk = s.ldk;
  float run = 0.0f, e = 1.0f;
  for (int i = 0; i < kC; ++i) {
    run += s.g[i * ldk + d];
    e = detail::gate_exp(run);
    s.qg[i * ldk + d] = s.q[i * ldk + d] * e;
    s.wk[i * ldk + d] = s.beta[i] * s.k[i * ldk + d] * e;
    s.fg[i * ldk + d] = s.k[i * ldk + d] / e;  // only read when -run <= kSpanMax (e >= e^-60)
  }
  s.eg[d] = e;
  if (d < kC) {
    for (int i = 0; i < kC; ++i) s.lm[i * kLdM + d] = s.am[i * kLdM + d] = 0.0f;
  }
  return -run > kSpanMax;
}

// Strong decay (span above kSpanMax): the pairs j < i are split over a binary tree of the 16
// rows. At level lv (0..3) the blocks have B = 16 >> lv rows; in a block starting at b0 with
// middle m = b0 + B / 2 the cross pairs j < m <= i get Gamma_i / Gamma_j =
// e^{sum_{s=m+1..i} g_s} e^{sum_{s=j+1..m} g_s}: both factors are exponentials of running sums of
// raw g rows (never a difference of cumulative sums, which would lose small terms next to a -1e4
// reset), each <= 1 for decays. Level 4 is the diagonal of Aqk (q_i . k_i). The CPU recurses only
// into ranges above the span bound (docs/kda.md); the GPU always takes the whole tree for such a
// chunk: the same exact products, fewer branches. Column d of the factor rows of level lv:
K3_HOST_DEVICE inline void tree_factor_column(const View& s, int lv, int d) {
  const int ldk = s.ldk;
  if (lv == 4) {
    for (int i = 0; i < kC; ++i) {
      s.fq[i * ldk + d] = s.q[i * ldk + d];
      s.fk[i * ldk + d] = 0.0f;
      s.fg[i * ldk + d] = s.k[i * ldk + d];
    }
    return;
  }
  const int B = kC >> lv, h = B / 2;
  for (int b0 = 0; b0 < kC; b0 += B) {
    const int m = b0 + h;
    float run = 0.0f;
    for (int i = m; i < b0 + B; ++i) {  // i side
      if (i > m) run += s.g[i * ldk + d];
      const float e = detail::gate_exp(run);
      s.fq[i * ldk + d] = s.q[i * ldk + d] * e;
      s.fk[i * ldk + d] = s.beta[i] * s.k[i * ldk + d] * e;
      s.fg[i * ldk + d] = 0.0f;
    }
    run = 0.0f;
    for (int j = m - 1; j >= b0; --j) {  // j side
      run += s.g[(j + 1) * ldk + d];
      s.fg[j * ldk + d] = s.k[j * ldk + d] * detail::gate_exp(run);
      s.fq[j * ldk + d] = 0.0f;
      s.fk[j * ldk + d] = 0.0f;
    }
  }
}

// Which entries (i, j) of L (aqk = false) or Aqk (aqk = true) level lv produces; -1 is the
// factorized chunk (all of them at once).
K3_HOST_DEVICE constexpr bool level_keeps(int lv, bool aqk, int i, int j) {
  if (lv < 0) return aqk ? j <= i : j < i;
  if (lv == 4) return aqk && i == j;
  const int B = kC >> lv, h = B / 2;
  return i / B == j / B && i % B >= h && j % B < h;
}

// Tile t < 4 of level lv: t >> 1 selects L (0) or Aqk (1), t & 1 the 8 columns j. L[i][j] =
// (beta_i k_i factor) . (k_j factor), Aqk[i][j] = (q_i factor) . (k_j factor), over d < kp.
K3_HOST_DEVICE inline void level_product_tile(const View& s, int lv, int t, int lane) {
  const bool aqk = (t >> 1) != 0;
  const int n0 = (t & 1) * 8, ldk = s.ldk;
  const float* a = lv < 0 ? (aqk ? s.qg : s.wk) : (aqk ? s.fq : s.fk);
  const float* fg = s.fg;
  float* dst = aqk ? s.am : s.lm;
  mma_tile(
      lane, s.kp, [=](int r, int p) { return a[r * ldk + p]; }, [=](int p, int n) { return fg[(n0 + n) * ldk + p]; },
      [](int, int) { return 0.0f; },
      [=](int i, int n, float v) {
        if (level_keeps(lv, aqk, i, n0 + n)) dst[i * kLdM + n0 + n] = v;
      });
}

// Column item x < kp + kVt: forward substitution (I + L) W = beta k Gamma (x = d < kp, in place
// of wk) or (I + L) U = beta v (x = kp + j, in place of vs), in the CPU's order; for d < kp also
// kl = k e^{gc_last - gc} with the exponent a running sum from the end (exact for any decay).
K3_HOST_DEVICE inline void substitute_column(const View& s, int x) {
  const bool wcol = x < s.kp;
  float* col = wcol ? s.wk + x : s.vs + (x - s.kp);
  const int ld = wcol ? s.ldk : kLdV;
  float y[kC];
  K3_CHUNK_UNROLL
  for (int i = 0; i < kC; ++i) y[i] = wcol ? col[i * ld] : s.beta[i] * col[i * ld];
  K3_CHUNK_UNROLL
  for (int i = 1; i < kC; ++i) {
    float acc = y[i];
    K3_CHUNK_UNROLL
    for (int j = 0; j < i; ++j) acc -= s.lm[i * kLdM + j] * y[j];
    y[i] = acc;
  }
  K3_CHUNK_UNROLL
  for (int i = 0; i < kC; ++i) col[i * ld] = y[i];
  if (wcol) {
    const int d = x;
    float run = 0.0f;
    for (int j = kC - 1; j >= 0; --j) {
      s.kl[j * s.ldl + d] = s.k[j * s.ldk + d] * detail::gate_exp(run);
      run += s.g[j * s.ldk + d];
    }
  }
}

// Tile nt < kVt / 8 (columns 8 nt ..): v_new = U - W S (in place of U), o = (q Gamma) S + Aqk v_new.
// The Aqk product reads v_new of the same 8 columns only, written by this warp: a warp barrier.
K3_HOST_DEVICE inline void output_tile(const View& s, int nt, int lane) {
  const int n0 = nt * 8, ldk = s.ldk;
  const float* S = s.S;
  const float* wk = s.wk;
  const float* qg = s.qg;
  const float* am = s.am;
  float* vs = s.vs;
  float* os = s.os;
  auto b_state = [=](int p, int n) { return S[p * kLdV + n0 + n]; };
  auto zero = [](int, int) { return 0.0f; };
  mma_tile(
      lane, s.kp, [=](int r, int p) { return wk[r * ldk + p]; }, b_state, zero,
      [=](int i, int n, float v) { vs[i * kLdV + n0 + n] -= v; });
  mma_tile(
      lane, s.kp, [=](int r, int p) { return qg[r * ldk + p]; }, b_state, zero,
      [=](int i, int n, float v) { os[i * kLdV + n0 + n] = v; });
  sync_warp();
  mma_tile(
      lane, kC, [=](int r, int p) { return am[r * kLdM + p]; }, [=](int p, int n) { return vs[p * kLdV + n0 + n]; },
      [=](int i, int n) { return os[i * kLdV + n0 + n]; }, [=](int i, int n, float v) { os[i * kLdV + n0 + n] = v; });
}

// Column j < kVt: the first poisoned row of the chunk (kC: none): a poisoned write (k, beta, g),
// a non-finite v[i, j], or a non-finite v_new[i, j] (from the state, or an overflow).
K3_HOST_DEVICE inline void poison_column(const View& s, int j) {
  int p = kC;
  for (int i = 0; i < s.c; ++i) {
    if ((s.rowflag[i] & kRowWhole) != 0 || ((s.vbad[i] >> j) & 1u) != 0 || !finite(s.vs[i * kLdV + j])) {
      p = i;
      break;
    }
  }
  s.pstart[j] = p;
}

// Tile t < (kp / 16) * (kVt / 8): S <- Diag(e^{gc_last}) S + kl^T v_new on rows 16 (t / 4) ..,
// columns 8 (t % 4) ..; every element read and written by the lane that owns it.
K3_HOST_DEVICE inline void update_tile(const View& s, int t, int lane) {
  const int m0 = (t / (kVt / 8)) * 16, n0 = (t % (kVt / 8)) * 8, ldl = s.ldl;
  float* S = s.S;
  const float* kl = s.kl;
  const float* vs = s.vs;
  const float* eg = s.eg;
  mma_tile(
      lane, kC, [=](int r, int p) { return kl[p * ldl + m0 + r]; }, [=](int p, int n) { return vs[p * kLdV + n0 + n]; },
      [=](int r, int n) { return eg[m0 + r] * S[(m0 + r) * kLdV + n0 + n]; },
      [=](int r, int n, float v) { S[(m0 + r) * kLdV + n0 + n] = v; });
}

// Item x < kp * kVt: a state column poisoned in this chunk becomes NaN (sticky: later chunks see
// a NaN v_new in it from their first row).
K3_HOST_DEVICE inline void poison_state(const View& s, int x) {
  const int d = x / kVt, j = x % kVt;
  if (s.pstart[j] < s.c) s.S[d * kLdV + j] = u2f(0x7fc00000u);
}

// The chunk after staging, in barrier-separated phases (Exec: the device's block or the host's
// sequential emulation). On return os holds the output rows (before the poison rules of the
// store: rows i >= pstart[j] and q-bad rows are NaN), S the state after the chunk.
template <class Exec>
K3_HOST_DEVICE inline void chunk_compute(const View& s, Exec& ex) {
  const bool strong = ex.columns_or(s.kp, [&](int d) { return prep_column(s, d); });  // + barrier
  if (!strong) {
    ex.tiles(4, [&](int t, int lane) { level_product_tile(s, -1, t, lane); });
    ex.sync();
  } else {
    for (int lv = 0; lv <= 4; ++lv) {
      ex.columns(s.kp, [&](int d) { tree_factor_column(s, lv, d); });
      ex.sync();
      ex.tiles(4, [&](int t, int lane) { level_product_tile(s, lv, t, lane); });
      ex.sync();
    }
  }
  ex.columns(s.kp + kVt, [&](int x) { substitute_column(s, x); });
  ex.sync();
  ex.tiles(kVt / 8, [&](int t, int lane) { output_tile(s, t, lane); });
  ex.sync();
  ex.columns(kVt, [&](int j) { poison_column(s, j); });  // reads vs; the update reads vs, writes S
  ex.tiles((s.kp / 16) * (kVt / 8), [&](int t, int lane) { update_tile(s, t, lane); });
  ex.sync();
  ex.columns(s.kp * kVt, [&](int x) { poison_state(s, x); });
}

#if !defined(__CUDA_ARCH__)
// The host's emulation of a block: items one after another, tiles with all lanes at once.
struct HostExec {
  template <class F>
  bool columns_or(int n, F f) {
    bool any = false;
    for (int i = 0; i < n; ++i) any = f(i) || any;
    return any;
  }
  template <class F>
  void columns(int n, F f) {
    for (int i = 0; i < n; ++i) f(i);
  }
  template <class F>
  void tiles(int n, F f) {
    for (int t = 0; t < n; ++t) f(t, kAllLanes);
  }
  void sync() {}
};
#endif

}  // namespace k3::kda::chunk
