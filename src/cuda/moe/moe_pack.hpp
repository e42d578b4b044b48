// The fragment-native MXFP4 weight layout of the decode-splitk path (MoePath::kDecodeSplitK) and
// every index function its kernels use: host + device code without CUDA headers, so the host test
// tests/core/test_cuda_moe_pack.cpp packs random matrices and emulates the kernels lane by lane
// with these very functions. The kernels (moe_gemm_splitk.cu) ran on an H200 (2026-12-04).
//
// Swap AB. The GEMM is C[w, t] = sum_k W[w, k] * X[t, k]: weight rows w are the M operand of
// mma.sync.m16n8k16 (16 rows x 16 k, row-major A), token rows t the N operand (8 tokens, B
// "col"), FP32 accumulators C[16 weight rows, 8 tokens]. Fragments (PTX ISA, m16n8k16 .bf16), lane
// = 4g + q:  A reg i (0..3): row g + 8 (i & 1), k 2q + 8 (i >> 1) + {0, 1};
//            B reg r (0..1): k 2q + 8 r + {0, 1}, column (token) g;
//            C reg r (0..3): row g + 8 (r >> 1), column 2q + (r & 1).
//
// The k order inside a chunk of 64 is free as long as A and B use the same one. Step s (0..3) of
// chunk kc maps the mma's k index 2q + 8r + {0,1} to the real k
//     64 kc + 16 q + 4 s + 2 r + {0, 1}                                   (sk_real_k)
// so lane (g, q) needs, over the whole chunk, the 16 consecutive k 64 kc + 16 q .. + 15 of weight
// rows g and g + 8 (8 packed bytes of each checkpoint row) and of its token g (32 bytes of BF16,
// two 16-byte loads). Packed layout per expert: [m-tile][chunk][lane][16 bytes]; word s (bytes
// 4 s .. 4 s + 3) of a lane feeds step s: row g's k pairs r = 0, 1 (A regs 0, 2), then row g + 8's
// (A regs 1, 3), so each 16-bit half of the word shares one scale (sk_fp4x4_to_bf16).
// A warp's load of one (m-tile, chunk) is 512 contiguous bytes, fully coalesced, and one 16-byte
// load per lane feeds 4 k steps.
//
// Rows. FC1 m-tile mt: rows 0..7 = gate rows 8 mt .. 8 mt + 7, rows 8..15 = the up rows of the same
// intermediate columns (checkpoint rows N + 8 mt ..): accumulator regs 0, 1 of lane (g, q) hold
// gate, regs 2, 3 up, of intermediate column 8 mt + g and tokens 2q, 2q + 1. FC2 m-tile mt: output
// columns 16 mt .. 16 mt + 15.
//
// Scales. Lane (g, q) of chunk kc reads k 64 kc + 16 q .., all inside MX block 2 kc + (q >> 1), so
// it needs 2 scales per chunk (rows g and g + 8). Chunks come in pairs (the split-K unit); one
// 32-bit word per (m-tile, pair, g, q >> 1) holds, low byte first: row g chunk 2p, row g + 8 chunk
// 2p, row g chunk 2p + 1, row g + 8 chunk 2p + 1. Layout per expert: [m-tile][pair][16 words].
//
// Padding. The reduction is padded to a multiple of 128 (one pair): padded bytes are code 0 and
// padded scales 127 (1.0), so the weights there are +0; the kernels load zeros for the operand
// (x or act) there too, so the padding adds +0 * 0 products only.
#pragma once

#include <cstdint>

#include "cuda/moe/moe_shared.hpp"
#include "k3/config.hpp"
#include "k3/cuda_moe.hpp"
#include "k3/mx.hpp"

