// k3/backend.hpp — the backends of each op, in one place (the library's backend registry).
//
// Every op (fused MoE, KDA) has a fixed list of backends, highest priority first. Each entry has
// a name, a priority, available() (ok, or the reason it cannot run here: "not compiled",
// "no CUDA device", "not implemented for this op"), supports(problem) (ok, or why this problem
// is outside what it computes) and the entry points. The `k3` tool, the tests, the benchmarks and
// the bindings all ask the registry; nothing outside it names a backend's functions.
//
// Options come in through BackendOptions; backends never read environment variables (the `k3`
// tool reads K3_NUM_THREADS and K3_ISA and passes them here). Left at their defaults, the options
// mean hardware facts: all logical CPUs and the best SIMD level of this CPU.
//
// The list is built explicitly (no static-initialisation registration, which a linker drops from
// static archives). Adding a backend: docs/architecture.md, "Adding a backend".
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "k3/kda.hpp"
#include "k3/linear.hpp"
#include "k3/moe.hpp"
#include "k3/status.hpp"
#include "k3/system.hpp"

namespace k3 {

struct BackendOptions {
  int threads = 0;              // CPU threads; 0: all logical CPUs (hardware_thread_count())
  std::optional<IsaLevel> isa;  // CPU SIMD level; unset: best_isa_level()
  // KDA prefill: kAuto = the backend's choice. The cpu backend runs recurrent or chunked as asked;
  // the reference backend is token-recurrent and refuses kChunked.
  kda::Algorithm kda_algorithm = kda::Algorithm::kAuto;
  // GPU backends: the device ordinal.
  int device = 0;
  // A backend's kernel path ("": the backend's own choice). The cuda MoE entry: one of the plan's
  // path names (k3 info lists them; cuda::moe_path_from_name). Backends without paths refuse a
  // non-empty one by name. No backend reads an environment variable: the k3 tool translates
  // K3_CUDA_MOE_PATH into this field.
  std::string path;
};

// ---- fused MoE -------------------------------------------------------------------------------
struct MoeBackend {
  std::string name;  // "reference", "cpu", "cuda"
  int priority = 0;  // default = highest priority whose available() is ok
  std::function<Status()> available;
  // Whether this backend computes `problem` with these options (threads, SIMD level, device,
  // path): its planner's verdict (cpu::plan, cuda::plan on options.device; the reference checks
  // the problem), ok or the reason, e.g. a SIMD level this CPU lacks, a path the device cannot run,
  // a layer whose tiles do not fit the device's shared memory. Call it after available().
  std::function<Status(const MoeProblem&, const BackendOptions&)> supports;
  // One call: out = M*K elements of the problem's out_dtype (little-endian bytes). Serving loops
  // that keep plans, packed weights and workspaces use the backend's own API (k3/cpu_moe.hpp,
  // k3/cuda_moe.hpp); this entry is for tools, validation and bindings.
  std::function<Status(const MoeProblem&, const MoeWeightsView&, const MoeInputsView&, std::span<uint8_t> out,
                       const BackendOptions&)>
      run;
};

std::span<const MoeBackend> moe_backends();  // highest priority first, then by name
// The backend called `name`; the error names the known ones.
Result<const MoeBackend*> find_moe_backend(std::string_view name);
// The usable backend of highest priority ("reference" is always usable).
const MoeBackend& default_moe_backend();
// Checks the buffers (validate_moe_buffers), out's size and supports(), then runs.
Status run_moe(const MoeBackend& b, const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in,
               std::span<uint8_t> out, const BackendOptions& opt = {});

// ---- dense linear (k3/linear.hpp) -------------------------------------------------------------
struct LinearBackend {
  std::string name;  // "reference" (the contract written plainly), "cpu"
  int priority = 0;
  std::function<Status()> available;
  std::function<Status(const LinearProblem&)> supports;
  // One call: out = M*N elements of the problem's out_dtype. Serving loops keep the plan, the
  // packed weights and the workspace (k3/cpu_linear.hpp); this entry is for tools and bindings.
  std::function<Status(const LinearProblem&, const LinearWeightsView&, int64_t m, std::span<const uint16_t> x,
                       std::span<uint8_t> out, const BackendOptions&)>
      run;
};

std::span<const LinearBackend> linear_backends();
Result<const LinearBackend*> find_linear_backend(std::string_view name);
const LinearBackend& default_linear_backend();
// Checks the weights and buffers, available() and supports(), then runs.
Status run_linear(const LinearBackend& b, const LinearProblem& p, const LinearWeightsView& w, int64_t m,
                  std::span<const uint16_t> x, std::span<uint8_t> out, const BackendOptions& opt = {});

// ---- Kimi Delta Attention --------------------------------------------------------------------
struct KdaBackend {
  std::string name;  // "reference" (FP32 recurrence), "cpu", "cuda"
  int priority = 0;
  std::function<Status()> available;
  std::function<Status(const kda::KdaConfig&)> supports;
  std::function<Status(const kda::KdaConfig&, const kda::KdaInputs&, const kda::KdaOutputs&, const BackendOptions&)>
      prefill;
  // Empty when the backend has no decode / verify entry (the registry then reports it).
  std::function<Status(const kda::KdaConfig&, const kda::DecodeArgs&, const BackendOptions&)> decode;
  std::function<Status(const kda::KdaConfig&, const kda::VerifyArgs&, const BackendOptions&)> verify;
  // Speculative verify without snapshots (k3/kda.hpp): the cpu backend only so far.
  std::function<Status(const kda::KdaConfig&, const kda::ReplayVerifyArgs&, const BackendOptions&)> verify_replay;
  std::function<Status(const kda::KdaConfig&, const kda::CommitArgs&, const BackendOptions&)> commit;
};

std::span<const KdaBackend> kda_backends();
Result<const KdaBackend*> find_kda_backend(std::string_view name);
const KdaBackend& default_kda_backend();
// Check available() and supports(cfg), then call the entry; a backend without the entry is
// kUnsupported: "kda backend 'reference' has no decode entry (it implements: prefill)".
Status run_kda_prefill(const KdaBackend& b, const kda::KdaConfig& cfg, const kda::KdaInputs& in,
                       const kda::KdaOutputs& out, const BackendOptions& opt = {});
Status run_kda_decode(const KdaBackend& b, const kda::KdaConfig& cfg, const kda::DecodeArgs& args,
                      const BackendOptions& opt = {});
Status run_kda_verify(const KdaBackend& b, const kda::KdaConfig& cfg, const kda::VerifyArgs& args,
                      const BackendOptions& opt = {});
Status run_kda_verify_replay(const KdaBackend& b, const kda::KdaConfig& cfg, const kda::ReplayVerifyArgs& args,
                             const BackendOptions& opt = {});
Status run_kda_commit(const KdaBackend& b, const kda::KdaConfig& cfg, const kda::CommitArgs& args,
                      const BackendOptions& opt = {});

}  // namespace k3
