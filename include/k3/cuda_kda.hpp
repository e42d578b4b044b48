// k3/cuda_kda.hpp — the CUDA backend of Kimi Delta Attention (docs/kda.md, "CUDA backend").
//
// STATUS: compiled for sm_90a and sm_120a in CI; ran on an H200 (sm_90) on 2026-12-04, where its
// CUDA tests and k3 validate pass (docs/cuda_moe.md, "First GPU run"); never run on sm_120. Not
// tuned: prefill is about 7x slower than fla's Triton kernels there. Planning (`plan`) and the size checks of the device calls are host code
// in k3_core, unit-tested on machines without a GPU.
//
// The grammar of every k3 op and backend (docs/architecture.md, "API grammar"):
//   auto plan = k3::cuda::plan(cfg, {.device = *k3::cuda::device_caps(0), .max_seqs = 64});
//   // one device buffer of plan->workspace_bytes, reused across calls
//   k3::cuda::decode(*plan, args /* device spans */, workspace, stream);
//   k3::cuda::kda_status(*plan, workspace, stream);  // when the caller wants to know (synchronizes)
//
// Device calls take spans over DEVICE memory (k3/kda.hpp's KdaInputs / KdaOutputs / DecodeArgs /
// VerifyArgs, unchanged). They check what the host knows — the configuration, the spans' sizes,
// the plan's limits — and then only enqueue kernels on `stream` (a cudaStream_t, nullptr = the
// default stream): no allocation, no host read of device data, no synchronization, so a call can
// be captured in a CUDA graph. The grid depends on (N, H, V) only, not on the token count, so a
// captured prefill replays with other cu_seqlens values as long as N and the buffers are the same.
//
// Values the host cannot see (cu_seqlens entries, state_indices, num_accepted, a_log) are checked
// on the device. A call never reads or writes out of bounds because of them: an offending
// sequence is skipped, its output rows (decode / verify) are NaN, its state slots are untouched,
// and a bit is set in the workspace's status word (KdaStatusBit), which `kda_status` reads. A
// prefill sequence with bad cu_seqlens writes no output row (it has no well-defined rows) and a
// NaN final state. Duplicate written slots are refused for every sequence that writes the slot.
// The host conveniences (`*_host`) check every value on the host first, with the CPU backend's
// messages, so they never see a status bit.
//
// Decode and verify accept BF16 state storage (DecodeArgs / VerifyArgs::state_pool_bf16 instead
// of state_pool): loads widen exactly, the math is FP32, stores round to nearest even.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "k3/cuda.hpp"
#include "k3/kda.hpp"
#include "k3/status.hpp"