namespace k3::cuda::moe_detail {

inline constexpr int kSkWarps = kSplitKWarps;       // split-K warps per CTA
inline constexpr int kSkThreads = kSkWarps * 32;
inline constexpr int kSkMTiles = kSplitKRows / 16;  // 16-row m-tiles per CTA
inline constexpr int kSkTokens = 16;                // token rows per tile (plan.block_m): 2 n-tiles
inline constexpr int kSkNTiles = kSkTokens / 8;
inline constexpr int kSkChunk = 64;                 // k per chunk: one 16-byte load per lane
inline constexpr int kSkPairK = 2 * kSkChunk;       // k per split-K unit (pair of chunks)
inline constexpr uint8_t kSkPadScale = 127;
static_assert(kSkMTiles * 8 == kMxBlock, "an FC1 CTA covers exactly one MX block of intermediate columns");

// Per-expert geometry of one packed matrix: `rows` weight rows (FC1 2N, FC2 K) x `red` (FC1 K, FC2 N).
struct SkGeom {
  int64_t rows = 0, red = 0;
  int64_t mtiles = 0;       // rows / 16
  int64_t pairs = 0;        // ceil(red / 128)
  int64_t chunks = 0;       // 2 * pairs
  int64_t bytes = 0;        // packed bytes per expert
  int64_t scale_words = 0;  // 32-bit scale words per expert
};
K3_HOST_DEVICE constexpr SkGeom sk_geom(int64_t rows, int64_t red) {
  SkGeom g;
  g.rows = rows;
  g.red = red;
  g.mtiles = rows / 16;
  g.pairs = (red + kSkPairK - 1) / kSkPairK;
  g.chunks = 2 * g.pairs;
  g.bytes = g.mtiles * g.chunks * 32 * 16;
  g.scale_words = g.mtiles * g.pairs * 16;
  return g;
}
K3_HOST_DEVICE constexpr SkGeom sk_geom_fc1(int64_t k, int64_t n) { return sk_geom(2 * n, k); }
K3_HOST_DEVICE constexpr SkGeom sk_geom_fc2(int64_t k, int64_t n) { return sk_geom(k, n); }

// Checkpoint row (within the expert) of row r (0..15) of m-tile mt.
K3_HOST_DEVICE constexpr int64_t sk_ckpt_row(bool fc1, int64_t n, int64_t mt, int r) {
  if (!fc1) return 16 * mt + r;
  return r < 8 ? 8 * mt + r : n + 8 * mt + (r - 8);
}

// Byte offset (within the expert) of lane's 16 bytes of (m-tile mt, chunk kc).
K3_HOST_DEVICE constexpr int64_t sk_a_offset(const SkGeom& g, int64_t mt, int64_t kc, int lane) {
  return ((mt * g.chunks + kc) * 32 + lane) * 16;
}
// Word index (within the expert) of lane's scale word of (m-tile mt, pair p).
K3_HOST_DEVICE constexpr int64_t sk_scale_word(const SkGeom& g, int64_t mt, int64_t p, int lane) {
  return (mt * g.pairs + p) * 16 + (lane >> 2) * 2 + ((lane & 3) >> 1);
}

// The real k (even; the pair k, k + 1) of mma k index 2q + 8r of step s of chunk kc, for A and B.
K3_HOST_DEVICE constexpr int64_t sk_real_k(int64_t kc, int lane, int s, int r) {
  return int64_t{kSkChunk} * kc + 16 * (lane & 3) + 4 * s + 2 * r;
}
// The first k of lane's 16 consecutive operand values of chunk kc (its two 16-byte B loads).
K3_HOST_DEVICE constexpr int64_t sk_b_k0(int64_t kc, int lane) { return int64_t{kSkChunk} * kc + 16 * (lane & 3); }
// Inside those 16 values: the BF16 pair of B reg r of step s starts at index 4 s + 2 r, i.e. it is
// 32-bit word 2 s + r of the 8 words loaded (words 0..3: first load, 4..7: second).
K3_HOST_DEVICE constexpr int sk_b_word(int s, int r) { return 2 * s + r; }

// Packing source of byte b (0..15) of lane's 16 bytes of chunk kc: row (0..15) of the m-tile and
// the checkpoint byte column (k / 2); the kernel turns it into A reg (b & 3) of step (b >> 2).
struct SkByteSrc {
  int row;
  int64_t byte_col;
};
K3_HOST_DEVICE constexpr SkByteSrc sk_a_byte_src(int64_t kc, int lane, int b) {
  const int s = b >> 2, j = b & 3;  // byte j of word s: row g + 8 (j >> 1), k pair r = j & 1
  return {(lane >> 2) + 8 * (j >> 1), sk_real_k(kc, lane, s, j & 1) / 2};
}
// Packing source of byte j (0..3) of scale word w (0..15) of pair p: row of the m-tile, MX block.
struct SkScaleSrc {
  int row;
  int64_t block;
};
K3_HOST_DEVICE constexpr SkScaleSrc sk_scale_src(int64_t p, int w, int j) {
  const int g = w >> 1, h = w & 1;
  const int64_t kc = 2 * p + (j >> 1);
  return {g + 8 * (j & 1), 2 * kc + h};
}

// ---- E2M1 -> BF16 with byte permutes (the kernels' conversion) -------------------------------
//
// Bit-identical to moe_shared.hpp's fp4x2_to_bf16x2 for every byte and scale code except scale 0
// with a nibble of magnitude 1 (0.5 x 2^-127: below BF16's normal range, so prepack never accepts
// it; the reference leaves garbage there): tests/core/test_cuda_moe_pack.cpp checks all 2^16
// 16-bit inputs x 256 scales. About 5 instructions per BF16 pair instead of ~15-20.
//
// PRMT (CUDA's __byte_perm): byte n of the result is byte (sel >> 4n) & 7 of {b:a} (a = bytes
// 0..3). The selectors used here never have bit 3 of a nibble set.
K3_HOST_DEVICE constexpr uint32_t sk_prmt(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, sel);
#else
  const uint64_t ab = (uint64_t{b} << 32) | a;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) r |= static_cast<uint32_t>((ab >> (8 * ((sel >> (4 * n)) & 7u))) & 0xFFu) << (8 * n);
  return r;
