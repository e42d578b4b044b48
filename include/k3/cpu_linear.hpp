// k3/cpu_linear.hpp — the CPU dense linear layer (docs/linear.md): Y[M, N] = X[M, K] · Wᵀ (+ bias)
// with MXFP8 weights, recipes W8A16 (BF16 X) and W8A8 (X quantized per row to MXFP8), or BF16
// weights, recipe W16A16 (BF16 X; FP32 FMA kernels on every level).
//
// The grammar of every k3 op:
//   plan     checks the problem, the ISA level and the thread count, picks the routes and sizes the
//            workspace; describe() prints the choice.
//   prepack  copies the checkpoint-layout MXFP8 weights ([N, K] codes, [N, K/32] scales) into the
//            tiled layout of docs/linear.md (still 8 bits per weight + one scale per 32; W16A16:
//            the BF16 weights, 16 bits each); refuses NaN codes and scales by row and block.
//   run      computes out[M, N]: no allocation, no global state, safe to call from several
//            threads at once with distinct workspaces and outputs.
//
// Routes (all give the bits of linear_reference(), on every ISA level and thread count):
//   stream   M <= 8 (decode): the weights stream from memory once; each thread owns a contiguous
//            range of output columns; W8A8 quantizes X inside the call ("fused").
//   panel    M > 8: X is prepared once per chunk of rows (W8A8: by the separate quantizer,
//            quantize_x), then per 16 output columns the weights are expanded once into a panel
//            that register tiles of rows stream (FP32 FMAs; VDPBF16PS on the avx512bf16 level).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "k3/linear.hpp"
#include "k3/memory.hpp"
#include "k3/status.hpp"
#include "k3/system.hpp"

namespace k3::cpu {

struct LinearOptions {
  int threads = 0;              // 0: all logical CPUs (hardware_thread_count()), at most 256
  std::optional<IsaLevel> isa;  // unset: best_isa_level()
  int64_t max_tokens = 4096;    // the largest M that run() accepts with this plan (1 .. 2^24)
  int64_t chunk_tokens = 256;   // rows per panel pass: bounds the workspace (16 .. 4096)
  int stream_max_rows = 8;      // M up to this takes the stream route (0 .. 8; 0: never)
};

struct LinearPlan {
  LinearProblem problem;
  IsaLevel isa = IsaLevel::kScalar;
  int threads = 1;
  int64_t max_tokens = 0;
  int64_t chunk_tokens = 0;
  int stream_max_rows = 8;
  int64_t tiles = 0;            // ceil(N / 16): 16 output columns per tile
  bool pair_layout = false;     // VDPBF16PS kernels (avx512bf16 level on a CPU with AVX512-VBMI)
  const char* stream_kernel = "";
  const char* panel_kernel = "";
  int64_t workspace_bytes = 0;  // what run() needs (any alignment; run aligns it)
  std::string describe() const;
};

Result<LinearPlan> plan(const LinearProblem& problem, const LinearOptions& options = {});

// The weights in the tiled layout. Movable, not copyable.
class PackedLinear {
 public:
  PackedLinear() = default;
  PackedLinear(PackedLinear&&) = default;
  PackedLinear& operator=(PackedLinear&&) = default;
  PackedLinear(const PackedLinear&) = delete;
  PackedLinear& operator=(const PackedLinear&) = delete;

