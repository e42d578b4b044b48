// The backend registry (k3/backend.hpp): the fixed, ordered list of backends of each op.
#include <algorithm>
#include <new>
#include <string>
#include <vector>

#include "k3/backend.hpp"
#include "k3/cpu_kda.hpp"
#include "k3/cpu_linear.hpp"
#include "k3/cpu_moe.hpp"
#include "k3/cuda.hpp"
#include "k3/cuda_kda.hpp"
#include "k3/cuda_kda_ops.hpp"
#include "k3/cuda_moe.hpp"
#include "k3/moe_ref.hpp"

namespace k3 {
namespace {

Status always() { return Status::ok(); }

// BackendOptions::path belongs to backends with kernel paths (the cuda MoE entry); others refuse it.
Status no_paths(const BackendOptions& o, const char* op, const std::string& backend) {
  if (o.path.empty()) return Status::ok();
  return invalid_argument(std::string("path = '") + o.path + "': the " + op + " backend '" + backend +
                          "' has no kernel paths (only the cuda moe backend takes one)");
}

// ---- MoE -------------------------------------------------------------------------------------

Status check_sizes(const MoeProblem& p, const MoeInputsView& in, int64_t max_tokens, std::span<const uint8_t> ws,
                   int64_t ws_bytes, std::span<const uint8_t> out) {
  K3_RETURN_IF_ERROR(validate_moe_inputs(p, in));
  if (in.m > max_tokens) {
    return invalid_argument("m = " + std::to_string(in.m) + " exceeds the prepared layer's max_tokens = " +
                            std::to_string(max_tokens) + " (BackendOptions::max_tokens at prepare_moe)");
  }
  if (static_cast<int64_t>(ws.size()) < ws_bytes) {
    return invalid_argument("workspace has " + std::to_string(ws.size()) + " bytes, the layer needs workspace_bytes() = " +
                            std::to_string(ws_bytes));
  }
  const int64_t want = in.m * p.shape.hidden * out_dtype_size(p.out_dtype);
  if (static_cast<int64_t>(out.size()) != want) {
    return invalid_argument("out has " + std::to_string(out.size()) + " bytes, expected M*K*" +
                            std::to_string(out_dtype_size(p.out_dtype)) + " = " + std::to_string(want));
  }
  return Status::ok();
}

int64_t max_tokens_of(const BackendOptions& o) { return o.max_tokens > 0 ? o.max_tokens : 8192; }

// A backend without the seam's host entry points: each returns why.
class NoSeam : public PreparedMoe {
 public:
  Status run_experts(const MoeInputsView&, std::span<uint8_t>, std::span<float>, const Mxfp8Rows&) const override {
    return expert_parallel();
  }
};

// The FP64 contract oracle rounded once to the output dtype: the slowest backend and the
// definition of the others. It keeps its own copy of the weights.
class ReferenceMoe final : public NoSeam {
 public:
  ReferenceMoe(const MoeProblem& p, const MoeWeightsView& w, int64_t max_tokens)
      : problem_(p), max_tokens_(max_tokens), fc1_q_(w.fc1_q.begin(), w.fc1_q.end()),
        fc1_s_(w.fc1_scale.begin(), w.fc1_scale.end()), fc2_q_(w.fc2_q.begin(), w.fc2_q.end()),
        fc2_s_(w.fc2_scale.begin(), w.fc2_scale.end()), beta_(w.situ_beta.begin(), w.situ_beta.end()),
        linear_beta_(w.situ_linear_beta.begin(), w.situ_linear_beta.end()) {}
  const std::string& backend() const override { return name_; }
  const MoeProblem& problem() const override { return problem_; }
  std::string describe() const override {
    return "reference: the FP64 contract oracle, rounded once to " + std::string(out_dtype_name(problem_.out_dtype)) +
           "; max_tokens " + std::to_string(max_tokens_);
  }
  std::string kernel() const override { return "fp64 oracle"; }
  int64_t max_tokens() const override { return max_tokens_; }
  int64_t workspace_bytes() const override { return 0; }
  Status run(const MoeInputsView& in, std::span<uint8_t> ws, std::span<uint8_t> out) const override {
    K3_RETURN_IF_ERROR(check_sizes(problem_, in, max_tokens_, ws, 0, out));
    std::vector<double> acc;
    try {
      acc.resize(static_cast<size_t>(in.m * problem_.shape.hidden));
    } catch (const std::bad_alloc&) {
      return unavailable("reference backend: out of memory for M*K = " + std::to_string(in.m * problem_.shape.hidden) +
                         " FP64 values");
    }
    const MoeWeightsView w{fc1_q_, fc1_s_, fc2_q_, fc2_s_, beta_, linear_beta_};
    K3_RETURN_IF_ERROR(moe_oracle(problem_, w, in, OracleKind::kContract, acc));
    round_output(acc, problem_.out_dtype, out);
    return Status::ok();
  }
  Status expert_parallel() const override {
    return unsupported("the moe backend 'reference' has no expert-parallel entry points: it computes the whole "
                       "layer in FP64 and rounds once, so it has no FP32 expert outputs to combine (use cpu)");
  }

