// k3/backend.hpp — the backends of each op, in one place (the library's backend registry).
//
// Every op (fused MoE, KDA) has a fixed list of backends, highest priority first. Each entry has
// a name, a priority, available() (ok, or the reason it cannot run here: "not compiled",
// "no CUDA device", "not implemented for this op"), supports(problem) (ok, or why this problem
// is outside what it computes) and the entry points. The `k3` tool, the tests, the benchmarks and
// the bindings all ask the registry; nothing outside it names a backend's functions.
//
// Fused MoE layers are prepared once (prepare_moe: plan + weights in the backend's layout, held by
// a PreparedMoe) and run many times; the one-shot run_moe is prepare + run. The expert-parallel
// driver (k3/ep.hpp) takes a PreparedMoe, so every backend with the seam's host entry points runs
// distributed through the same code.
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
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "k3/kda.hpp"
#include "k3/kda_ops.hpp"
#include "k3/linear.hpp"
#include "k3/moe.hpp"
#include "k3/status.hpp"
#include "k3/system.hpp"

namespace k3 {

struct BackendOptions {
  int threads = 0;              // CPU threads; 0: all logical CPUs (hardware_thread_count())
  std::optional<IsaLevel> isa;  // CPU SIMD level; unset: best_isa_level()
  // cpu MoE on the FP32 levels: exact int16 block dots with AVX-VNNI's VPDPWSSD where the CPU has
  // it; false: VPMADDWD + VPADDD, as on a CPU without it (cpu::MoeOptions::avx_vnni; same bits).
  bool avx_vnni = true;
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
  // Prepared layers (prepare_moe): the largest M one call takes; 0: the backend's default (8192).
  int64_t max_tokens = 0;
};

// ---- fused MoE: a prepared layer -------------------------------------------------------------
// A layer prepared for one backend: its plan and its weights in the backend's layout, owned here
// (the caller's MoeWeightsView may be freed after prepare_moe). All buffers are host memory; a
// backend that computes elsewhere (cuda) copies in and out inside the call. Calls with distinct
// workspaces and outputs may run concurrently, except on the cuda backend (one call at a time per
// handle; it serializes them).
class PreparedMoe {
 public:
  virtual ~PreparedMoe() = default;
  virtual const std::string& backend() const = 0;  // "cpu", "cuda", "reference"
  virtual const MoeProblem& problem() const = 0;
  // What runs, one line: the plan's decisions (ISA and kernel, threads, tiles; the CUDA path that
  // runs with these weights, not only the one planned).
  virtual std::string describe() const = 0;
  // The kernel that runs, short: "avx512bf16 vdpbf16ps", "decode-splitk", "fp64 oracle".
  virtual std::string kernel() const = 0;
  virtual int64_t max_tokens() const = 0;       // the largest M of run() and run_experts()
  // Tokens one pass over the weights serves (a call of M tokens streams the weights
  // ceil(M / tokens_per_pass()) times; the cpu backend's chunk, else max_tokens()): the traffic model's input.
  virtual int64_t tokens_per_pass() const { return max_tokens(); }
  virtual int64_t workspace_bytes() const = 0;  // host workspace run() and run_experts() need (may be 0)
  // out = M*K elements of the problem's out_dtype. Checks the inputs (validate_moe_buffers with
  // the layer's shape), M <= max_tokens(), the workspace and out sizes.
  virtual Status run(const MoeInputsView& in, std::span<uint8_t> workspace, std::span<uint8_t> out) const = 0;

