// The FP32 linear kernels (stream and panel), written once and compiled for AVX2 + FMA
// (kernels_avx2.cpp, 8-lane YMM) and AVX-512 (kernels_avx512.cpp, 16-lane ZMM). The including
// file defines K3_LIN_TARGET, K3_LIN_NS, the vector type `vf`, kVw (lanes per vector), and
// zero(), fmadd(), bcast(), load(), store(), decode_quad(), times_2p112(), decode16_bf16() and
// scales16() (kernels.hpp: operands). Template parameter B16: BF16 weights (W16A16; 2 bytes per
// weight, decode16_bf16: a 16-bit shift widens them exactly; x' = x), else E4M3 codes; X120: the
// stream kernels' w 2^-120 with x' = x 2^120 (Operand::x120), else w 2^-8 with x' = x 2^8.
//
// Order of operations (identical to tile_portable, hence to linear_reference): per output
// column, per 32-element block a partial sum from +0 over the stored k order (1, 0, 3, 2, ...),
// one FMA per product; then total = fma(partial, 2^(s-127), total); blocks in order. Columns are
// vector lanes, so vectorizing keeps every column's order.
//
// decode_quad: kVw columns x 4 stored k of the FP32 layout (one 32-bit word per column, byte s =
// stored k 4q + s) -> 4 vectors of w 2^-120 (vector s: stored k 4q + s); quad_split and
// quad_slot are its two halves. Per 16-bit word, an arithmetic shift right by 4 of the high
// byte's code (after a byte shift left by 1 for the low byte's) gives sign copies, then the
// code's sign, exponent and mantissa bits where FP32 has them once the word is the high half of a
// 32-bit lane (a byte shift left by 2 moves a low half there); a mask clears the sign copies and
// the neighbours' bits. Without VCVTPH2PS or byte widening, this leaves the shuffle port mostly
// free for the stream.

namespace k3::cpu::lin::K3_LIN_NS {
namespace {

constexpr int kNv = kLanes / kVw;  // vectors per tile
constexpr int64_t kAhead = 4;      // blocks of software prefetch ahead of the stream
template <bool B16>
constexpr int64_t kEb = B16 ? 2 : 1;  // bytes per weight

constexpr int64_t kQuadBytes = int64_t{kLanes} * 4;  // 4 stored k x 16 columns of E4M3 codes

// Four stored k (quad q of a block) of E4M3 codes for G tiles and R rows, into acc.
template <int R, int G, bool X120>
K3_LIN_TARGET __attribute__((always_inline)) inline void stream_quad(const uint8_t* const* codes, const float* const* xr,
                                                                     int q, vf (&acc)[R][G * kNv]) {
  if constexpr ((R >= 3 || (R == 2 && kNv == 2)) && G * kNv == 2) {
    // Both vectors' codes split first, each k's weights made just before their FMAs and each
    // broadcast shared by the two vectors (the FMA-bound row counts; 4 rows fit AVX2's registers;
    // on AVX2 also 2 rows of one tile: BM_LinearDecodeCached/rows:2 at K3_ISA=avx2 on the Zen 4
    // guest 34 against 37-43 us with two tiles on the general path).
    vi hi[2], lo[2];
    for (int g = 0; g < G; ++g)
      for (int v = 0; v < kNv; ++v) quad_split(codes[g] + q * kQuadBytes + v * kVw * 4, hi[g * kNv + v], lo[g * kNv + v]);
    for (int s = 0; s < 4; ++s) {
      vf w2[2];
      for (int j = 0; j < 2; ++j) {
        w2[j] = quad_slot(hi[j], lo[j], s);
        if constexpr (!X120) w2[j] = times_2p112(w2[j]);
      }
      for (int r = 0; r < R; ++r) {
        const vf b = bcast(xr[r] + 4 * q + s);
        for (int j = 0; j < 2; ++j) acc[r][j] = fmadd(w2[j], b, acc[r][j]);
      }
    }
    asm volatile("" ::: "memory");
    return;
  }
  // AVX2, one row: the quad's 4 broadcasts loaded once and shared by the G * 2 vectors (AVX2 has
  // no embedded broadcast, so each FMA would load its own; AVX-512 folds it into the FMA).
  // BM_LinearDecodeCached at K3_ISA=avx2 on the Zen 4 guest: 21-23 against 25-30 us (three
  // alternated runs; docs/linear.md).
  constexpr bool kShared = R == 1 && kNv == 2;
  vf b[4];
  if constexpr (kShared)
    for (int s = 0; s < 4; ++s) b[s] = bcast(xr[0] + 4 * q + s);
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < kNv; ++v) {
      vf w4[4];
      decode_quad(codes[g] + q * kQuadBytes + v * kVw * 4, w4);
      if constexpr (!X120)
        for (int s = 0; s < 4; ++s) w4[s] = times_2p112(w4[s]);
      for (int s = 0; s < 4; ++s)  // rows innermost: R independent chains between dependent FMAs
        for (int r = 0; r < R; ++r)
          acc[r][g * kNv + v] = fmadd(w4[s], kShared ? b[s] : bcast(xr[r] + 4 * q + s), acc[r][g * kNv + v]);
      // Otherwise each broadcast is loaded where it is used: without this barrier GCC kept the 4R
      // broadcasts of the quad for every (g, v) and the widened codes of later quads in
      // registers, and spilled accumulators (R >= 2 on AVX2). The accumulators are registers,
      // not memory (stream_block: at most 12), so the barrier costs nothing else.
      if constexpr (!kShared) asm volatile("" ::: "memory");
    }
}

// One block of G tiles for R rows: acc[r][g * kNv + v] = partial sums (from +0). The
// accumulators are a local array copied out at the end: accumulating into the caller's array
// made GCC store every accumulator to the stack on every k (4 stores per k at M = 1 on AVX2).
template <int R, int G, bool B16, bool X120>
K3_LIN_TARGET inline void stream_block(const uint8_t* const* codes, const float* const* xr, vf (&out)[R][G * kNv]) {
  vf acc[R][G * kNv];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < G * kNv; ++v) acc[r][v] = zero();
  if constexpr (B16) {
#pragma GCC unroll 4
    for (int k = 0; k < kBlock; ++k) {
      vf xb[R];
      for (int r = 0; r < R; ++r) xb[r] = bcast(xr[r] + k);
      for (int g = 0; g < G; ++g) {
        vf wv[kNv];
        decode16_bf16(codes[g] + k * kLanes * 2, wv);
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < kNv; ++v) acc[r][g * kNv + v] = fmadd(wv[v], xb[r], acc[r][g * kNv + v]);
      }
    }
  } else {
    // E4M3: the whole block unrolled (a rolled loop kept a copy of every accumulator on the
    // stack, stored on each pass). At most 12 accumulators (the callers choose G): with more,
    // GCC kept them on the stack.
    static_assert(R * G * kNv <= 12, "stream_block: at most 12 accumulators");
#pragma GCC unroll 8
    for (int q = 0; q < kBlock / 4; ++q) stream_quad<R, G, X120>(codes, xr, q, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < G * kNv; ++v) out[r][v] = acc[r][v];
}

