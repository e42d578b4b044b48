// k3/cpu_moe.hpp — the CPU fused-MoE backend (docs/moe.md, "the fused-MoE contract").
//
// Three steps, in the style of CUTLASS's can_implement / get_workspace_size / run:
//   plan     checks the shape, the ISA level and the thread count, chooses the blocking and
//            sizes the workspace (host data, printable with describe()).
//   prepack  copies the checkpoint-layout MXFP4 weights ([gate; up] FC1, FC2) into the tiled
//            layout of docs/cpu_moe.md. It keeps 4-bit codes and E8M0 scales (decode streams
//            4.25 bits per weight); it never re-quantizes. Scale codes that the kernels cannot
//            handle exactly (0xFF = NaN, or code 0 = 2^-127 under nonzero elements) are rejected
//            with an error naming the expert, the row and the block.
//   run      computes out[M, K] for one call: no allocation, no global state; safe to call from
//            several threads at once with distinct workspaces and outputs. Every output element
//            is computed by one thread in a fixed order, so the bits do not depend on the thread
//            count, on the other tokens of the batch, or on the run.
//
// Numerics: MXFP4 weights and MXFP8 activations are exact in BF16, so the BF16 dot products
// (AVX512-BF16 VDPBF16PS) with FP32 accumulation compute the contract with no error beyond the
// FP32 accumulation order (per 32-element block: an unscaled partial sum, then one FMA with the
// block's power-of-two scale). Levels without AVX512-BF16 use FP32 FMAs on the same structure.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "k3/memory.hpp"
#include "k3/moe.hpp"
#include "k3/status.hpp"
#include "k3/system.hpp"

namespace k3::cpu {

inline constexpr int kMaxThreads = kMaxThreadCount;  // the largest MoeOptions::threads plan() accepts

// The library reads no environment variable: threads and isa are what the caller passes, else
// hardware facts. (The `k3` tool passes K3_NUM_THREADS / K3_ISA in explicitly.)
struct MoeOptions {
  int threads = 0;               // 0: all logical CPUs, hardware_thread_count(), at most kMaxThreads
  std::optional<IsaLevel> isa;   // unset: best_isa_level()
  int64_t max_tokens = 8192;     // the largest M that run() accepts with this plan
  int64_t chunk_tokens = 256;    // tokens per pipeline pass: bounds the workspace (8..4096)
  // FP32 levels on a CPU with AVX-VNNI (Alder Lake, Sierra Forest, Zen 5): the exact int16 block
  // dots use its VPDPWSSD. false: VPMADDWD + VPADDD, what a CPU without it runs (for comparisons;
  // the bits are the same either way).
  bool avx_vnni = true;
};

// Blocking of the two grouped GEMMs (see docs/cpu_moe.md).
struct MoeBlocking {
  int64_t gemm1_tiles = 0;        // N / 32: one tile = 32 gate + 32 up rows of FC1 (4 groups of 16 lanes)
  int64_t gemm2_tiles = 0;        // K / 32: one tile = 32 rows of FC2 (2 groups of 16 lanes)
  int direct_max_rows = 0;        // experts with at most this many rows read FP4 directly (decode)
  int panel_blocks = 0;           // otherwise: 32-element blocks dequantized per panel (fits L1)
  int row_group = 0;              // rows sharing one panel pass (totals fit L1)
  const char* kernel = "";        // the tile kernel, e.g. "avx512bf16 vdpbf16ps", "avx2 fma + int16 madd", "portable"
  const char* register_tile = ""; // panel register tile, rows x output lanes
};

struct MoePlan {
  MoeProblem problem;
  IsaLevel isa = IsaLevel::kScalar;
  bool avx_vnni = false;          // MoeOptions::avx_vnni as given (the kernel string says what runs)
  int threads = 1;
  int64_t max_tokens = 0;
  int64_t chunk_tokens = 0;       // tokens per pass: min(max_tokens, options.chunk_tokens)
  MoeBlocking blocking;
  int64_t workspace_bytes = 0;    // what run() needs (any alignment; it aligns internally)
  std::string describe() const;   // one line: ISA, threads, chunk, tiles, workspace
};

// Checks the problem (validate_moe_shape; K and N multiples of 32), the ISA level (must be
// supported by this CPU), threads in [0, kMaxThreads], max_tokens in [1, 2^24], chunk_tokens in [8, 4096].
Result<MoePlan> plan(const MoeProblem& problem, const MoeOptions& options = {});

// Weights of one EP rank in the backend's tiled layout (docs/cpu_moe.md). Movable, not copyable.
class PackedWeights {
 public:
  PackedWeights() = default;
  PackedWeights(PackedWeights&&) = default;
  PackedWeights& operator=(PackedWeights&&) = default;
  PackedWeights(const PackedWeights&) = delete;
  PackedWeights& operator=(const PackedWeights&) = delete;

  const MoeShape& shape() const { return shape_; }
  int64_t bytes() const { return static_cast<int64_t>(fc1_.size() + fc2_.size()); }
  // [E_local, N/32 tiles, K/32 blocks, 1088 bytes]: 1024 code bytes + 64 scale bytes per record
  const uint8_t* fc1(int64_t expert) const { return fc1_.data() + expert * fc1_expert_bytes_; }
  // [E_local, K/32 tiles, N/32 blocks, 544 bytes]: 512 code bytes + 32 scale bytes per record
  const uint8_t* fc2(int64_t expert) const { return fc2_.data() + expert * fc2_expert_bytes_; }
  int64_t fc1_expert_bytes() const { return fc1_expert_bytes_; }
  int64_t fc2_expert_bytes() const { return fc2_expert_bytes_; }
  // Per-local-expert SiTU betas (the problem's values where the view had none).
  float situ_beta(int64_t expert) const { return situ_beta_[static_cast<size_t>(expert)]; }
  float situ_linear_beta(int64_t expert) const { return situ_linear_beta_[static_cast<size_t>(expert)]; }

