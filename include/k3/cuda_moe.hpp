// k3/cuda_moe.hpp — the CUDA fused-MoE backend: plan / prepack / run (docs/moe.md contract).
//
// STATUS: compiled for sm_90a and sm_120a in CI. The sm_90 paths ran on an H200 on 2026-12-04,
// where the CUDA tests and k3 validate pass (docs/cuda_moe.md, "First GPU run"); speed is below
// the targets there. The sm_120 path has never run on a GPU. The planning logic below is host code and is unit-tested.
//
// Includes no CUDA header. Planning (`plan`) is pure host logic in k3_core, so its checks and
// its printable decisions are tested on machines without a GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "k3/cuda.hpp"
#include "k3/moe.hpp"
#include "k3/status.hpp"

namespace k3::cuda {


// The bounded list of kernel instances (a fixed, small list keeps CI builds short): the canonical
// paths, one weight layout each (docs/cuda_moe.md). NONE HAS RUN ON A GPU.
enum class MoePath : uint8_t {
  kPrefill,  // many rows per expert: mma.sync BF16 tiles of 64 rows, the checkpoint weight layout
  // few rows per expert, the decode choice: swap AB (weights = M operand, tokens = N), split-K over
  // kSplitKWarps warps per CTA, weights in a fragment-native prepacked layout
  // (src/cuda/moe/moe_pack.hpp). Ran on an H200 (2026-12-04).
  kDecodeSplitK,
  // many rows per expert on sm_90: CUTLASS wgmma/TMA grouped mixed-input GEMMs (E4M3 weights with
  // BF16 scales per 64 columns, re-encoded exactly at prepack). Ran on an H200 (2026-12-04). Needs a build
  // with CUTLASS (DeviceCaps::has_sm90_grouped); the plan picks it over kPrefill when it can.
  kPrefillSm90,
  // W4A8 on sm_120: CUTLASS's sm_120a block-scaled grouped GEMMs (MXFP8 activations x MXFP4
  // weights, UE8M0 scales; src/cuda_cutlass/moe_sm120_blockscaled.cu). Forced only (never the
  // plan's own choice). NEVER RUN ON ANY GPU. Its scratch lives in the DeviceWeights (one stream
  // at a time per DeviceWeights).
  kW4a8Sm120Cutlass,
};
const char* moe_path_name(MoePath p);
// The path of a name printed by moe_path_name ("decode", "prefill", ...); an error lists the names.
Result<MoePath> moe_path_from_name(const std::string& name);

// Whether this build contains the prefill-sm90 path's CUTLASS sm_90a grouped GEMM (the CUTLASS
// headers were present at build time; docs/cuda_moe.md). device_caps() copies it into
// DeviceCaps::has_sm90_grouped. False in builds without CUDA.
bool has_sm90_grouped_gemm();

// The plan runs decode-splitk while the expected rows per local expert are at most this.
inline constexpr double kDecodeMaxRowsPerExpert = 16.0;
// kDecodeSplitK's CTA: kSplitKWarps warps split the reduction of kSplitKRows weight rows (4 m-tiles
// of 16; FC1: 32 intermediate columns, gate and up) x 16 token rows (2 n-tiles of 8).
inline constexpr int kSplitKWarps = 8;
inline constexpr int kSplitKRows = 64;

// Workspace bounds the plan reserves for prefill-sm90 (host code cannot ask CUTLASS): per local
// expert for the group arrays of both GEMMs, and per SM for CUTLASS's workspace of both GEMMs.
// run() checks the real sizes against them and names the constant to raise.
inline constexpr int64_t kSm90ArraysBytesPerExpert = 512;
inline constexpr int64_t kSm90CutlassWorkspacePerSm = 2048;
inline constexpr int64_t kSm90CutlassWorkspaceFixed = 8192;

struct MoePlan {
  MoeProblem problem;
  int64_t max_tokens = 0; // the largest M a run may use (graph capture size)
  MoePath path = MoePath::kDecodeSplitK;
  bool path_forced = false; // MoeOptions::path chose it, not the expected rows per local expert
  // max_tokens * top_k / num_experts: the rows each local expert receives under uniform routing
  // (EP-aware: a rank gets only its experts' slots). The path is decode-splitk up to kDecodeMaxRowsPerExpert.
  double expected_rows_per_local_expert = 0;
  int block_m = 16;       // token rows per GEMM tile (expert segments are padded to it): 16 decode-splitk, 64 the others
  int block_n = 32;       // output columns per tile: 32 or 64 (must divide N for FC1 and K for FC2)
  int block_k = 32;       // one MX block per k step
  int64_t max_slots = 0;  // max_tokens * top_k
  int64_t max_tiles = 0;  // upper bound of row tiles over all experts: ceil((max_slots + E_local*(block_m-1)) / block_m)
  int64_t smem_bytes = 0;
  // Workspace layout (byte offsets into one caller-owned device buffer; all 256-byte aligned).
  int64_t ws_x_bf16 = 0;         // [max_tokens, K] BF16: x (W4A16) or x quantized to MXFP8 and dequantized exactly (W4A8)
  int64_t ws_slot_row = 0;       // [max_slots] int32: permuted row of each (token, slot), -1 if not local
  int64_t ws_row_token = 0;      // [max_tiles * block_m] int32: token of each permuted row, -1 for padding
  int64_t ws_tile_expert = 0;    // [max_tiles] int32: local expert of each row tile, -1 past the end
  int64_t ws_counts = 0;         // [E_local] int32 rows per local expert; then [E_local] padded offsets
  int64_t ws_chunk_hist = 0;     // [E_local, chunks] int32: per-chunk histogram for the stable sort
  int64_t ws_act = 0;            // [max_tiles * block_m, N] BF16: activation output (exact MXFP8 values for W4A8)
  int64_t ws_y = 0;              // [max_tiles * block_m, K] FP32: FC2 output per permuted row
  int64_t ws_status = 0;         // [1] int32: error bits set by kernels: 1 = an x block (W4A8) and 2 = an activation
                                 // block (W4A8) has values BF16 holds only as subnormals or not at all
  // prefill-sm90 only (path == kPrefillSm90), else 0:
  int sm_count = 0;              // the persistent GEMM grid (the planned device's SMs)
  int64_t ws_xg = 0;             // [max_tiles * block_m, K] BF16: x_bf16 rows gathered into expert order
  int64_t ws_h = 0;              // [max_tiles * block_m, 2N] FP32: GEMM1 output ([gate | up]) before the activation
  int64_t ws_sm90_arrays = 0;    // per-expert problem shapes / pointers / strides of both GEMMs
  int64_t sm90_arrays_bytes = 0; //   (a bound: run checks CUTLASS's real need against it)
  int64_t ws_cutlass = 0;        // CUTLASS's own workspace (TMA descriptors per SM), both GEMMs
  int64_t cutlass_bytes = 0;     //   (a bound, checked at run time)
  // w4a8-sm120-cutlass only: the persistent grid uses sm_count too; scratch is in DeviceWeights.
  int64_t workspace_bytes = 0;
  int sort_chunk = 1024;         // token-slots per block of the stable counting sort
  // kDecodeSplitK only (else 0): warps splitting K per CTA, weight rows per CTA, and the CTAs of
  // FC1 / FC2 (x = row tiles, y = groups of kSplitKRows weight rows).
  int splitk_warps = 0;
  int splitk_rows = 0;
  int64_t splitk_fc1_ctas = 0, splitk_fc2_ctas = 0;
  std::string describe() const;  // one line per decision
};

struct MoeOptions {
  int64_t max_tokens = 8192;  // the largest M a run may use (graph capture size), 1..65536
  // The device to plan for: device_caps(ordinal) on a machine with the device, or written by hand
  // to plan for another one (tests, cross-planning). Required: an empty one is an error.
  DeviceCaps device;
  // Force a path instead of the plan's choice from the expected rows per local expert (tests, the
  // device check, comparisons). run_host / time_moe / BackendOptions::path take its name; the k3
  // tool reads it from K3_CUDA_MOE_PATH=<name>.
  std::optional<MoePath> path = std::nullopt;
};

// Checks shape, capability and compiled architectures; chooses tiles; sizes the workspace.
// Errors name what is missing and which backend can run the layer instead (the CPU backend).
Result<MoePlan> plan(const MoeProblem& problem, const MoeOptions& options);

// ---- device side (available only in builds with CUDA; otherwise kUnavailable) ---------------

// Weights resident on the device in the checkpoint layout ([gate; up] FC1, FC2, linear scales),
// or, for a kDecodeSplitK plan, in that path's fragment-native layout instead (the same weight
// bytes and scales, the reduction padded to a multiple of 128; docs/cuda_moe.md): prepack for the
// plan that runs (a decode plan and a prefill plan each need their own; run reports a mismatch).
// Prepack also checks that every scale code keeps the exact BF16 dequantization valid
// (docs/formats.md); a block that would not is reported and the layer cannot run on this path.
class DeviceWeights {
 public:
  DeviceWeights();
  ~DeviceWeights();
  DeviceWeights(DeviceWeights&&) noexcept;
  DeviceWeights& operator=(DeviceWeights&&) noexcept;
  struct Impl;
  explicit DeviceWeights(std::unique_ptr<Impl> impl);
  Impl* impl() const { return impl_.get(); }