// Tiles [t_begin, t_end) (a multiple of G of them) for rows [r0, r0 + R). tot: row r at
// tot + r * ldt, column of tile t at (t - t_base) * 16.
template <int R, int G, bool B16, bool X120>
K3_LIN_TARGET void stream_rows(const PackedLinear& w, const Operand& x, int r0, int64_t t_begin, int64_t t_end,
                               int64_t t_base, float* tot, int64_t ldt) {
  const int64_t k_dim = w.k(), blocks = k_dim / kBlock;
  for (int64_t t = t_begin; t < t_end; t += G) {
    float* trow[R];
    for (int r = 0; r < R; ++r) {
      trow[r] = tot + static_cast<int64_t>(r0 + r) * ldt + (t - t_base) * kLanes;
      for (int c = 0; c < G * kLanes; ++c) trow[r][c] = 0.0f;
    }
    const uint8_t* tc[G];
    const uint8_t* ts[G];
    for (int g = 0; g < G; ++g) {
      tc[g] = w.tile_codes(t + g);
      ts[g] = w.tile_scales(t + g);
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* codes[G];
      for (int g = 0; g < G; ++g) {
        codes[g] = tc[g] + b * (kBlock * kLanes * kEb<B16>);
        prefetch_stream_ahead(w, tc[g], ts[g], b, blocks, t + G + g, t_end, kBlock * kLanes * kEb<B16>, kAhead);
      }
      const float* xr[R];
      for (int r = 0; r < R; ++r) xr[r] = x.xs + static_cast<int64_t>(r0 + r) * x.ldx + b * kBlock;
      vf acc[R][G * kNv];
      stream_block<R, G, B16, X120>(codes, xr, acc);
      for (int g = 0; g < G; ++g) {
        vf sc[kNv];
        scales16(ts[g] + b * kLanes, sc);
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < kNv; ++v) {
            float* p = trow[r] + g * kLanes + v * kVw;
            store(p, fmadd(acc[r][g * kNv + v], sc[v], load(p)));
          }
      }
    }
  }
}

