// Internal interface of the CPU linear kernels (docs/linear.md, "CPU kernels").
//
// Operands. Every kernel computes the contract of k3/linear.hpp for its rows. The FP32 kernels
// widen an E4M3 code to the FP32 bits of w 2^-120 by shifts and a mask (its sign, exponent and
// mantissa fields moved into FP32's; subnormal codes become FP32 subnormals, so the kernels run
// with MXCSR.DAZ clear). The stream kernels use w' = w 2^-120 with x' = x 2^120 when every row of
// the call has its finite |x| < 2^8 (Operand::x120), else, like the panel kernels, w' = w 2^-8
// (one exact multiply by 2^112) with x' = x 2^8 (exact for |x| < 2^120): w' x' = w x, so every
// FMA has the exact product and rounding of the contract. Rows holding a finite |x| >= 2^120
// (kRowPortable) are computed by the portable body instead.
// The BF16 kernels (VDPBF16PS, which flushes subnormal inputs and results; unscaled w and x,
// E4M3 -> BF16 by two VPERMT2B lookups on the pair layout) take rows whose
// nonzero magnitudes all lie in [2^-110, 2^114) and are finite (kRowBf16): then every product
// is a multiple of 2^-126 and every 32-term partial sum is 0 or a normal FP32 below 2^128, so
// VDPBF16PS (odd element then even, each an exact product added with RNE) gives the FMA chain.
#pragma once

#include <cstdint>

#include "cpu/prefetch.hpp"
#include "k3/cpu_linear.hpp"

namespace k3::cpu::lin {

inline constexpr int kLanes = 16;        // output columns per tile
inline constexpr int kBlock = 32;        // K per MX block
inline constexpr int kPanelBlocks = 8;   // blocks per panel pass (8 x 32 x 16 FP32 = 16 KiB)

enum RowClass : uint8_t { kRowPortable = 0, kRowFp32 = 1, kRowBf16 = 2 };

// Operand rows of one call (or chunk of rows).
struct Operand {
  const float* xs = nullptr;     // [rows][ldx] x' = x 2^8 (x120: x 2^120), pair-swapped (k = 1, 0, 3, 2, ...)
  const uint32_t* xb = nullptr;  // [rows][ldb] BF16 pairs of x (low: even k, high: odd k); bf16 level
  const uint8_t* cls = nullptr;  // [rows] RowClass
  int rows = 0;
  int64_t ldx = 0;  // row stride of xs in floats (K plus padding: rows 2^n bytes apart share L1 sets)
  int64_t ldb = 0;  // row stride of xb in pairs
  bool x120 = false;  // stream kernels, E4M3 weights: xs holds x 2^120 (every finite |x| < 2^8)
};

// Look-ahead prefetch of the stream kernels (FP32 and VDPBF16PS): for block b of the tile that
// starts at `codes` (block_bytes of codes per block, scales at `scales`), the block `ahead`
// blocks later; near the tile's end the same distance into tile `next` of the thread's range
// (when next < t_end: the hardware prefetcher would start that stream cold), and the scale
// stream one line per 4 blocks.
__attribute__((always_inline)) inline void prefetch_stream_ahead(const PackedLinear& w, const uint8_t* codes,
                                                                  const uint8_t* scales, int64_t b, int64_t blocks,
                                                                  int64_t next, int64_t t_end, int64_t block_bytes,
                                                                  int64_t ahead) {
  const uint8_t* pf = nullptr;
  const uint8_t* ps = nullptr;
  if (b + ahead < blocks) {
    pf = codes + (b + ahead) * block_bytes;
    ps = scales + (b + ahead) * kLanes;
  } else if (next < t_end) {
    pf = w.tile_codes(next) + (b + ahead - blocks) * block_bytes;
    ps = w.tile_scales(next) + (b + ahead - blocks) * kLanes;
  } else {
    return;
  }
  k3::cpu::detail::prefetch_bytes(pf, block_bytes);
  if (((b + ahead) & 3) == 0) k3::cpu::detail::prefetch_line(ps);
}

// Stream route (rows <= 8): tiles [t0, t1) for all rows; tot: [rows][(t1 - t0) * 16] FP32 totals.
void stream_avx2(const PackedLinear& w, const Operand& x, int64_t t0, int64_t t1, float* tot);
void stream_avx512(const PackedLinear& w, const Operand& x, int64_t t0, int64_t t1, float* tot);

// Panel route: one tile for rows [0, x.rows); panel: per-thread scratch of kPanelBytes;
// tot: [rows][16] FP32 totals (overwritten).
inline constexpr int64_t kPanelBytes = int64_t{kPanelBlocks} * kBlock * kLanes * 4;
void panel_avx2(const PackedLinear& w, const Operand& x, int64_t tile, void* panel, float* tot);
void panel_avx512(const PackedLinear& w, const Operand& x, int64_t tile, void* panel, float* tot);
// VDPBF16PS panel: tiles [tile, tile + tiles), tiles 1 or 2 (2 x 12 rows register tile);
// tot: [rows][tiles * 16].
void panel_bf16(const PackedLinear& w, const Operand& x, int64_t tile, int tiles, void* panel, float* tot);
// Stream route on the pair layout (rows <= 8, all kRowBf16 or recomputed after).
void stream_bf16(const PackedLinear& w, const Operand& x, int64_t t0, int64_t t1, float* tot);
// True when this CPU runs the VDPBF16PS linear kernels (AVX512-BF16 and AVX512-VBMI).
bool bf16_kernels_available();

// The portable body: one tile for one row of exact operand values (natural order); tot16: 16
// FP32 totals. The scalar level uses it for everything, the others for kRowPortable rows.
void tile_portable(const PackedLinear& w, int64_t tile, const float* x_exact, float* tot16);

}  // namespace k3::cpu::lin