#endif
}

// The BF16 bits of magnitude m (0..7) times 2^(scale - 127), as two 8-byte tables (low bytes,
// high bytes) for PRMT: m = 0 -> +0, else T[m] + (scale - 127) << 7 with T the BF16 bits of the
// E2M1 magnitude, i.e. (T[m] - 0x3F00) + (scale - 1) << 7; scale 0xFF ORs in the NaN pattern
// 0x7FC0 (zeros too), as fp4_nan_mask does. Each 16-bit sum stays in [0, 0xFFFF] for every scale
// when m >= 2, so the packed additions (base * 0x10001) never carry between halves.
struct SkFp4Table {
  uint32_t lo0, lo1, hi0, hi1;
};
K3_HOST_DEVICE constexpr SkFp4Table sk_fp4_table(uint32_t scale) {
  const uint32_t base = (scale - 1u) << 7;
  const uint32_t nan = scale == kE8M0Nan ? 0x7FC07FC0u : 0u;
  const uint32_t p01 = (base << 16) | nan;                         // m = 0, 1
  const uint32_t p23 = ((0x00C00080u + base * 0x10001u)) | nan;    // m = 2, 3
  const uint32_t p45 = ((0x01400100u + base * 0x10001u)) | nan;    // m = 4, 5
  const uint32_t p67 = ((0x01C00180u + base * 0x10001u)) | nan;    // m = 6, 7
  return {sk_prmt(p01, p23, 0x6420u), sk_prmt(p45, p67, 0x6420u), sk_prmt(p01, p23, 0x7531u),
          sk_prmt(p45, p67, 0x7531u)};
}

// Four E2M1 codes (16 bits: bytes 0 and 1 of one weight row under one scale) -> two BF16 pair
// registers: r0 from byte 0 (low nibble = even k in the low half), r1 from byte 1. The sign bits
// 3, 7 (11, 15) move to bits 15, 31 by one multiply each: the products' other bits never carry
// into 15 or 31.
K3_HOST_DEVICE constexpr void sk_fp4x4_to_bf16(uint32_t h, const SkFp4Table& t, uint32_t& r0, uint32_t& r1) {
  const uint32_t sel = h & 0x7777u;
  const uint32_t lo = sk_prmt(t.lo0, t.lo1, sel), hi = sk_prmt(t.hi0, t.hi1, sel);
  const uint32_t sign = h & 0x8888u;
  r0 = sk_prmt(lo, hi, 0x5140u) | ((sign * 0x01001000u) & 0x80008000u);
  r1 = sk_prmt(lo, hi, 0x7362u) | ((sign * 0x00010010u) & 0x80008000u);
}

// Kernel side: the scale of row g (row_hi 0) or g + 8 (row_hi 1) of a chunk (kc_odd: the second
// of its pair) from the lane's scale word, and the 4 A regs of step s from word s of the lane's 16
// bytes and the two rows' tables.
K3_HOST_DEVICE constexpr uint32_t sk_scale_of(uint32_t scale_word, int kc_odd, int row_hi) {
  return (scale_word >> (8 * (2 * kc_odd + row_hi))) & 0xFFu;
}
K3_HOST_DEVICE constexpr void sk_a_regs(uint32_t word, const SkFp4Table& t_lo, const SkFp4Table& t_hi,
                                        uint32_t (&a)[4]) {
  sk_fp4x4_to_bf16(word & 0xFFFFu, t_lo, a[0], a[2]);  // row g: k pairs r = 0 (reg 0), 1 (reg 2)
  sk_fp4x4_to_bf16(word >> 16, t_hi, a[1], a[3]);      // row g + 8: regs 1, 3
}