template <int R, int G, bool B16, bool X120>
K3_LIN_TARGET void stream_range(const PackedLinear& w, const Operand& x, int r0, int64_t t0, int64_t t1, float* tot,
                                int64_t ldt) {
  const int64_t full = t0 + (t1 - t0) / G * G;
  if (full > t0) stream_rows<R, G, B16, X120>(w, x, r0, t0, full, t0, tot, ldt);
  if (full < t1) stream_rows<R, 1, B16, X120>(w, x, r0, full, t1, t0, tot, ldt);
}

// Panel: blocks [b0, b0 + nb) of one tile expanded to w' FP32 (E4M3: w 2^-8), [block][k][16 columns].
template <bool B16>
K3_LIN_TARGET void build_panel(const uint8_t* codes, int64_t b0, int64_t nb, float* panel) {
  for (int64_t bb = 0; bb < nb; ++bb) {
    if constexpr (B16) {
      for (int k = 0; k < kBlock; ++k) {
        vf wv[kNv];
        decode16_bf16(codes + ((b0 + bb) * kBlock + k) * kLanes * 2, wv);
        for (int v = 0; v < kNv; ++v) store(panel + (bb * kBlock + k) * kLanes + v * kVw, wv[v]);
      }
    } else {
      for (int q = 0; q < kBlock / 4; ++q)
        for (int v = 0; v < kNv; ++v) {
          vf w4[4];
          decode_quad(codes + (b0 + bb) * kBlock * kLanes + q * kQuadBytes + v * kVw * 4, w4);
          for (int s = 0; s < 4; ++s) store(panel + (bb * kBlock + 4 * q + s) * kLanes + v * kVw, times_2p112(w4[s]));
        }
    }
  }
}

template <int R>
K3_LIN_TARGET void panel_rows(const float* panel, const uint8_t* scales, const Operand& x, int64_t k_dim, int r0,
                              int64_t b0, int64_t nb, float* tot) {
  (void)k_dim;
  for (int64_t bb = 0; bb < nb; ++bb) {
    vf acc[R][kNv];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kNv; ++v) acc[r][v] = zero();
    const float* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = x.xs + static_cast<int64_t>(r0 + r) * x.ldx + (b0 + bb) * kBlock;
    const float* pw = panel + bb * kBlock * kLanes;
#pragma GCC unroll 4
    for (int k = 0; k < kBlock; ++k) {
      vf wv[kNv];
      for (int v = 0; v < kNv; ++v) wv[v] = load(pw + k * kLanes + v * kVw);
      for (int r = 0; r < R; ++r) {
        const vf xb = bcast(xr[r] + k);
        for (int v = 0; v < kNv; ++v) acc[r][v] = fmadd(wv[v], xb, acc[r][v]);
      }
    }
    vf sc[kNv];
    scales16(scales + (b0 + bb) * kLanes, sc);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kNv; ++v) {
        float* p = tot + static_cast<int64_t>(r0 + r) * kLanes + v * kVw;
        store(p, fmadd(acc[r][v], sc[v], load(p)));
      }
  }
}

template <int R>
K3_LIN_TARGET void panel_dispatch(int rr, const float* panel, const uint8_t* scales, const Operand& x, int64_t k_dim,
                                  int r0, int64_t b0, int64_t nb, float* tot) {
  if constexpr (R > 1) {
    if (rr < R) return panel_dispatch<R - 1>(rr, panel, scales, x, k_dim, r0, b0, nb, tot);
  }
  panel_rows<R>(panel, scales, x, k_dim, r0, b0, nb, tot);
}

}  // namespace

template <bool B16>
K3_LIN_TARGET void panel(const PackedLinear& w, const Operand& x, int64_t tile, void* panel_mem, float* tot) {
  const int64_t k_dim = w.k(), blocks = k_dim / kBlock;
  float* pan = static_cast<float*>(panel_mem);
  for (int64_t i = 0; i < static_cast<int64_t>(x.rows) * kLanes; ++i) tot[i] = 0.0f;
  for (int64_t b0 = 0; b0 < blocks; b0 += kPanelBlocks) {
    const int64_t nb = blocks - b0 < kPanelBlocks ? blocks - b0 : kPanelBlocks;
    build_panel<B16>(w.tile_codes(tile), b0, nb, pan);
    for (int r0 = 0; r0 < x.rows; r0 += kPanelRows) {
      const int rr = x.rows - r0 < kPanelRows ? x.rows - r0 : kPanelRows;
      panel_dispatch<kPanelRows>(rr, pan, w.tile_scales(tile), x, k_dim, r0, b0, nb, tot);
    }
  }
}

}  // namespace k3::cpu::lin::K3_LIN_NS