 private:
  std::string name_ = "reference";
  MoeProblem problem_;
  int64_t max_tokens_;
  std::vector<uint8_t> fc1_q_, fc1_s_, fc2_q_, fc2_s_;
  std::vector<float> beta_, linear_beta_;
};

class CpuMoe final : public PreparedMoe {
 public:
  CpuMoe(cpu::MoePlan plan, cpu::PackedWeights weights) : plan_(std::move(plan)), weights_(std::move(weights)) {}
  const std::string& backend() const override { return name_; }
  const MoeProblem& problem() const override { return plan_.problem; }
  std::string describe() const override { return plan_.describe(); }
  std::string kernel() const override { return plan_.blocking.kernel; }
  int64_t max_tokens() const override { return plan_.max_tokens; }
  int64_t tokens_per_pass() const override { return plan_.chunk_tokens; }
  int64_t workspace_bytes() const override { return plan_.workspace_bytes; }
  Status run(const MoeInputsView& in, std::span<uint8_t> ws, std::span<uint8_t> out) const override {
    return cpu::run(plan_, weights_, in, ws, out);
  }
  Status expert_parallel() const override { return Status::ok(); }
  Status run_experts(const MoeInputsView& in, std::span<uint8_t> ws, std::span<float> y,
                     const Mxfp8Rows& x_mxfp8) const override {
    return cpu::run_experts(plan_, weights_, in, ws, y, x_mxfp8);
  }

 private:
  std::string name_ = "cpu";
  cpu::MoePlan plan_;
  cpu::PackedWeights weights_;
};

// The cuda backend from host buffers (cuda::HostMoe: device weights and buffers held; copies in
// and out per call). Its expert-parallel path works on device buffers over NCCL (k3/cuda_ep.hpp).
class CudaMoe final : public NoSeam {
 public:
  explicit CudaMoe(std::unique_ptr<cuda::HostMoe> layer) : layer_(std::move(layer)) {}
  const std::string& backend() const override { return name_; }
  const MoeProblem& problem() const override { return layer_->plan().problem; }
  std::string describe() const override {
    return layer_->plan().describe() + "; runs " + cuda::moe_path_name(layer_->path());
  }
  std::string kernel() const override { return cuda::moe_path_name(layer_->path()); }
  int64_t max_tokens() const override { return layer_->plan().max_tokens; }
  int64_t workspace_bytes() const override { return 0; }  // the device workspace is the layer's own
  Status run(const MoeInputsView& in, std::span<uint8_t>, std::span<uint8_t> out) const override {
    return layer_->run(in, out);
  }
  Status expert_parallel() const override {
    return unsupported("the moe backend 'cuda' has no host expert-parallel entry points: its expert-parallel path "
                       "runs on device buffers over NCCL (k3/cuda_ep.hpp); the host driver runs the cpu backend");
  }