  // The expert-parallel seam (docs/distributed.md): run() = run_experts() + the contract's
  // finalize (cpu::finalize on the host: the same bits for every backend), with W4A8 rows
  // quantized by the contract's quantizer (cpu::quantize_x_mxfp8). ok when this backend has
  // run_experts on host buffers, else the reason (kUnsupported, naming the backend), which
  // run_experts then returns.
  virtual Status expert_parallel() const = 0;
  // y [local slots, K] FP32: the expert output of every slot whose id is a local expert, in slot
  // order, before the routing weights. in.topk_weights is not used. x_mxfp8 (W4A8 only): x already
  // quantized by the contract's quantizer (e.g. on the rank that sent it), in.x then empty.
  virtual Status run_experts(const MoeInputsView& in, std::span<uint8_t> workspace, std::span<float> y,
                             const Mxfp8Rows& x_mxfp8 = {}) const = 0;
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
  // Plans for options.max_tokens and takes the weights into the backend's layout. Called through
  // prepare_moe, which checks available(), supports() and the weights first.
  std::function<Result<std::unique_ptr<PreparedMoe>>(const MoeProblem&, const MoeWeightsView&, const BackendOptions&)>
      prepare;
};

std::span<const MoeBackend> moe_backends();  // highest priority first, then by name
// The backend called `name`; the error names the known ones.
Result<const MoeBackend*> find_moe_backend(std::string_view name);
// The usable backend of highest priority ("reference" is always usable).
const MoeBackend& default_moe_backend();
// Checks available(), the path option, supports() and the weights, then prepares the layer.
Result<std::unique_ptr<PreparedMoe>> prepare_moe(const MoeBackend& b, const MoeProblem& p, const MoeWeightsView& w,
                                                 const BackendOptions& opt = {});
// One call: checks the buffers (validate_moe_buffers) and out's size, then prepare_moe for M
// tokens and run. Serving loops keep the PreparedMoe instead.
Status run_moe(const MoeBackend& b, const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in,
               std::span<uint8_t> out, const BackendOptions& opt = {});

// ---- dense linear (k3/linear.hpp) -------------------------------------------------------------
// A dense linear layer prepared on one backend (prepare_linear): the plan and the weights in the
// backend's layout (cpu: the tiled, prepacked weights), owned by the handle; the caller owns the
// workspace. Calls with distinct workspaces and outputs may run concurrently.
class PreparedLinear {
 public:
  virtual ~PreparedLinear() = default;
  virtual const std::string& backend() const = 0;
  virtual const LinearProblem& problem() const = 0;
  virtual std::string describe() const = 0;      // one line: ISA level, kernels, tiles, workspace
  virtual int64_t max_tokens() const = 0;        // the largest M of run()
  virtual int64_t workspace_bytes() const = 0;
  virtual int64_t weight_bytes() const = 0;      // the weights as the handle holds them
  // out = M*N elements of the problem's out_dtype; checks x, out, M <= max_tokens() and the workspace.
  virtual Status run(int64_t m, std::span<const uint16_t> x, std::span<uint8_t> workspace,
                     std::span<uint8_t> out) const = 0;
};

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
  // The prepared layer (BackendOptions::max_tokens: 0 = 4096).
  std::function<Result<std::unique_ptr<PreparedLinear>>(const LinearProblem&, const LinearWeightsView&,
                                                        const BackendOptions&)>
      prepare;
};

std::span<const LinearBackend> linear_backends();
Result<const LinearBackend*> find_linear_backend(std::string_view name);
const LinearBackend& default_linear_backend();
// Checks the weights, the options, available() and supports(), then prepares.
Result<std::unique_ptr<PreparedLinear>> prepare_linear(const LinearBackend& b, const LinearProblem& p,
                                                       const LinearWeightsView& w, const BackendOptions& opt = {});
// Checks the weights and buffers, available() and supports(), then runs.
Status run_linear(const LinearBackend& b, const LinearProblem& p, const LinearWeightsView& w, int64_t m,
                  std::span<const uint16_t> x, std::span<uint8_t> out, const BackendOptions& opt = {});

class PreparedKda;  // below

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
  // The layer's small ops (k3/kda_ops.hpp): the short causal convolution (+ SiLU) and the gated
  // RMSNorm, FP32. The reference backend's are the FP64 references rounded once.
  std::function<Status(const kda::ConvArgs&, const BackendOptions&)> conv;
  std::function<Status(const kda::GatedRmsNormArgs&, const BackendOptions&)> rmsnorm;
  // The backend's own prepared layer (a plan kept across calls); empty: prepare_kda wraps the
  // one-shot entries above.
  std::function<Result<std::unique_ptr<PreparedKda>>(const kda::KdaConfig&, const BackendOptions&)> prepare;
};

// A KDA layer prepared on one backend (prepare_kda): the configuration and options checked once
// and the plan kept for every call (the cpu backend's cpu::KdaPlan: ISA level, threads, prefill
// algorithm, workspace size); the caller owns the workspace. A backend without a plan of its own
// (reference, cuda's host conveniences) runs its one-shot entries, with workspace_bytes() 0. A
// missing entry (decode on reference, ...) is kUnsupported, as run_kda_*.
class PreparedKda {
 public:
  virtual ~PreparedKda() = default;
  virtual const std::string& backend() const = 0;
  virtual const kda::KdaConfig& config() const = 0;
  virtual std::string describe() const = 0;       // one line: what runs
  virtual int64_t workspace_bytes() const = 0;    // host workspace every call needs (may be 0)
  virtual Status prefill(const kda::KdaInputs& in, const kda::KdaOutputs& out, std::span<uint8_t> workspace) const = 0;
  virtual Status decode(const kda::DecodeArgs& args, std::span<uint8_t> workspace) const = 0;
  virtual Status verify(const kda::VerifyArgs& args, std::span<uint8_t> workspace) const = 0;
  virtual Status verify_replay(const kda::ReplayVerifyArgs& args, std::span<uint8_t> workspace) const = 0;
  virtual Status commit(const kda::CommitArgs& args, std::span<uint8_t> workspace) const = 0;
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
// available(), supports(cfg) and the options (the cpu backend plans: threads, SIMD level,
// algorithm), then the handle.
Result<std::unique_ptr<PreparedKda>> prepare_kda(const KdaBackend& b, const kda::KdaConfig& cfg,
                                                 const BackendOptions& opt = {});
// The small ops: available() and the entry's presence, then the call (which checks its arguments).
Status run_kda_conv(const KdaBackend& b, const kda::ConvArgs& args, const BackendOptions& opt = {});
Status run_kda_rmsnorm(const KdaBackend& b, const kda::GatedRmsNormArgs& args, const BackendOptions& opt = {});

}  // namespace k3