 private:
  std::unique_ptr<Impl> impl_;
};
Result<DeviceWeights> prepack(const MoePlan& plan, const MoeWeightsView& w);

// The path run() takes with these weights: plan.path, except that a prefill-sm90 plan the plan
// chose itself (not forced) runs the prefill kernels when prepack could not re-encode the weights
// for it (MX block scales more than 14 binades apart within a 64-column group; docs/cuda_moe.md).
MoePath effective_path(const MoePlan& plan, const DeviceWeights& w);

// Device pointers of one call. `m_device` holds the real token count (<= plan.max_tokens) so that a
// captured CUDA graph can replay with another M without re-launching with new grid sizes. The
// kernels clamp it to [0, plan.max_tokens]: a larger value computes max_tokens tokens, a negative one none.
struct DeviceInputs {
  const int32_t* m_device = nullptr;      // [1]
  const uint16_t* x = nullptr;            // [max_tokens, K] BF16
  const int32_t* topk_ids = nullptr;      // [max_tokens, top_k] global ids, -1 masked
  const float* topk_weights = nullptr;    // [max_tokens, top_k]
  void* out = nullptr;                    // [max_tokens, K] out dtype
};

// Enqueues the layer on `stream` (a cudaStream_t, nullptr = default stream). Allocates nothing,
// launches a fixed grid derived from the plan, never synchronizes the host.
Status run(const MoePlan& plan, const DeviceWeights& w, const DeviceInputs& in, void* workspace, void* stream);

// ---- the expert-parallel seam (docs/distributed.md): run() = run_experts() + finalize() -------
// Mirrors cpu::run_experts / cpu::finalize (k3/cpu_moe.hpp). Ran at world size 1 on an H200 (2026-12-04).
//
// The FP32 expert outputs stay where FC2 writes them: the permuted, expert-grouped rows of the
// workspace, with the (token, slot) -> row map the sort made. They are not compacted into a
// caller buffer in (token, slot) order because finalize reads rows through a slot -> row map in
// any case: run() then stays the same kernels on the same buffers (same bits, still capturable),
// and the expert-parallel combine gathers exactly the rows it sends (k3/cuda_ep.hpp) and, at the
// source, finalizes the received rows with its own slot -> row map.
struct ExpertRows {
  const float* y = nullptr;          // [rows, K] FP32 device rows (workspace + plan.ws_y)
  const int32_t* slot_row = nullptr; // [max_tokens, top_k] row of y of each (token, slot); -1: masked,
                                     // not local, or past the real M (workspace + plan.ws_slot_row)
};
// The workspace addresses of the rows run_experts writes (pointer arithmetic only, no device access).
ExpertRows expert_rows(const MoePlan& plan, void* workspace);

// The expert outputs of every local slot of in.x / in.topk_ids (in.m_device tokens), before the
// routing weights. in.topk_weights and in.out are not used (may be null). Enqueued on `stream`;
// the rows are valid until the next call on the same workspace. After it, ws_status holds the
// kernels' error bits (as after run()).
Result<ExpertRows> run_experts(const MoePlan& plan, const DeviceWeights& w, const DeviceInputs& in, void* workspace,
                               void* stream);

// run()'s last step: out[t] = sum over slots k in order, skipping rows.slot_row[t * top_k + k] < 0,
// of topk_weights[t, k] * rows.y[row], as FP32 FMAs from +0, rounded once to the plan's output
// dtype; a token with no slot is exact zeros. For t < *m_device (clamped to [0, max_tokens]).
// Any y / slot_row pair works (the EP combine passes the rows it received and its own map).
Status finalize(const MoePlan& plan, const int32_t* m_device, const ExpertRows& rows, const float* topk_weights,
                void* out, void* stream);

// A layer planned and prepacked once on device `device`, run from host buffers: each run copies x,
// topk_ids and topk_weights in, runs, waits, checks the kernels' error bits and copies the output
// back. Device buffers for max_tokens tokens are allocated once. For tools and the registry's
// PreparedMoe (k3/backend.hpp); serving loops use plan / prepack / run on device buffers. One call
// at a time (run() serializes). This host wrapper is run_host split in two; it has NOT RUN on a GPU
// in this form (run_host ran on an H200 on 2026-12-04 before the split).
class HostMoe {
 public:
  // path: "" (the plan's choice) or a path name; a bad name is an error naming `path` even without
  // a device. max_tokens: 1..65536.
  static Result<std::unique_ptr<HostMoe>> create(const MoeProblem& p, const MoeWeightsView& w, int64_t max_tokens,
                                                 const std::string& path = "", int device = 0);
  ~HostMoe();
  HostMoe(const HostMoe&) = delete;
  HostMoe& operator=(const HostMoe&) = delete;
  const MoePlan& plan() const;
  MoePath path() const;  // effective_path(plan, weights): what runs
  // in.m <= plan().max_tokens; out: M*K elements of the out dtype. Inputs are checked
  // (validate_moe_inputs) before any copy.
  Status run(const MoeInputsView& in, std::span<uint8_t> out) const;
  struct Impl;
  explicit HostMoe(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

// Convenience for tools and tests: HostMoe::create for M tokens + run, on device `device`.
// path: "" (the plan's choice) or a path name (moe_path_from_name); a bad name is an error naming
// `path` even without a device.
Status run_host(const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in, std::span<uint8_t> out,
                const std::string& path = "", int device = 0);

}  // namespace k3::cuda