 private:
  std::string name_ = "cuda";
  std::unique_ptr<cuda::HostMoe> layer_;
};

Result<std::unique_ptr<PreparedMoe>> moe_reference_prepare(const MoeProblem& p, const MoeWeightsView& w,
                                                           const BackendOptions& o) {
  try {
    return std::unique_ptr<PreparedMoe>(std::make_unique<ReferenceMoe>(p, w, max_tokens_of(o)));
  } catch (const std::bad_alloc&) {
    return unavailable("reference backend: out of memory for a copy of the weights");
  }
}

Result<std::unique_ptr<PreparedMoe>> moe_cpu_prepare(const MoeProblem& p, const MoeWeightsView& w,
                                                     const BackendOptions& opt) {
  cpu::MoeOptions o;
  o.max_tokens = max_tokens_of(opt);
  o.threads = opt.threads;
  o.isa = opt.isa;
  o.avx_vnni = opt.avx_vnni;
  K3_ASSIGN_OR_RETURN(cpu::MoePlan plan, cpu::plan(p, o));
  K3_ASSIGN_OR_RETURN(cpu::PackedWeights packed, cpu::prepack(plan, w));
  return std::unique_ptr<PreparedMoe>(std::make_unique<CpuMoe>(std::move(plan), std::move(packed)));
}

Result<std::unique_ptr<PreparedMoe>> moe_cuda_prepare(const MoeProblem& p, const MoeWeightsView& w,
                                                      const BackendOptions& o) {
  K3_ASSIGN_OR_RETURN(std::unique_ptr<cuda::HostMoe> layer,
                      cuda::HostMoe::create(p, w, max_tokens_of(o), o.path, o.device));
  return std::unique_ptr<PreparedMoe>(std::make_unique<CudaMoe>(std::move(layer)));
}

Status cuda_available() {
  auto devs = cuda::devices();
  if (!devs.is_ok()) return devs.status();
  if (!devs.value()[0].runnable) {
    return unavailable("CUDA device 0 (" + devs.value()[0].name + ") is not among the compiled architectures " +
                       cuda::compiled_archs());
  }
  return Status::ok();
}

Status moe_reference_supports(const MoeProblem& p, const BackendOptions&) {
  K3_RETURN_IF_ERROR(validate_moe_shape(p.shape));
  return validate_activation(p.activation);
}

Status moe_cpu_supports(const MoeProblem& p, const BackendOptions& opt) {
  cpu::MoeOptions o;
  o.max_tokens = 1;
  o.threads = opt.threads;
  o.isa = opt.isa;
  return cpu::plan(p, o).status();
}

Status moe_cuda_supports(const MoeProblem& p, const BackendOptions& opt) {
  cuda::MoeOptions o;
  o.max_tokens = 1;
  K3_ASSIGN_OR_RETURN(o.device, cuda::device_caps(opt.device));
  if (!opt.path.empty()) {
    K3_ASSIGN_OR_RETURN(o.path, cuda::moe_path_from_name(opt.path));
  }
  return cuda::plan(p, o).status();
}

// Priorities: cpu 10 > cuda 5 > reference 0. The CUDA kernels ran on one GPU once (an H200,
// 2026-12-04) and are not tuned, so they are used only when asked for by name.
std::vector<MoeBackend> make_moe_backends() {
  std::vector<MoeBackend> v;
  v.push_back({"cpu", 10, always, moe_cpu_supports, moe_cpu_prepare});
  v.push_back({"cuda", 5, cuda_available, moe_cuda_supports, moe_cuda_prepare});
  v.push_back({"reference", 0, always, moe_reference_supports, moe_reference_prepare});
  return v;
}

// ---- KDA -------------------------------------------------------------------------------------

cpu::KdaOptions kda_cpu_options(const BackendOptions& opt) {
  cpu::KdaOptions o;
  o.threads = opt.threads;
  o.algorithm = opt.kda_algorithm;
  o.isa = opt.isa;
  return o;
}

// The cpu backend's prepared KDA layer: its plan (ISA level, threads, prefill algorithm, workspace).
class CpuKda final : public PreparedKda {
 public:
  explicit CpuKda(cpu::KdaPlan plan) : plan_(std::move(plan)) {}
  const std::string& backend() const override { return name_; }
  const kda::KdaConfig& config() const override { return plan_.cfg; }
  std::string describe() const override { return plan_.describe(); }
  int64_t workspace_bytes() const override { return plan_.workspace_bytes; }
  Status prefill(const kda::KdaInputs& in, const kda::KdaOutputs& out, std::span<uint8_t> ws) const override {
    return cpu::prefill(plan_, in, out, ws);
  }
  Status decode(const kda::DecodeArgs& a, std::span<uint8_t> ws) const override { return cpu::decode(plan_, a, ws); }
  Status verify(const kda::VerifyArgs& a, std::span<uint8_t> ws) const override { return cpu::verify(plan_, a, ws); }
  Status verify_replay(const kda::ReplayVerifyArgs& a, std::span<uint8_t> ws) const override {
    return cpu::verify_replay(plan_, a, ws);
  }
  Status commit(const kda::CommitArgs& a, std::span<uint8_t> ws) const override { return cpu::commit(plan_, a, ws); }