  // A weight block with elements whose exact FP32 value overflows to +-Inf (E8M0 codes 253 and 254
  // under large E2M1 codes). The kernels compute scale * (sum of unscaled products), which keeps
  // such products finite, so run() adds each listed block's Inf class afterwards (+-Inf, or NaN
  // for Inf * 0, Inf * NaN and +Inf + -Inf), as the contract's FP32 dequantization gives.
  struct InfBlock {
    int32_t expert = 0, tile = 0, block = 0;
    int32_t column = 0;     // in the tile's outputs: FC1 gate rows 0..31, up rows 32..63; FC2 0..31
    uint32_t inf_mask = 0;  // bit e: element e of the block overflows
    uint32_t neg_mask = 0;  // bit e: ... and is negative
  };
  // The listed blocks of one tile (matrix 1 = FC1, 2 = FC2), in (block, column) order; empty for
  // every tile of ordinary weights.
  std::span<const InfBlock> inf_blocks(int matrix, int64_t expert, int64_t tile) const;

 private:
  friend Result<PackedWeights> prepack(const MoePlan& plan, const MoeWeightsView& weights);
  MoeShape shape_;
  int64_t fc1_expert_bytes_ = 0, fc2_expert_bytes_ = 0;
  HugePageVector<uint8_t> fc1_, fc2_;  // k3/memory.hpp: 2 MiB aligned, advised for huge pages
  std::vector<float> situ_beta_, situ_linear_beta_;
  std::vector<InfBlock> fc1_inf_, fc2_inf_;  // sorted by (expert, tile, block, column)
};

// Checkpoint layout (k3/moe.hpp MoeWeightsView) -> tiled layout. Checks every buffer size.
Result<PackedWeights> prepack(const MoePlan& plan, const MoeWeightsView& weights);

// out: M x K elements of the plan's output dtype (little-endian bytes); workspace: at least
// plan.workspace_bytes. Checks the inputs (validate_moe_buffers) and M <= plan.max_tokens.
// A W4A16 BF16 row (x or intermediate) whose nonzero magnitudes span more than 2^237 cannot be
// scaled into the range where the BF16 dot products are exact: on the avx512bf16 level run()
// then fails with kInexact naming the row (use the ISA level avx512 for such data); other levels
// compute it in FP32.
Status run(const MoePlan& plan, const PackedWeights& weights, const MoeInputsView& inputs,
           std::span<uint8_t> workspace, std::span<uint8_t> out);

// ---- the expert-parallel seam (docs/distributed.md): run() = run_experts() + finalize() -------
//
// A multi-rank layer sends each token to the ranks that hold its experts, runs the experts there
// and sums the slots back at the token's source. These two entry points are the halves of run()
// it needs; together they give run()'s bits exactly (y rows do not depend on the other rows of a
// call, and finalize is the same code).

// Local slots of `topk_ids` for the shape's EP rank: ids in [first_local_expert, + E_local).
int64_t local_slot_count(const MoeShape& shape, std::span<const int32_t> topk_ids);

// The expert outputs of every local slot, before the routing weights: y [local slots, K] FP32,
// one row per slot whose id is a local expert, in slot order (token-major: token t, then slot k).
// inputs.topk_weights is not used (may be empty). Same checks as run() except out.
// x_mxfp8 (W4A8 only, optional): x already quantized by quantize_x_mxfp8 (e.g. on the rank that
// sent it), inputs.x then empty; the result is the same bits as quantizing here.
using Mxfp8Rows = k3::Mxfp8Rows;  // k3/moe.hpp: codes [M, K] E4M3, scales [M, K/32] E8M0
Status run_experts(const MoePlan& plan, const PackedWeights& weights, const MoeInputsView& inputs,
                   std::span<uint8_t> workspace, std::span<float> y, const Mxfp8Rows& x_mxfp8 = {});

// The W4A8 activation quantizer of run() (MXFP8 E4M3, RCEIL scales, per 32 along K) on rows of x:
// codes [rows, K], scales [rows, K/32]. Same bits as the quantization inside run().
Status quantize_x_mxfp8(const MoePlan& plan, std::span<const uint16_t> x, std::span<uint8_t> codes,
                        std::span<uint8_t> scales);

// run()'s last step: out[t] = sum over slots k in order, skipping slot_y[t * top_k + k] == nullptr
// (masked or absent), of topk_weights[t, k] * y, as FP32 FMAs from +0, rounded once to the plan's
// output dtype; a row with no slot is exact zeros. slot_y[t * top_k + k] points at K floats.
// scratch: at least K floats.
Status finalize(const MoePlan& plan, int64_t m, std::span<const float> topk_weights,
                std::span<const float* const> slot_y, std::span<float> scratch, std::span<uint8_t> out);

// situ_and_mul: in [rows, 2D] with row stride ld (elements; gate = first D columns, up = next D),
// out [rows, D], row-major. FP32, SIMD at best_isa_level() (same bits on every level).
Status situ_and_mul(std::span<const float> in, int64_t rows, int64_t d, int64_t ld, float beta, float linear_beta,
                    std::span<float> out);

}  // namespace k3::cpu
