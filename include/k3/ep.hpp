// k3/ep.hpp — expert parallelism across ranks: dispatch tokens to the ranks that hold their
// experts, run the experts there, combine the slots back at the token's source
// (docs/distributed.md, "Expert-parallel dispatch / combine").
//
// Rank r of W holds the global experts of k3/moe.hpp's expert partition (expert_range: contiguous
// balanced ranges, the first E mod W ranks one expert more; MoeShape with ep_size = W,
// ep_rank = r); any W from 1 to E. Each rank brings its own tokens (any count, 0 included) with their
// global top-k ids and weights. For every (token, rank) pair with at least one slot on that rank,
// dispatch sends the token's hidden row once (BF16) with the slot ids that rank owns; masked
// slots (-1) and ranks without a slot of the token receive nothing. Combine returns the FP32
// expert output of every slot to the token's source, which sums the slots in slot order with
// cpu::finalize: the output is bit-identical to one process computing the whole layer (all E
// experts, ep_size 1) with cpu::run, for every world size. Counts are exchanged first
// (all-to-all), then the rows (all-to-all-v).
//
// Every rank calls each function in the same order. A bad argument on one rank makes every rank
// return an error (the ranks agree on validity before moving data), never a hang. So does a
// partition the ranks disagree on (agree_on_partition).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "k3/backend.hpp"
#include "k3/comm.hpp"
#include "k3/ep_route.hpp"
#include "k3/moe.hpp"
#include "k3/status.hpp"

namespace k3::comm {

// What ep_dispatch delivered to this rank, and what ep_combine needs to send results back.
struct EpDispatch {
  MoeShape shape;                    // this rank's shape (ep_size = W, ep_rank = rank)
  int64_t source_tokens = 0;         // this rank's own tokens (M of its inputs)
  // Rows to compute here: x [rows, K] BF16 and topk_ids [rows, top_k], ids outside this rank's
  // experts replaced by -1. Grouped by source rank (rank order), then by source token order.
  int64_t rows = 0;
  bool mxfp8 = false;                // rows arrived as MXFP8 (x_codes / x_scales) rather than BF16 (x)
  std::vector<uint16_t> x;           // [rows, K] BF16 (when !mxfp8)
  std::vector<uint8_t> x_codes;      // [rows, K] E4M3 (when mxfp8)
  std::vector<uint8_t> x_scales;     // [rows, K/32] E8M0 (when mxfp8)
  std::vector<int32_t> topk_ids;
  std::vector<int64_t> rows_from;    // [W] rows received from each rank
  std::vector<int64_t> slots_from;   // [W] local slots among them (the y rows combine returns)
  // This rank's tokens as sent and where each slot's y comes back (k3/ep_route.hpp, the
  // bookkeeping the device path shares): for destination q, tokens
  // route.sent_tokens[route.sent_offsets[q] .. [q+1]); route.slot_row for combine.
  EpRoute route;
  int64_t bytes_sent = 0, bytes_received = 0;
  std::string to_string() const;     // "rows 12 from [3 4 0 5], slots 40, sent 10 rows 143 KB"
};

// Transfer buffers kept between calls (they only grow): give the same object to every call of a
// serving loop and no call allocates or first-touches memory in steady state (at the Kimi shape
// the combine's FP32 rows are tens of MB per rank). nullptr: each call uses its own.
struct EpBuffers {
  std::vector<uint8_t> send, recv, codes, scales;
  std::vector<float> y, back;
};

struct EpOptions {
  bool mxfp8_wire = true;  // W4A8: send MXFP8 codes + scales (about half the bytes of BF16)
  int threads = 0;         // host threads of the W4A8 quantizer and the finalize (0: all logical CPUs)
};

// Collective: every rank's shape must describe the same layer and partition — hidden,
// intermediate, num_experts, top_k and ep_size equal on every rank, ep_size = comm.size(),
// ep_rank = comm.rank() — and the same recipe. Otherwise EVERY rank returns INVALID_ARGUMENT naming
// the first rank that differs from rank 0, the field and both values. One small allgather.
Status agree_on_partition(Communicator& comm, const MoeShape& shape, Recipe recipe);

// Sends this rank's tokens (local.x [M, K] BF16, local.topk_ids [M, top_k] global ids) to the
// experts' ranks. local.topk_weights is not sent (the source applies the weights in combine).
// problem: this rank's layer (shape.ep_size must be comm.size() and ep_rank comm.rank()). W4A8
// rows on the MXFP8 wire are quantized here with the contract's quantizer (cpu::quantize_x_mxfp8).
Result<EpDispatch> ep_dispatch(Communicator& comm, const MoeProblem& problem, const MoeInputsView& local,
                               const EpOptions& options = {}, EpBuffers* buffers = nullptr);

// y: the expert outputs of d's local slots ([sum of d.slots_from, K] FP32, the order of
// PreparedMoe::run_experts on d's rows). Returns every slot's y to its source and writes
// out [M, K] (the problem's output dtype) for this rank's M tokens with the contract's finalize
// (cpu::finalize: FP32 FMAs in slot order, the same bits as every backend's run()).
Status ep_combine(Communicator& comm, const EpDispatch& d, const MoeProblem& problem, std::span<const float> y,
                  std::span<const float> topk_weights, std::span<uint8_t> out, EpBuffers* buffers = nullptr,
                  const EpOptions& options = {});

struct EpRunStats {
  int64_t rows_received = 0, slots_computed = 0;
  int64_t dispatch_bytes_sent = 0, combine_bytes_sent = 0;
  double dispatch_s = 0, experts_s = 0, combine_s = 0;
};

// The expert-parallel driver, for every backend whose prepared layer has the seam
// (PreparedMoe::expert_parallel(): the cpu backend; the others refuse by name on every rank):
// dispatch -> layer.run_experts (in pieces of at most layer.max_tokens() rows) -> combine.
// layer: this rank's (problem().shape.ep_size = W, ep_rank = rank). workspace:
// layer.workspace_bytes(). out: [local.m, K] of the layer's output dtype.
Status ep_moe_run(Communicator& comm, const PreparedMoe& layer, const MoeInputsView& local,
                  std::span<uint8_t> workspace, std::span<uint8_t> out, EpRunStats* stats = nullptr,
                  const EpOptions& options = {}, EpBuffers* buffers = nullptr);

}  // namespace k3::comm