 private:
  cpu::KdaPlan plan_;
  std::string name_ = "cpu";
};

std::vector<KdaBackend> make_kda_backends() {
  std::vector<KdaBackend> v;
  KdaBackend cpu;
  cpu.name = "cpu";
  cpu.priority = 10;
  cpu.available = always;
  cpu.supports = [](const kda::KdaConfig& c) { return kda::validate_config(c); };
  cpu.prefill = [](const kda::KdaConfig& c, const kda::KdaInputs& in, const kda::KdaOutputs& out,
                   const BackendOptions& o) { return cpu::prefill(c, in, out, kda_cpu_options(o)); };
  cpu.decode = [](const kda::KdaConfig& c, const kda::DecodeArgs& a, const BackendOptions& o) {
    return cpu::decode(c, a, kda_cpu_options(o));
  };
  cpu.verify = [](const kda::KdaConfig& c, const kda::VerifyArgs& a, const BackendOptions& o) {
    return cpu::verify(c, a, kda_cpu_options(o));
  };
  cpu.verify_replay = [](const kda::KdaConfig& c, const kda::ReplayVerifyArgs& a, const BackendOptions& o) {
    return cpu::verify_replay(c, a, kda_cpu_options(o));
  };
  cpu.commit = [](const kda::KdaConfig& c, const kda::CommitArgs& a, const BackendOptions& o) {
    return cpu::commit(c, a, kda_cpu_options(o));
  };
  cpu.conv = [](const kda::ConvArgs& a, const BackendOptions& o) { return kda::causal_conv1d(a, o.threads); };
  cpu.rmsnorm = [](const kda::GatedRmsNormArgs& a, const BackendOptions& o) { return kda::gated_rmsnorm(a, o.threads); };
  cpu.prepare = [](const kda::KdaConfig& c, const BackendOptions& o) -> Result<std::unique_ptr<PreparedKda>> {
    K3_ASSIGN_OR_RETURN(cpu::KdaPlan plan, cpu::plan(c, kda_cpu_options(o)));
    return std::unique_ptr<PreparedKda>(std::make_unique<CpuKda>(std::move(plan)));
  };
  v.push_back(std::move(cpu));
  KdaBackend cuda;
  cuda.name = "cuda";
  cuda.priority = 5;
  cuda.available = cuda_available;  // ran on an H200, 2026-12-04 (k3/cuda_kda.hpp)
  cuda.supports = [](const kda::KdaConfig& c) { return kda::validate_config(c); };
  cuda.prefill = [](const kda::KdaConfig& c, const kda::KdaInputs& in, const kda::KdaOutputs& out,
                    const BackendOptions& o) { return cuda::prefill_host(c, in, out, o.kda_algorithm); };
  cuda.decode = [](const kda::KdaConfig& c, const kda::DecodeArgs& a, const BackendOptions&) {
    return cuda::decode_host(c, a);
  };
  cuda.verify = [](const kda::KdaConfig& c, const kda::VerifyArgs& a, const BackendOptions&) {
    return cuda::verify_host(c, a);
  };
  cuda.conv = [](const kda::ConvArgs& a, const BackendOptions&) { return cuda::causal_conv1d_host(a); };
  cuda.rmsnorm = [](const kda::GatedRmsNormArgs& a, const BackendOptions&) { return cuda::gated_rmsnorm_host(a); };
  v.push_back(std::move(cuda));
  KdaBackend ref;
  ref.name = "reference";  // the FP32 token recurrence, prefill only
  ref.priority = 0;
  ref.available = always;
  ref.supports = [](const kda::KdaConfig& c) { return kda::validate_config(c); };
  ref.prefill = [](const kda::KdaConfig& c, const kda::KdaInputs& in, const kda::KdaOutputs& out,
                   const BackendOptions& o) {
    if (o.kda_algorithm == kda::Algorithm::kChunked) {
      return invalid_argument("algorithm = chunked: the reference backend is token-recurrent only (auto or recurrent)");
    }
    return kda::reference_fp32(c, in, out, o.threads);
  };
  ref.conv = [](const kda::ConvArgs& a, const BackendOptions&) { return kda::causal_conv1d_reference(a); };
  ref.rmsnorm = [](const kda::GatedRmsNormArgs& a, const BackendOptions&) { return kda::gated_rmsnorm_reference(a); };
  v.push_back(std::move(ref));
  return v;
}

template <typename B>
Result<const B*> find_in(std::span<const B> list, std::string_view name, const char* op) {
  std::string known;
  for (const auto& b : list) {
    if (b.name == name) return &b;
    known += (known.empty() ? "" : ", ") + b.name;
  }
  return invalid_argument(std::string(op) + " backend '" + std::string(name) + "' is not known (known: " + known +
                          ")");
}

template <typename B>
const B& default_in(std::span<const B> list) {
  for (const auto& b : list) {
    if (b.available().is_ok()) return b;
  }
  return list.back();  // "reference", always available
}

}  // namespace

std::span<const MoeBackend> moe_backends() {
  static const std::vector<MoeBackend> list = make_moe_backends();
  return list;
}

Result<const MoeBackend*> find_moe_backend(std::string_view name) { return find_in(moe_backends(), name, "moe"); }

const MoeBackend& default_moe_backend() { return default_in(moe_backends()); }

Result<std::unique_ptr<PreparedMoe>> prepare_moe(const MoeBackend& b, const MoeProblem& p, const MoeWeightsView& w,
                                                 const BackendOptions& opt) {
  if (b.name != "cuda") K3_RETURN_IF_ERROR(no_paths(opt, "moe", b.name));
  if (opt.max_tokens < 0 || opt.max_tokens > (int64_t{1} << 24)) {
    return invalid_argument("max_tokens = " + std::to_string(opt.max_tokens) +
                            " must be in [1, 2^24] (0: the backend's default, 8192)");
  }
  K3_RETURN_IF_ERROR(b.available());
  K3_RETURN_IF_ERROR(b.supports(p, opt));
  K3_RETURN_IF_ERROR(validate_moe_weights(p, w));
  return b.prepare(p, w, opt);
}

Status run_moe(const MoeBackend& b, const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in,
               std::span<uint8_t> out, const BackendOptions& opt) {
  K3_RETURN_IF_ERROR(validate_moe_buffers(p, w, in));
  const int64_t want = in.m * p.shape.hidden * out_dtype_size(p.out_dtype);
  if (static_cast<int64_t>(out.size()) != want) {
    return invalid_argument("out has " + std::to_string(out.size()) + " bytes, expected M*K*" +
                            std::to_string(out_dtype_size(p.out_dtype)) + " = " + std::to_string(want));
  }
  BackendOptions o = opt;
  o.max_tokens = std::max<int64_t>(1, in.m);
  K3_ASSIGN_OR_RETURN(const std::unique_ptr<PreparedMoe> layer, prepare_moe(b, p, w, o));
  std::vector<uint8_t> ws(static_cast<size_t>(layer->workspace_bytes()));
  return layer->run(in, ws, out);
}

namespace {

int64_t linear_max_tokens(const BackendOptions& opt) { return opt.max_tokens > 0 ? opt.max_tokens : 4096; }

// The cpu backend's prepared linear layer: its plan and the prepacked weights.
class CpuLinearLayer final : public PreparedLinear {
 public:
  CpuLinearLayer(cpu::LinearPlan plan, cpu::PackedLinear packed) : plan_(std::move(plan)), packed_(std::move(packed)) {}
  const std::string& backend() const override { return name_; }
  const LinearProblem& problem() const override { return plan_.problem; }
  std::string describe() const override { return plan_.describe(); }
  int64_t max_tokens() const override { return plan_.max_tokens; }
  int64_t workspace_bytes() const override { return plan_.workspace_bytes; }
  int64_t weight_bytes() const override { return packed_.bytes(); }
  Status run(int64_t m, std::span<const uint16_t> x, std::span<uint8_t> ws, std::span<uint8_t> out) const override {
    return cpu::run(plan_, packed_, m, x, ws, out);
  }