namespace k3::cuda {

// ---- plan (host) --------------------------------------------------------------------------------

inline constexpr int kKdaVTile = 32;              // state columns per thread block (one per lane)
inline constexpr int64_t kKdaMaxSeqs = 65535;     // N per call (grid z)
inline constexpr int64_t kKdaMaxDraftTokens = 64; // verify: draft tokens per sequence

struct KdaOptions {
  // The device to plan for: device_caps(ordinal), or written by hand to plan for another device
  // (tests, cross-planning). Required: an empty one is an error.
  DeviceCaps device;
  int64_t max_seqs = 1024;       // the largest N of a call (prefill sequences, decode / verify batch)
  // Prefill: kAuto and kRecurrent run the token-recurrent kernel; kChunked the tensor-core chunked
  // kernel (chunks of 16 tokens; slower than the recurrent kernel on an H200, so kAuto does not choose it). Decode
  // and verify are token-recurrent whatever this says.
  kda::Algorithm algorithm = kda::Algorithm::kAuto;
};

struct KdaPlan {
  kda::KdaConfig cfg;
  DeviceCaps device;
  int64_t max_seqs = 0;
  kda::Algorithm algorithm = kda::Algorithm::kRecurrent;  // resolved: what prefill runs
  // Recurrent kernel geometry: one block per (V tile, head, sequence); warps = ceil(K / 32), each
  // thread keeps rows_per_thread state rows of one column in registers.
  int v_tiles = 0;
  int warps = 0;
  int rows_per_thread = 0;
  int64_t smem_bytes = 0;  // static shared memory per block
  // Chunked prefill kernel (algorithm == kChunked; zero otherwise): one block of chunk_warps warps
  // per (chunk_v_tile columns, head, sequence), chunks of chunk_size tokens, the state slice and
  // the chunk's rows in chunk_smem_bytes of dynamic shared memory (<= device.smem_per_block_optin).
  int chunk_size = 0;
  int chunk_v_tile = 0;
  int chunk_warps = 0;
  int64_t chunk_smem_bytes = 0;
  // Workspace (one caller-owned device buffer; offsets 256-byte aligned).
  int64_t ws_status = 0;     // [1] uint32: KdaStatusBit of the last call
  int64_t ws_seq_flags = 0;  // [max_seqs] int32: per-sequence status of the last decode / verify
  int64_t workspace_bytes = 0;
  std::string describe() const;  // one line per decision
};

// Checks the configuration, the options and the device (an architecture compiled into this build);
// chooses the kernel and its geometry; sizes the workspace.
Result<KdaPlan> plan(const kda::KdaConfig& cfg, const KdaOptions& options);

// The re-plan policy of a cache of plans keyed by configuration (k3.torch's CUDA KDA ops): the
// max_seqs to rebuild a plan with for a call of `seqs` sequences, or 0 when the cached plan's
// `planned` bound (0: none yet) already covers it. A new plan holds at least 1024 sequences, so
// that growing batches re-plan rarely; `seqs` above kKdaMaxSeqs is refused naming it.
Result<int64_t> kda_replan_max_seqs(int64_t planned, int64_t seqs);

// ---- device calls ---------------------------------------------------------------------------------

enum KdaStatusBit : uint32_t {
  kKdaBadSeqlens = 1u,      // a cu_seqlens entry outside [0, T], decreasing, or cu[0] != 0 / cu[N] != T
  kKdaBadALog = 2u,         // a_log[h] outside [kMinALog, kMaxALog] (that head's outputs and states are NaN)
  kKdaSlotOutOfRange = 4u,  // a state_indices entry >= the pool's slot count
  kKdaDuplicateSlot = 8u,   // a state slot written by two sequences (or twice by one)
  kKdaBadAccepted = 16u,    // num_accepted[n] outside [1, T]
};
// "bad cu_seqlens, duplicate slot" for the set bits; "ok" for 0.
std::string kda_status_string(uint32_t bits);

// Size checks of the device calls (host code, no device needed; also used by the host
// conveniences before they copy). Every message names the tensor, the expected and the actual size.
Status check_prefill_sizes(const KdaPlan& plan, const kda::KdaInputs& in, const kda::KdaOutputs& out);
Status check_decode_sizes(const KdaPlan& plan, const kda::DecodeArgs& args);
Status check_verify_sizes(const KdaPlan& plan, const kda::VerifyArgs& args);

Status prefill(const KdaPlan& plan, const kda::KdaInputs& in, const kda::KdaOutputs& out, void* workspace,
               void* stream);
Status decode(const KdaPlan& plan, const kda::DecodeArgs& args, void* workspace, void* stream);
Status verify(const KdaPlan& plan, const kda::VerifyArgs& args, void* workspace, void* stream);

// Synchronizes `stream`, reads the status word of the last call on `workspace` and returns an
// error naming the bits when one is set (ok otherwise).
Status kda_status(const KdaPlan& plan, const void* workspace, void* stream);

// ---- host conveniences (tools, tests, the backend registry) -----------------------------------------
// Host buffers in and out on device 0: every value is checked on the host with the CPU backend's
// messages, then plan + copies + the device call + copies back.
Status prefill_host(const kda::KdaConfig& cfg, const kda::KdaInputs& in, const kda::KdaOutputs& out,
                    kda::Algorithm algorithm = kda::Algorithm::kAuto);
Status decode_host(const kda::KdaConfig& cfg, const kda::DecodeArgs& args);
Status verify_host(const kda::KdaConfig& cfg, const kda::VerifyArgs& args);

// g[t, h, d] = the log-space decay of cfg.gate from the gate input f[t, h, d] (kda::GateMode),
// clamped below at kMinLogDecay, for `tokens` tokens: f and g are [tokens, H, K] FP32, a_log [H]
// and dt_bias [H, K] (may be empty) as kda::check_gate_inputs checks them. Host buffers in and
// out on device 0 (copies included). Within a few FP32 ulp of the CPU backend (device expf /
// log1pf against the host's); NaN and +-Inf follow the same rules.
Status kda_log_decay(const kda::KdaConfig& cfg, int64_t tokens, std::span<const float> f, std::span<const float> a_log,
                     std::span<const float> dt_bias, std::span<float> g);

}  // namespace k3::cuda
