// Workspace regions of one run() call (docs/cpu_moe.md). Computed identically by plan() (to
// size it) and run() (to carve it); every region starts on a 64-byte boundary.
#pragma once

#include <cstdint>

#include "k3/moe.hpp"
#include "k3/system.hpp"

namespace k3::cpu::detail {

struct WorkspaceLayout {
  int64_t chunk_tokens = 0, slot_rows = 0;  // C, S = C * top_k
  // shared regions (byte offsets from the aligned base)
  int64_t slot_row = 0;       // int32 [C, top_k]  row of each (token, slot), -1 if not local
  int64_t row_token = 0;      // int32 [S]         token of each row (rows grouped by expert)
  int64_t expert_offset = 0;  // int64 [E_local+1] first row of each expert
  int64_t used_experts = 0;   // int32 [E_local]   the local experts with rows, ascending
  int64_t x_op = 0;           // [C, K] operand (BF16 on avx512bf16, FP32 otherwise)
  int64_t x_shift = 0;        // int32 [C]         x_op row = x row * 2^shift (BF16 range)
  int64_t x_view = 0;         // [C, int_view_bytes(K)] integer views of x_op rows (uses_int_views)
  int64_t h_q = 0;            // uint8 [S, N]      W4A8: MXFP8 codes of the activation output
  int64_t h_s = 0;            // uint8 [S, N/32]   W4A8: their E8M0 scales
  int64_t h_op = 0;           // [S, N] GEMM2 operand (BF16 / FP32)
  int64_t h_shift = 0;        // int32 [S]
  int64_t h_view = 0;         // [S, int_view_bytes(N)] integer views of h_op rows (uses_int_views)
  int64_t y = 0;              // float [S, K]      expert outputs before the routing weights
  // per-thread regions: thread t's start = per_thread + t * per_thread_bytes
  int64_t per_thread = 0, per_thread_bytes = 0;
  int64_t pt_totals = 0;      // float [kRowGroup, 64]
  int64_t pt_panel = 0;       // kPanelScratchBytes
  int64_t pt_rows = 0;        // const void* [kRowGroup]
  int64_t pt_views = 0;       // const int16_t* [kRowGroup]
  int64_t pt_acc = 0;         // float [K] finalize accumulator, also [64] activation scratch
  int64_t pt_codes = 0;       // uint8 [max(K, N)] + [max(K, N)/32] MXFP8 row scratch
  int64_t total = 0;          // bytes, including 64 bytes of alignment slack
};

WorkspaceLayout workspace_layout(const MoeProblem& p, IsaLevel isa, int threads, int64_t chunk_tokens);

}  // namespace k3::cpu::detail