  int64_t k() const { return k_; }
  int64_t n() const { return n_; }
  // The avx512bf16 layout (plans whose stream and panel kernels use VDPBF16PS): per tile and block,
  // 8 groups of 64 codes, each two k-pairs x 16 columns in the byte order that VPUNPCK{L,H}BW
  // turns into [column][even k, odd k] BF16 words (docs/linear.md). Otherwise the FP32 layout.
  bool pair_layout() const { return pair_layout_; }
  // Offset of the code of (block b, k within the block, column c) inside a tile.
  int64_t code_offset(int64_t b, int k, int c) const {
    if (pair_layout_) {
      const int p = k / 2, j = c * 2 + (k & 1);
      return (b * 8 + p / 2) * 64 + (j / 8) * 16 + (p & 1) * 8 + (j % 8);
    }
    const int s = k ^ 1;  // stored position (k = 1, 0, 3, 2, ...)
    if (bf16_weights_) return (b * 32 + s) * 16 + c;
    return (b * 8 + s / 4) * 64 + c * 4 + (s % 4);
  }
  // W16A16: the weights are BF16 values (2 bytes each, FP32 layout, every scale code 127).
  bool bf16_weights() const { return bf16_weights_; }
  int64_t bytes() const {
    return static_cast<int64_t>(codes_.size() + scales_.size() + normal_.size() + bias_.size() * 4);
  }
  // Tile t: 16 K weights. FP32 layout: [K/32 blocks][8 quads of stored k][16 columns][4 stored k]
  // E4M3 codes, the stored k order pair-swapped (k = 1, 0, 3, 2, ...): each column's four codes of
  // a quad fill one 32-bit word, which the FP32 kernels widen by shifts (docs/linear.md). W16A16:
  // [K/32 blocks][32 stored k][16 columns] BF16 values, 2 bytes each. Pair layout: see
  // pair_layout(). code_offset() counts elements.
  const uint8_t* tile_codes(int64_t t) const { return codes_.data() + t * k_ * 16 * (bf16_weights_ ? 2 : 1); }
  // Tile t: [K/32 blocks][16 columns] E8M0 codes (padding columns: 127).
  const uint8_t* tile_scales(int64_t t) const { return scales_.data() + t * (k_ / 32) * 16; }
  // Pair layout only: tile t: [K/32 blocks] 1 where every code of the block (32 k x 16 columns)
  // has a nonzero exponent field (a normal E4M3 number), else 0 (a zero or subnormal code, or a
  // padding column). The avx512bf16 kernels expand such blocks with bit moves alone
  // (docs/linear.md); the others through a lookup table. nullptr in the FP32 layout.
  const uint8_t* tile_normal(int64_t t) const { return normal_.empty() ? nullptr : normal_.data() + t * (k_ / 32); }
  // How many (tile, block) pairs are all normal (pair layout; 0 otherwise), for tests and describe.
  int64_t normal_blocks() const;
  const float* bias() const { return bias_.empty() ? nullptr : bias_.data(); }

 private:
  friend Result<PackedLinear> prepack(const LinearPlan& plan, const LinearWeightsView& weights);
  int64_t k_ = 0, n_ = 0;
  bool pair_layout_ = false;
  bool bf16_weights_ = false;
  HugePageVector<uint8_t> codes_;  // k3/memory.hpp: 2 MiB aligned, advised for huge pages
  std::vector<uint8_t> scales_;
  std::vector<uint8_t> normal_;  // pair layout: [tiles][K/32] (tile_normal)
  std::vector<float> bias_;
};

Result<PackedLinear> prepack(const LinearPlan& plan, const LinearWeightsView& weights);

// x: M x K BF16 bits; out: M x N elements of the output dtype; workspace: plan.workspace_bytes.
Status run(const LinearPlan& plan, const PackedLinear& weights, int64_t m, std::span<const uint16_t> x,
           std::span<uint8_t> workspace, std::span<uint8_t> out);

// The W8A8 activation quantizer of run() (the codec of k3/mx.hpp: E4M3, RCEIL, RNE): codes
// [rows, K], scales [rows, K/32]. Same bits as the quantization inside run().
Status quantize_x(const LinearPlan& plan, int64_t rows, std::span<const uint16_t> x, std::span<uint8_t> codes,
                  std::span<uint8_t> scales);

// run() on X already quantized (W8A8 plans only): the result is the bits of run() on the X that
// quantize_x came from.
Status run_quantized(const LinearPlan& plan, const PackedLinear& weights, int64_t m, std::span<const uint8_t> x_codes,
                     std::span<const uint8_t> x_scales, std::span<uint8_t> workspace, std::span<uint8_t> out);

// ---- per-head products of one row (MLA's absorbed decode: q_nope · W_uk and ctx · W_uv) ----
//
// y[h, n] = sum_k x[h, k] * w[h, k, n] for H independent heads: w BF16 bits [H, K, N] (row-major),
// x FP32 [H, K], y FP32 [H, N]. Each output is the FP32 sum over k in ascending order from
// x[h, 0] * w[h, 0, n], one rounded product and one rounded add per k (no FMA): the same bits on
// every ISA level and thread count (head_gemv_reference is the definition). Threads split the
// heads. The weights stream from memory once (one decode step reads each head's K x N block).
struct HeadGemvArgs {
  int64_t heads = 0;               // H >= 1
  int64_t k = 0;                   // K >= 1
  int64_t n = 0;                   // N >= 1
  std::span<const uint16_t> w;     // [H, K, N] BF16 bits
  std::span<const float> x;        // [H, K]
  std::span<float> y;              // [H, N]
};
Status head_gemv_bf16(const HeadGemvArgs& a, int threads = 0, std::optional<IsaLevel> isa = {});
Status head_gemv_reference(const HeadGemvArgs& a);

}  // namespace k3::cpu