 private:
  cpu::LinearPlan plan_;
  cpu::PackedLinear packed_;
  std::string name_ = "cpu";
};

// The reference backend's: its own copy of the weights, the contract written plainly per call.
class ReferenceLinearLayer final : public PreparedLinear {
 public:
  ReferenceLinearLayer(const LinearProblem& p, const LinearWeightsView& w, int64_t max_tokens)
      : p_(p), codes_(w.codes.begin(), w.codes.end()), scales_(w.scales.begin(), w.scales.end()),
        bias_(w.bias.begin(), w.bias.end()), bf16_(w.bf16.begin(), w.bf16.end()), max_tokens_(max_tokens) {}
  const std::string& backend() const override { return name_; }
  const LinearProblem& problem() const override { return p_; }
  std::string describe() const override {
    return "linear reference: the contract written plainly (FP64 sums), K " + std::to_string(p_.k) + " -> N " +
           std::to_string(p_.n) + ", max_tokens " + std::to_string(max_tokens_);
  }
  int64_t max_tokens() const override { return max_tokens_; }
  int64_t workspace_bytes() const override { return 0; }
  int64_t weight_bytes() const override {
    return static_cast<int64_t>(codes_.size() + scales_.size() + 4 * bias_.size() + 2 * bf16_.size());
  }
  Status run(int64_t m, std::span<const uint16_t> x, std::span<uint8_t>, std::span<uint8_t> out) const override {
    if (m > max_tokens_) {
      return invalid_argument("M = " + std::to_string(m) + " is above the layer's max_tokens = " + std::to_string(max_tokens_));
    }
    K3_RETURN_IF_ERROR(validate_linear_io(p_, m, x, out));
    return linear_reference(p_, {codes_, scales_, bias_, bf16_}, m, x, out);
  }

