// Tiled MXFP4 layout of the CPU MoE backend (docs/cpu_moe.md) and the kernel entry points.
//
// A weight matrix [rows_out, red] (FC1: [2N, K], FC2: [K, N]) is cut into tiles of G lane
// groups of 16 output rows (G = 4 for FC1: gate 32j..+16, gate 32j+16..+16, up 32j..+16,
// up 32j+16..+16, so one tile yields 32 activation outputs; G = 2 for FC2: rows 32j..32j+32).
// Along the reduction the tile is cut into 32-element blocks. One record per (tile, block):
//
//   codes  [16 k-pairs][G/2 group pairs][32 bytes]   byte i of pair p: low nibble = code of
//          group 2p, high nibble = code of group 2p+1, for BF16 word i: lane i/2, element
//          2*kp + (i&1) of the block. One 32-byte load + zero-extension to words yields two
//          VDPBF16PS weight vectors (lane = output row, word pair = two consecutive k).
//   scales [G][16]                                   E8M0 code of (lane's row, block)
//
// Records of a tile are consecutive, tiles of an expert are consecutive: a tile is one
// contiguous stream of blocks * G * 272 bytes (the same 4.25 bits per weight as the checkpoint).
#pragma once

#include <cstdint>

#include "k3/system.hpp"

namespace k3::cpu::detail {

inline constexpr int kLanes = 16;           // FP32 lanes of one AVX-512 accumulator = rows per group
inline constexpr int kBlock = 32;           // MX block along the reduction
inline constexpr int kPairs = kBlock / 2;   // k-pairs per block (one VDPBF16PS step each)
inline constexpr int kFc1Groups = 4;
inline constexpr int kFc2Groups = 2;
inline constexpr int kDirectMaxRows = 4;    // up to this many rows: dequantize FP4 in registers
inline constexpr int kPanelBlocks = 4;      // else: a BF16 panel of 4 blocks (G=4: 16 KiB, in L1)
inline constexpr int kDirectMaxRowsAvx2 = 6;  // AVX2 (FP32 operands): direct up to 6 rows,
inline constexpr int kPanelBlocksAvx2 = 2;    // else an FP32 panel of 2 blocks (G=4: 16 KiB)
inline constexpr int kRowGroup = 48;        // rows per panel pass; totals [48, 64] FP32 = 12 KiB

constexpr int64_t record_code_bytes(int groups) { return int64_t{groups} * kPairs * kLanes; }
constexpr int64_t record_bytes(int groups) { return record_code_bytes(groups) + int64_t{groups} * kLanes; }

// Offset inside a record of the byte holding (group g, lane, element e in [0, 32)), and whether
// the code sits in the high nibble.
constexpr int64_t record_code_offset(int groups, int g, int lane, int e) {
  const int kp = e / 2, word = lane * 2 + (e & 1);
  return int64_t{kp} * groups / 2 * 32 + (g / 2) * 32 + word;
}
constexpr bool record_code_high(int g) { return (g & 1) != 0; }

// One GEMM tile task: for every operand row r,
//   totals[r][l] = sum over blocks b (in order) of scale(b, l) * (sum over k in block b of
//                  w(l, k) * row_r[k])   with w the unscaled E2M1 value,
// the inner sum in FP32 (VDPBF16PS order: per k-pair, odd element first), the outer as an FMA.
struct TileGemm {
  const uint8_t* records = nullptr;  // [blocks, record_bytes(groups)]
  int64_t blocks = 0;
  int groups = 0;                    // 2 or 4
  const void* const* rows = nullptr; // [num_rows] operand rows of blocks*32 elements
                                     //   (BF16 on avx512bf16, FP32 on the other levels)
  int64_t num_rows = 0;              // 1 .. kRowGroup
  float* totals = nullptr;           // [num_rows, groups*16] FP32, overwritten
  void* panel = nullptr;             // scratch, panel_scratch_bytes()
  // Optional: per row, its integer view (int_view_row / int_view_row_bf16). AVX2 kernel (FP32
  // levels): nullptr makes the kernel make the views it needs itself. AVX512-BF16 kernel with
  // AVX512-VNNI: viewed blocks take exact VPDPWSSD dots; nullptr: VDPBF16PS only.
  const int16_t* const* views = nullptr;
};
inline constexpr int64_t kPanelScratchBytes = int64_t{kPanelBlocks} * kPairs * kFc1Groups * 64;

using TileGemmFn = void (*)(const TileGemm&);
TileGemmFn tile_gemm_bf16();          // AVX512-BF16 (operands BF16)
// The instruction form of the AVX2 kernel's int16 dot products (same integers, same bits):
// VPMADDWD + VPADDD, VEX VPDPWSSD (AVX-VNNI) or EVEX VPDPWSSD (AVX512-VNNI + AVX512-VL).
enum class IntMac { kMadd, kAvxVnni, kAvx512Vnni };
// What a level runs on this CPU: the AVX-512 levels EVEX VPDPWSSD where the CPU has AVX512-VNNI
// and AVX512-VL; otherwise (and always on the AVX2 level) VEX VPDPWSSD where it has AVX-VNNI and
// avx_vnni is set (MoeOptions::avx_vnni); otherwise VPMADDWD + VPADDD.
IntMac int_mac_form(IsaLevel level, bool avx_vnni);
// AVX2+FMA, also the AVX-512 FP32 level (operands FP32), with the given integer form (the CPU
// must have it).
TileGemmFn tile_gemm_avx2(IntMac form);
// The kernel of an FP32 level: scalar (portable) or AVX2+FMA with int_mac_form(level, avx_vnni).
TileGemmFn tile_gemm_fp32(IsaLevel level, bool avx_vnni = true);

// AVX2 kernel's integer view of one FP32 operand block of 32 elements (gemm_avx2.cpp; call only
// where AVX2 runs): when x[k] = xi[k] * 2^(e-14) exactly for all k, with e = floor(log2 max|x|)
// and |xi[k]| < 2^15, stores xi and returns 2^(e-15); else returns 0 (xi unspecified). An
// all-zero block gives xi = 0 and 1.
float int_view_block(const float* x, int16_t* xi);
// Integer view of a row of len (a multiple of 32) elements: int16 [len], then per block FP32
// [len/32] (the block's 2^(e-15), 0 for a block without a view), then int32 [len/32] (12 times the
// sum of the block's int16 elements, for the kernel's offset weights). int_view_bytes(len) bytes.
constexpr int64_t int_view_bytes(int64_t len) { return len * 2 + len / kBlock * 8; }
void int_view_row(const float* row, int64_t len, int16_t* view);
// The same view of a BF16 row (the avx512bf16 level's operands).
void int_view_row_bf16(const uint16_t* row, int64_t len, int16_t* view);
// Whether the level's tile kernel reads integer views: the AVX2 kernel (FP32 levels), and the
// AVX512-BF16 kernel on a CPU with AVX512-VNNI (every AVX512-BF16 CPU known so far has it).
bool uses_int_views(IsaLevel l);

// Bytes per operand element on a level.
constexpr int operand_bytes(IsaLevel l) { return l == IsaLevel::kAvx512Bf16 ? 2 : 4; }

}  // namespace k3::cpu::detail
