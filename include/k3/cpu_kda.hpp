// k3/cpu_kda.hpp — the CPU backend of Kimi Delta Attention (docs/kda.md).
//
// The same grammar as every k3 op and backend (docs/architecture.md, "API grammar"):
//   auto plan = k3::cpu::plan(cfg, options);            // Result<KdaPlan>; plan->describe()
//   std::vector<uint8_t> ws(plan->workspace_bytes);     // caller-owned, reused across calls
//   k3::cpu::prefill(*plan, inputs, outputs, ws);       // and decode / verify
// The op's types, checks and references are in k3/kda.hpp.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "k3/kda.hpp"
#include "k3/status.hpp"
#include "k3/system.hpp"

namespace k3::cpu {

inline constexpr int64_t kKdaChunkMinTokens = 8;  // KdaOptions::chunk_min_tokens default: measured crossover, docs/kda.md
inline constexpr int kKdaMaxThreads = kMaxThreadCount;  // the largest KdaOptions::threads plan() accepts

// The library reads no environment variable: threads and isa are what the caller passes, else
// hardware facts. (The `k3` tool passes K3_NUM_THREADS / K3_ISA in explicitly.)
struct KdaOptions {
  int threads = 0;                  // 0: all logical CPUs, hardware_thread_count(), at most kKdaMaxThreads
  std::optional<IsaLevel> isa;      // unset: best_isa_level(); a level above the CPU's is an error
  kda::Algorithm algorithm = kda::Algorithm::kAuto;
  int64_t chunk_min_tokens = kKdaChunkMinTokens;  // kAuto: sequences this long run chunked
};

struct KdaPlan {
  kda::KdaConfig cfg;
  IsaLevel isa = IsaLevel::kScalar;
  int threads = 1;
  kda::Algorithm algorithm = kda::Algorithm::kAuto;
  int64_t chunk_min_tokens = kKdaChunkMinTokens;
  int64_t workspace_bytes = 0;  // what every prefill / decode / verify call needs (any alignment)
  std::string describe() const; // one line: heads, dims, ISA, threads, algorithm, workspace
};

// Checks the configuration (kda::validate_config) and options; resolves threads and the SIMD level.
Result<KdaPlan> plan(const kda::KdaConfig& cfg, const KdaOptions& options = {});

// Prefill over variable-length sequences; threads over (sequence, head); bit-identical for any
// thread count. workspace: at least plan.workspace_bytes.
Status prefill(const KdaPlan& plan, const kda::KdaInputs& in, const kda::KdaOutputs& out,
               std::span<uint8_t> workspace);
// Decode and verify are always token-recurrent (KdaPlan::algorithm applies to prefill).
Status decode(const KdaPlan& plan, const kda::DecodeArgs& args, std::span<uint8_t> workspace);
Status verify(const KdaPlan& plan, const kda::VerifyArgs& args, std::span<uint8_t> workspace);

// Speculative verify without snapshots (k3/kda.hpp, "the replay window and the commit"):
// verify_replay runs the draft tokens on copies of the slots' states (the state pool is only read)
// and keeps their update inputs in the window pool; commit folds the first num_accepted[n] of them
// into slot state_indices[n], bit-identical to decode run token by token on those tokens, for
// every ISA level and thread count. Both take the plan's workspace.
Status verify_replay(const KdaPlan& plan, const kda::ReplayVerifyArgs& args, std::span<uint8_t> workspace);
Status commit(const KdaPlan& plan, const kda::CommitArgs& args, std::span<uint8_t> workspace);

// Conveniences that plan and allocate the workspace.
Status prefill(const kda::KdaConfig& cfg, const kda::KdaInputs& in, const kda::KdaOutputs& out,
               const KdaOptions& options = {});
Status decode(const kda::KdaConfig& cfg, const kda::DecodeArgs& args, const KdaOptions& options = {});
Status verify(const kda::KdaConfig& cfg, const kda::VerifyArgs& args, const KdaOptions& options = {});
Status verify_replay(const kda::KdaConfig& cfg, const kda::ReplayVerifyArgs& args, const KdaOptions& options = {});
Status commit(const kda::KdaConfig& cfg, const kda::CommitArgs& args, const KdaOptions& options = {});

}  // namespace k3::cpu