 private:
  LinearProblem p_;
  std::vector<uint8_t> codes_, scales_;
  std::vector<float> bias_;
  std::vector<uint16_t> bf16_;
  int64_t max_tokens_;
  std::string name_ = "reference";
};

std::vector<LinearBackend> make_linear_backends() {
  std::vector<LinearBackend> list;
  list.push_back({"cpu", 50, always, [](const LinearProblem&) { return Status::ok(); },
                  [](const LinearProblem& p, const LinearWeightsView& w, int64_t m, std::span<const uint16_t> x,
                     std::span<uint8_t> out, const BackendOptions& opt) -> Status {
                    cpu::LinearOptions o;
                    o.threads = opt.threads;
                    o.isa = opt.isa;
                    o.max_tokens = std::max<int64_t>(1, m);
                    K3_ASSIGN_OR_RETURN(auto plan, cpu::plan(p, o));
                    K3_ASSIGN_OR_RETURN(auto packed, cpu::prepack(plan, w));
                    std::vector<uint8_t> ws;
                    try {
                      ws.resize(static_cast<size_t>(plan.workspace_bytes));
                    } catch (const std::bad_alloc&) {
                      return unavailable("linear cpu backend: out of memory for a workspace of " +
                                         std::to_string(plan.workspace_bytes) + " bytes");
                    }
                    return cpu::run(plan, packed, m, x, ws, out);
                  },
                  [](const LinearProblem& p, const LinearWeightsView& w,
                     const BackendOptions& opt) -> Result<std::unique_ptr<PreparedLinear>> {
                    cpu::LinearOptions o;
                    o.threads = opt.threads;
                    o.isa = opt.isa;
                    o.max_tokens = linear_max_tokens(opt);
                    K3_ASSIGN_OR_RETURN(auto plan, cpu::plan(p, o));
                    K3_ASSIGN_OR_RETURN(auto packed, cpu::prepack(plan, w));
                    return std::unique_ptr<PreparedLinear>(
                        std::make_unique<CpuLinearLayer>(std::move(plan), std::move(packed)));
                  }});
  list.push_back({"reference", 0, always, [](const LinearProblem&) { return Status::ok(); },
                  [](const LinearProblem& p, const LinearWeightsView& w, int64_t m, std::span<const uint16_t> x,
                     std::span<uint8_t> out, const BackendOptions&) { return linear_reference(p, w, m, x, out); },
                  [](const LinearProblem& p, const LinearWeightsView& w,
                     const BackendOptions& opt) -> Result<std::unique_ptr<PreparedLinear>> {
                    return std::unique_ptr<PreparedLinear>(
                        std::make_unique<ReferenceLinearLayer>(p, w, linear_max_tokens(opt)));
                  }});
  return list;
}

}  // namespace

std::span<const LinearBackend> linear_backends() {
  static const std::vector<LinearBackend> list = make_linear_backends();
  return list;
}

Result<const LinearBackend*> find_linear_backend(std::string_view name) {
  return find_in(linear_backends(), name, "linear");
}

const LinearBackend& default_linear_backend() { return default_in(linear_backends()); }

Result<std::unique_ptr<PreparedLinear>> prepare_linear(const LinearBackend& b, const LinearProblem& p,
                                                       const LinearWeightsView& w, const BackendOptions& opt) {
  K3_RETURN_IF_ERROR(validate_linear_weights(p, w));
  K3_RETURN_IF_ERROR(no_paths(opt, "linear", b.name));
  if (opt.max_tokens < 0 || opt.max_tokens > (int64_t{1} << 24)) {
    return invalid_argument("max_tokens = " + std::to_string(opt.max_tokens) +
                            " must be in [1, 2^24] (0: the backend's default, 4096)");
  }
  K3_RETURN_IF_ERROR(b.available());
  K3_RETURN_IF_ERROR(b.supports(p));
  if (!b.prepare) return unsupported("linear backend '" + b.name + "' has no prepared layer");
  return b.prepare(p, w, opt);
}

Status run_linear(const LinearBackend& b, const LinearProblem& p, const LinearWeightsView& w, int64_t m,
                  std::span<const uint16_t> x, std::span<uint8_t> out, const BackendOptions& opt) {
  K3_RETURN_IF_ERROR(validate_linear_weights(p, w));
  K3_RETURN_IF_ERROR(validate_linear_io(p, m, x, out));
  K3_RETURN_IF_ERROR(no_paths(opt, "linear", b.name));
  K3_RETURN_IF_ERROR(b.available());
  K3_RETURN_IF_ERROR(b.supports(p));
  return b.run(p, w, m, x, out, opt);
}

std::span<const KdaBackend> kda_backends() {
  static const std::vector<KdaBackend> list = make_kda_backends();
  return list;
}

Result<const KdaBackend*> find_kda_backend(std::string_view name) { return find_in(kda_backends(), name, "kda"); }

const KdaBackend& default_kda_backend() { return default_in(kda_backends()); }

namespace {

// no kernel path asked for, available(), supports(cfg) and the entry's presence, in that order.
Status kda_ready(const KdaBackend& b, const kda::KdaConfig& cfg, bool has_entry, const char* entry,
                 const BackendOptions& opt) {
  K3_RETURN_IF_ERROR(no_paths(opt, "kda", b.name));
  K3_RETURN_IF_ERROR(b.available());
  K3_RETURN_IF_ERROR(b.supports(cfg));
  if (has_entry) return Status::ok();
  std::string has;
  if (b.prefill) has += "prefill";
  if (b.decode) has += std::string(has.empty() ? "" : ", ") + "decode";
  if (b.verify) has += std::string(has.empty() ? "" : ", ") + "verify";
  if (b.verify_replay) has += std::string(has.empty() ? "" : ", ") + "verify_replay";
  if (b.commit) has += std::string(has.empty() ? "" : ", ") + "commit";
  if (b.conv) has += std::string(has.empty() ? "" : ", ") + "conv";
  if (b.rmsnorm) has += std::string(has.empty() ? "" : ", ") + "rmsnorm";
  return unsupported("kda backend '" + b.name + "' has no " + entry + " entry (it implements: " +
                     (has.empty() ? "nothing" : has) + ")");
}

// The small ops have no KdaConfig: the path option, available() and the entry's presence.
Status kda_op_ready(const KdaBackend& b, bool has_entry, const char* entry, const BackendOptions& opt) {
  K3_RETURN_IF_ERROR(no_paths(opt, "kda", b.name));
  K3_RETURN_IF_ERROR(b.available());
  if (has_entry) return Status::ok();
  return unsupported("kda backend '" + b.name + "' has no " + entry + " entry");
}

}  // namespace

Status run_kda_prefill(const KdaBackend& b, const kda::KdaConfig& cfg, const kda::KdaInputs& in,
                       const kda::KdaOutputs& out, const BackendOptions& opt) {
  K3_RETURN_IF_ERROR(kda_ready(b, cfg, static_cast<bool>(b.prefill), "prefill", opt));
  return b.prefill(cfg, in, out, opt);
}

Status run_kda_decode(const KdaBackend& b, const kda::KdaConfig& cfg, const kda::DecodeArgs& args,
                      const BackendOptions& opt) {
  K3_RETURN_IF_ERROR(kda_ready(b, cfg, static_cast<bool>(b.decode), "decode", opt));
  return b.decode(cfg, args, opt);
}

Status run_kda_verify(const KdaBackend& b, const kda::KdaConfig& cfg, const kda::VerifyArgs& args,
                      const BackendOptions& opt) {
  K3_RETURN_IF_ERROR(kda_ready(b, cfg, static_cast<bool>(b.verify), "verify", opt));
  return b.verify(cfg, args, opt);
}

Status run_kda_verify_replay(const KdaBackend& b, const kda::KdaConfig& cfg, const kda::ReplayVerifyArgs& args,
                             const BackendOptions& opt) {
  K3_RETURN_IF_ERROR(kda_ready(b, cfg, static_cast<bool>(b.verify_replay), "verify_replay", opt));
  return b.verify_replay(cfg, args, opt);
}

Status run_kda_commit(const KdaBackend& b, const kda::KdaConfig& cfg, const kda::CommitArgs& args,
                      const BackendOptions& opt) {
  K3_RETURN_IF_ERROR(kda_ready(b, cfg, static_cast<bool>(b.commit), "commit", opt));
  return b.commit(cfg, args, opt);
}

namespace {

// A backend without a plan of its own: its one-shot entries behind the handle (workspace 0).
class OneShotKda final : public PreparedKda {
 public:
  OneShotKda(const KdaBackend& b, const kda::KdaConfig& cfg, const BackendOptions& opt) : b_(b), cfg_(cfg), opt_(opt) {}
  const std::string& backend() const override { return b_.name; }
  const kda::KdaConfig& config() const override { return cfg_; }
  std::string describe() const override {
    return "kda backend '" + b_.name + "': its one-shot entries (no plan kept), threads " + std::to_string(opt_.threads) +
           ", algorithm " + kda::algorithm_name(opt_.kda_algorithm);
  }
  int64_t workspace_bytes() const override { return 0; }
  Status prefill(const kda::KdaInputs& in, const kda::KdaOutputs& out, std::span<uint8_t>) const override {
    return run_kda_prefill(b_, cfg_, in, out, opt_);
  }
  Status decode(const kda::DecodeArgs& a, std::span<uint8_t>) const override { return run_kda_decode(b_, cfg_, a, opt_); }
  Status verify(const kda::VerifyArgs& a, std::span<uint8_t>) const override { return run_kda_verify(b_, cfg_, a, opt_); }
  Status verify_replay(const kda::ReplayVerifyArgs& a, std::span<uint8_t>) const override {
    return run_kda_verify_replay(b_, cfg_, a, opt_);
  }
  Status commit(const kda::CommitArgs& a, std::span<uint8_t>) const override { return run_kda_commit(b_, cfg_, a, opt_); }

 private:
  const KdaBackend& b_;
  kda::KdaConfig cfg_;
  BackendOptions opt_;
};

}  // namespace

Result<std::unique_ptr<PreparedKda>> prepare_kda(const KdaBackend& b, const kda::KdaConfig& cfg,
                                                 const BackendOptions& opt) {
  K3_RETURN_IF_ERROR(kda_ready(b, cfg, true, "", opt));
  if (b.prepare) return b.prepare(cfg, opt);
  return std::unique_ptr<PreparedKda>(std::make_unique<OneShotKda>(b, cfg, opt));
}

Status run_kda_conv(const KdaBackend& b, const kda::ConvArgs& args, const BackendOptions& opt) {
  K3_RETURN_IF_ERROR(kda_op_ready(b, static_cast<bool>(b.conv), "conv", opt));
  return b.conv(args, opt);
}

Status run_kda_rmsnorm(const KdaBackend& b, const kda::GatedRmsNormArgs& args, const BackendOptions& opt) {
  K3_RETURN_IF_ERROR(kda_op_ready(b, static_cast<bool>(b.rmsnorm), "rmsnorm", opt));
  return b.rmsnorm(args, opt);
}

}  // namespace k3