// Split-K: the pairs [begin, end) warp w of kSkWarps reduces (contiguous, balanced, in warp order).
struct SkRange {
  int64_t begin, end;
};
K3_HOST_DEVICE constexpr SkRange sk_split(int64_t pairs, int w) {
  return {pairs * w / kSkWarps, pairs * (w + 1) / kSkWarps};
}

// Accumulators in shared memory: partial of warp w, element e = (mt * kSkNTiles + nt) * 4 + r of
// lane: part[(w * kSkElems + e) * 32 + lane] (conflict-free stores). The reduction writes the sum
// over w = 0, 1, ..., kSkWarps - 1 (in that order, FP32) to the w = 0 slot.
inline constexpr int kSkElems = kSkMTiles * kSkNTiles * 4;
K3_HOST_DEVICE constexpr int sk_part_index(int w, int mt, int nt, int r, int lane) {
  return (w * kSkElems + (mt * kSkNTiles + nt) * 4 + r) * 32 + lane;
}
// The CTA's (token 0..15, weight row 0..63) of accumulator (mt, nt, r) of lane, and its inverse.
K3_HOST_DEVICE constexpr int sk_acc_token(int nt, int r, int lane) { return 8 * nt + 2 * (lane & 3) + (r & 1); }
K3_HOST_DEVICE constexpr int sk_acc_row(int mt, int r, int lane) { return 16 * mt + (lane >> 2) + 8 * (r >> 1); }
K3_HOST_DEVICE constexpr int sk_reduced_index(int token, int row) {
  const int mt = row >> 4, rr = row & 15, g = rr & 7, nt = token >> 3, tq = token & 7;
  return sk_part_index(0, mt, nt, 2 * (rr >> 3) + (tq & 1), 4 * g + (tq >> 1));
}
// FC1 epilogue: lane c (0..31) of the warp handles intermediate column 32 x + c of the CTA: its
// gate and up values are rows sk_fc1_gate_row(c) and + 8 of the CTA.
K3_HOST_DEVICE constexpr int sk_fc1_gate_row(int c) { return 16 * (c >> 3) + (c & 7); }

// Grid of an FC1 / FC2 launch: x = row tiles (max_tiles may exceed 65535 for forced decode
// plans), y = groups of kSkMTiles m-tiles.
K3_HOST_DEVICE constexpr Grid sk_grid(const Dims& d, bool fc1) {
  const SkGeom g = fc1 ? sk_geom_fc1(d.k, d.n) : sk_geom_fc2(d.k, d.n);
  return {grid_dim(d.max_tiles, kMaxGridX), grid_dim((g.mtiles + kSkMTiles - 1) / kSkMTiles, kMaxGridYZ), 1};
}

// Host: packs one expert's checkpoint matrix (q: [rows, red / 2] E2M1 pairs, s: [rows, red / 32]
// E8M0) into the fragment-native layout (pq: g.bytes, ps: g.scale_words).
inline void sk_pack_expert(bool fc1, int64_t n, const SkGeom& g, const uint8_t* q, const uint8_t* s, uint8_t* pq,
                           uint32_t* ps) {
  const int64_t row_bytes = g.red / 2, row_blocks = g.red / kMxBlock;
  for (int64_t mt = 0; mt < g.mtiles; ++mt) {
    for (int64_t kc = 0; kc < g.chunks; ++kc) {
      for (int lane = 0; lane < 32; ++lane) {
        uint8_t* dst = pq + sk_a_offset(g, mt, kc, lane);
        for (int b = 0; b < 16; ++b) {
          const SkByteSrc src = sk_a_byte_src(kc, lane, b);
          dst[b] = src.byte_col < row_bytes ? q[sk_ckpt_row(fc1, n, mt, src.row) * row_bytes + src.byte_col] : 0;
        }
      }
    }
    for (int64_t p = 0; p < g.pairs; ++p) {
      for (int w = 0; w < 16; ++w) {
        uint32_t word = 0;
        for (int j = 0; j < 4; ++j) {
          const SkScaleSrc src = sk_scale_src(p, w, j);
          const uint8_t sc =
              src.block < row_blocks ? s[sk_ckpt_row(fc1, n, mt, src.row) * row_blocks + src.block] : kSkPadScale;
          word |= uint32_t{sc} << (8 * j);
        }
        ps[(mt * g.pairs + p) * 16 + w] = word;
      }
    }
  }
}

}  // namespace k3::cuda::moe_detail
