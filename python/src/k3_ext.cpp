// _k3: the Python extension of k3 (nanobind). Arrays cross as DLPack tensors (nb::ndarray):
// numpy, torch (CPU), CuPy / JAX host arrays, all without copies. Outputs are always passed in by
// the Python layer (python/k3/*.py allocates them when the caller does not), so every kernel
// writes into the caller's memory. Long calls release the GIL. A k3::Status error raises
// ValueError (invalid argument, out of range) or RuntimeError (the rest) with the library's text.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <functional>
#include <utility>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "k3/backend.hpp"
#include "k3/checkpoint.hpp"
#include "k3/cpu_linear.hpp"
#include "k3/cpu_moe.hpp"
#include "k3/cuda.hpp"
#include "k3/cuda_kda.hpp"
#include "k3/cuda_moe.hpp"
#include "k3/cuda_routing.hpp"
#include "k3/harness/bench.hpp"
#include "k3/harness/limits.hpp"
#include "k3/harness/validate.hpp"
#include "k3/kda.hpp"
#include "k3/kda_ops.hpp"
#include "k3/norm.hpp"
#include "k3/model.hpp"
#include "k3/moe.hpp"
#include "k3/mx.hpp"
#include "k3/routing.hpp"
#include "k3/system.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

template <typename T>
using In = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;
template <typename T>
using Out = nb::ndarray<T, nb::c_contig, nb::device::cpu>;

void check(const k3::Status& st) {
  if (st.is_ok()) return;
  if (st.code() == k3::StatusCode::kInvalidArgument || st.code() == k3::StatusCode::kOutOfRange) {
    throw nb::value_error(st.to_string().c_str());
  }
  throw std::runtime_error(st.to_string());
}

template <typename T>
T value(k3::Result<T> r) {
  check(r.status());
  return std::move(r.value());
}

// An output of any dtype (the MoE output: BF16 / FP16 bits or FP32), as bytes.
using AnyOut = nb::ndarray<nb::c_contig, nb::device::cpu>;
std::span<uint8_t> bytes(AnyOut& a) { return {static_cast<uint8_t*>(a.data()), a.nbytes()}; }

// Any array (host or device, In / Out / DIn / DOut) as a span of its elements; None as an empty span.
template <typename T, typename... P>
std::span<T> span(const nb::ndarray<T, P...>& a) {
  return {a.data(), a.size()};
}
template <typename T, typename... P>
std::span<T> span(const std::optional<nb::ndarray<T, P...>>& a) {
  return a ? std::span<T>(a->data(), a->size()) : std::span<T>();
}

k3::BackendOptions options(int threads, const std::string& isa) {
  k3::BackendOptions o;
  o.threads = threads;
  if (!isa.empty()) o.isa = value(k3::parse_isa_level(isa));
  return o;
}

// ---- info ----------------------------------------------------------------------------------
nb::dict info() {
  nb::dict d;
  d["isa"] = k3::isa_level_name(k3::best_isa_level());
  d["default_threads"] = k3::hardware_thread_count();  // what threads=0 means; no K3_NUM_THREADS
  auto entry = [](const std::string& name, int priority, const k3::Status& a) {
    nb::dict e;
    e["name"] = name;
    e["priority"] = priority;
    e["available"] = a.is_ok();
    e["reason"] = a.message();
    return e;
  };
  nb::list moe, kda, lin;
  for (const auto& b : k3::moe_backends()) moe.append(entry(b.name, b.priority, b.available()));
  for (const auto& b : k3::kda_backends()) kda.append(entry(b.name, b.priority, b.available()));
  for (const auto& b : k3::linear_backends()) lin.append(entry(b.name, b.priority, b.available()));
  d["moe_backends"] = moe;
  d["kda_backends"] = kda;
  d["linear_backends"] = lin;
  // The CUDA part of this build: compiled in or not, and the devices (or why there are none).
  nb::dict c;
  c["compiled"] = k3::cuda::compiled();
  c["archs"] = k3::cuda::compiled_archs();
  nb::list devs;
  if (auto ds = k3::cuda::devices(); ds.is_ok()) {
    for (const auto& dv : *ds) {
      nb::dict e;
      e["index"] = dv.index;
      e["name"] = dv.name;
      e["cc"] = std::to_string(dv.cc_major) + "." + std::to_string(dv.cc_minor);
      e["runnable"] = dv.runnable;
      devs.append(e);
    }
    c["reason"] = "";
  } else {
    c["reason"] = ds.status().message();
  }
  c["devices"] = devs;
  d["cuda"] = c;
  return d;
}

// ---- MX ------------------------------------------------------------------------------------
k3::MxElement element(const std::string& e) {
  if (e == "mxfp4") return k3::MxElement::kE2M1;
  if (e == "mxfp8") return k3::MxElement::kE4M3;
  throw nb::value_error(("element = '" + e + "' must be 'mxfp4' or 'mxfp8'").c_str());
}
k3::ScaleRule rule(const std::string& r) {
  if (r == "rceil") return k3::ScaleRule::kRceil;
  if (r == "floor") return k3::ScaleRule::kFloor;
  throw nb::value_error(("rule = '" + r + "' must be 'rceil' or 'floor'").c_str());
}

void mx_quantize(In<float> x, int64_t rows, int64_t cols, const std::string& e, const std::string& r, Out<uint8_t> q,
                 Out<uint8_t> scales) {
  const auto el = element(e);
  const auto ru = rule(r);
  nb::gil_scoped_release release;
  check(k3::mx_quantize(span(x), rows, cols, el, ru, span(q), span(scales)));
}

void mx_quantize_bf16(In<uint16_t> x, int64_t rows, int64_t cols, const std::string& e, const std::string& r,
                      Out<uint8_t> q, Out<uint8_t> scales) {
  const auto el = element(e);
  const auto ru = rule(r);
  nb::gil_scoped_release release;
  check(k3::mx_quantize_bf16(span(x), rows, cols, el, ru, span(q), span(scales)));
}

void mx_dequantize(In<uint8_t> q, In<uint8_t> scales, int64_t rows, int64_t cols, const std::string& e,
                   Out<float> out) {
  const auto el = element(e);
  nb::gil_scoped_release release;
  check(k3::mx_dequantize(span(q), span(scales), rows, cols, el, span(out)));
}

// ---- routing -------------------------------------------------------------------------------
void route(In<float> logits, std::optional<In<float>> bias, int64_t m, int num_experts, int top_k, int n_group,
           int topk_group, bool renormalize, float scaling, Out<int32_t> ids, Out<float> weights) {
  k3::RoutingConfig cfg;
  cfg.num_experts = num_experts;
  cfg.top_k = top_k;
  cfg.n_group = n_group;
  cfg.topk_group = topk_group;
  cfg.renormalize = renormalize;
  cfg.routed_scaling_factor = scaling;
  nb::gil_scoped_release release;
  check(k3::route(cfg, m, span(logits), span(bias), span(ids), span(weights)));
}

// ---- fused MoE -----------------------------------------------------------------------------
k3::MoeProblem moe_problem(int64_t hidden, int64_t intermediate, int num_experts, int top_k, int ep_size, int ep_rank,
                           const std::string& recipe, const std::string& activation, const std::string& out_dtype,
                           float situ_beta, float situ_linear_beta, float swiglu_alpha, float swiglu_beta,
                           float swiglu_limit) {
  k3::MoeProblem p;
  p.shape = {hidden, intermediate, num_experts, top_k, ep_size, ep_rank};
  p.recipe = value(k3::parse_recipe(recipe));
  p.activation.kind = value(k3::parse_activation(activation));
  p.activation.situ_beta = situ_beta;
  p.activation.situ_linear_beta = situ_linear_beta;
  p.activation.swiglu_alpha = swiglu_alpha;
  p.activation.swiglu_beta = swiglu_beta;
  p.activation.swiglu_limit = swiglu_limit;
  p.out_dtype = value(k3::parse_out_dtype(out_dtype));
  check(k3::validate_moe_shape(p.shape));
  return p;
}

struct MoeWeights {
  In<uint8_t> fc1_q, fc1_scale, fc2_q, fc2_scale;
  k3::MoeWeightsView view() const { return {span(fc1_q), span(fc1_scale), span(fc2_q), span(fc2_scale), {}, {}}; }
};

void moe_run(const k3::MoeProblem& p, In<uint8_t> fc1_q, In<uint8_t> fc1_scale, In<uint8_t> fc2_q,
             In<uint8_t> fc2_scale, In<uint16_t> x, In<int32_t> ids, In<float> weights, int64_t m,
             const std::string& backend, int threads, const std::string& isa, AnyOut out) {
  const k3::MoeBackend* b = backend.empty() ? &k3::default_moe_backend() : value(k3::find_moe_backend(backend));
  const k3::BackendOptions o = options(threads, isa);
  const MoeWeights w{fc1_q, fc1_scale, fc2_q, fc2_scale};
  const k3::MoeInputsView in{m, span(x), span(ids), span(weights)};
  nb::gil_scoped_release release;
  check(k3::run_moe(*b, p, w.view(), in, bytes(out), o));
}

// A layer prepared once through the registry (k3/backend.hpp prepare_moe: plan + weights in the
// backend's layout), run per batch with caller buffers. One workspace per object: concurrent run()
// calls on the same object take turns (the mutex is taken after the GIL is released, so other
// Python threads keep running).
struct PreparedMoe {
  std::unique_ptr<k3::PreparedMoe> layer;
  std::vector<uint8_t> workspace;
  std::mutex mu;
};

PreparedMoe* moe_prepare(const k3::MoeProblem& p, const std::string& backend, int64_t max_tokens, int threads,
                         const std::string& isa, In<uint8_t> fc1_q, In<uint8_t> fc1_scale, In<uint8_t> fc2_q,
                         In<uint8_t> fc2_scale) {
  const k3::MoeBackend* b = backend.empty() ? &k3::default_moe_backend() : value(k3::find_moe_backend(backend));
  k3::BackendOptions o = options(threads, isa);
  o.max_tokens = max_tokens;
  const MoeWeights w{fc1_q, fc1_scale, fc2_q, fc2_scale};
  std::optional<k3::Result<std::unique_ptr<k3::PreparedMoe>>> made;
  {
    nb::gil_scoped_release release;
    made.emplace(k3::prepare_moe(*b, p, w.view(), o));
  }
  auto* c = new PreparedMoe{value(std::move(*made)), {}, {}};
  c->workspace.resize(static_cast<size_t>(c->layer->workspace_bytes()));
  return c;
}

void prepared_moe_run(PreparedMoe& c, In<uint16_t> x, In<int32_t> ids, In<float> weights, int64_t m, AnyOut out) {
  const k3::MoeInputsView in{m, span(x), span(ids), span(weights)};
  nb::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(c.mu);
  check(c.layer->run(in, c.workspace, bytes(out)));
}

// ---- dense linear (k3/linear.hpp, k3/cpu_linear.hpp) ----------------------------------------
k3::LinearProblem linear_problem(int64_t k, int64_t n, const std::string& recipe, const std::string& out_dtype,
                                 bool bias) {
  k3::LinearProblem p;
  p.k = k;
  p.n = n;
  p.recipe = value(k3::parse_linear_recipe(recipe));
  p.out_dtype = value(k3::parse_out_dtype(out_dtype));
  p.bias = bias;
  check(k3::validate_linear_problem(p));
  return p;
}

// Weights: MXFP8 codes + scales (w8a8, w8a16), or BF16 bits (w16a16); the library names a missing
// or extra field.
k3::LinearWeightsView linear_weights(const std::optional<In<uint8_t>>& codes, const std::optional<In<uint8_t>>& scales,
                                     const std::optional<In<uint16_t>>& bf16, const std::optional<In<float>>& bias) {
  return {codes ? span(*codes) : std::span<const uint8_t>{}, scales ? span(*scales) : std::span<const uint8_t>{},
          bias ? span(*bias) : std::span<const float>{}, bf16 ? span(*bf16) : std::span<const uint16_t>{}};
}

void linear_run(int64_t k, int64_t n, const std::string& recipe, const std::string& out_dtype,
                std::optional<In<uint8_t>> codes, std::optional<In<uint8_t>> scales, std::optional<In<uint16_t>> bf16,
                std::optional<In<float>> bias, In<uint16_t> x, int64_t m, const std::string& backend, int threads,
                const std::string& isa, AnyOut out) {
  const k3::LinearProblem p = linear_problem(k, n, recipe, out_dtype, bias.has_value());
  const k3::LinearBackend* b = backend.empty() ? &k3::default_linear_backend() : value(k3::find_linear_backend(backend));
  const k3::BackendOptions o = options(threads, isa);
  const k3::LinearWeightsView w = linear_weights(codes, scales, bf16, bias);
  nb::gil_scoped_release release;
  check(k3::run_linear(*b, p, w, m, span(x), bytes(out), o));
}

// Plan once, prepack once, run per batch (one workspace per object; concurrent calls take turns).
// k3.linear.CpuLinear: the registry's prepared layer on the cpu backend, with its workspace.
struct CpuLinear {
  std::unique_ptr<k3::PreparedLinear> layer;
  std::vector<uint8_t> workspace;
  std::mutex mu;
};

// RMSNorm of rows (k3/norm.hpp), BF16 bits or FP32 storage; y may be x.
template <typename T>
void rms_norm(In<T> x, In<T> weight, Out<T> y, int64_t dim, float eps, int threads) {
  k3::RmsNormArgs<T> a{dim, eps, span(x), span(weight), span(y)};
  nb::gil_scoped_release release;
  check(k3::rms_norm(a, threads));
}

// The gated RMSNorm of rows (k3/norm.hpp: transformers' KimiLinearRMSNormGated); y may be x.
template <typename T>
void rms_norm_gated(In<T> x, In<T> gate, In<T> weight, Out<T> y, int64_t dim, float eps, int threads) {
  k3::GatedRmsNormRowsArgs<T> a{dim, eps, span(x), span(gate), span(weight), span(y)};
  nb::gil_scoped_release release;
  check(k3::rms_norm_gated(a, threads));
}

// y[h, :] = x[h, :] . w[h] per head (MLA's absorbed decode; k3/cpu_linear.hpp head_gemv_bf16):
// w BF16 bits [H, K, N], x FP32 [H, K], y FP32 [H, N].
void head_gemv_bf16(In<uint16_t> w, In<float> x, Out<float> y, int64_t heads, int64_t k, int64_t n, int threads,
                    const std::string& isa) {
  k3::cpu::HeadGemvArgs a{heads, k, n, span(w), span(x), span(y)};
  std::optional<k3::IsaLevel> level;
  if (!isa.empty()) level = value(k3::parse_isa_level(isa));
  nb::gil_scoped_release release;
  check(k3::cpu::head_gemv_bf16(a, threads, level));
}

CpuLinear* cpu_linear_prepare(int64_t k, int64_t n, const std::string& recipe, const std::string& out_dtype,
                              std::optional<In<uint8_t>> codes, std::optional<In<uint8_t>> scales,
                              std::optional<In<uint16_t>> bf16, std::optional<In<float>> bias, int64_t max_tokens,
                              int threads, const std::string& isa) {
  const k3::LinearProblem p = linear_problem(k, n, recipe, out_dtype, bias.has_value());
  if (max_tokens < 1) throw nb::value_error(("max_tokens = " + std::to_string(max_tokens) + " must be >= 1").c_str());
  k3::BackendOptions o = options(threads, isa);
  o.max_tokens = max_tokens;
  const k3::LinearWeightsView w = linear_weights(codes, scales, bf16, bias);
  const k3::LinearBackend* b = value(k3::find_linear_backend("cpu"));
  std::optional<k3::Result<std::unique_ptr<k3::PreparedLinear>>> layer;
  {
    nb::gil_scoped_release release;
    layer.emplace(k3::prepare_linear(*b, p, w, o));
  }
  auto* c = new CpuLinear{value(std::move(*layer)), {}, {}};
  c->workspace.resize(static_cast<size_t>(c->layer->workspace_bytes()));
  return c;
}

void cpu_linear_run(CpuLinear& c, In<uint16_t> x, int64_t m, AnyOut out) {
  nb::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(c.mu);
  check(c.layer->run(m, span(x), c.workspace, bytes(out)));
}

double cpu_linear_time_native(CpuLinear& c, In<uint16_t> x, int64_t m, AnyOut out, int iters) {
  if (iters < 1 || iters > 10000000) throw nb::value_error("iters must be in [1, 10^7]");
  const std::span<uint8_t> o = bytes(out);
  nb::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(c.mu);
  check(c.layer->run(m, span(x), c.workspace, o));
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    check(c.layer->run(m, span(x), c.workspace, o));
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Seconds per call of the C++ run() alone (median of `iters` calls on the same buffers, after one
// untimed call): the baseline that the Python per-call overhead is measured against.
double prepared_moe_time_native(PreparedMoe& c, In<uint16_t> x, In<int32_t> ids, In<float> weights, int64_t m,
                                AnyOut out, int iters) {
  if (iters < 1 || iters > 10000000) throw nb::value_error("iters must be in [1, 10^7]");
  const k3::MoeInputsView in{m, span(x), span(ids), span(weights)};
  const std::span<uint8_t> o = bytes(out);
  nb::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(c.mu);
  check(c.layer->run(in, c.workspace, o));
  std::vector<double> t(static_cast<size_t>(iters));
  for (auto& v : t) {
    const auto t0 = std::chrono::steady_clock::now();
    const k3::Status st = c.layer->run(in, c.workspace, o);
    v = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!st.is_ok()) check(st);
  }
  std::nth_element(t.begin(), t.begin() + iters / 2, t.end());
  return t[static_cast<size_t>(iters / 2)];
}

// ---- checkpoints ---------------------------------------------------------------------------
// One EP rank's experts of a checkpoint layer: numpy arrays over the loaded buffers (one owner
// object frees them when the last array dies: no copy) and the config facts as a dict.
nb::dict load_checkpoint_layer(const std::string& dir, int layer, int ep_size, int ep_rank) {
  std::optional<k3::Result<k3::MoeLayerWeights>> r;
  {
    nb::gil_scoped_release release;
    r.emplace(k3::load_moe_layer(dir, layer, ep_size, ep_rank));
  }
  auto* w = new k3::MoeLayerWeights(value(std::move(*r)));
  nb::capsule owner(w, [](void* p) noexcept { delete static_cast<k3::MoeLayerWeights*>(p); });
  const auto& s = w->shape;
  const size_t e = static_cast<size_t>(s.local_experts()), k = static_cast<size_t>(s.hidden),
               n = static_cast<size_t>(s.intermediate);
  auto u8 = [&](std::vector<uint8_t>& v, std::initializer_list<size_t> shape) {
    return nb::ndarray<nb::numpy, uint8_t>(v.data(), shape, owner);
  };
  nb::dict d;
  d["fc1_q"] = u8(w->fc1_q, {e, 2 * n, k / 2});
  d["fc1_scale"] = u8(w->fc1_scale, {e, 2 * n, k / 32});
  d["fc2_q"] = u8(w->fc2_q, {e, k, n / 2});
  d["fc2_scale"] = u8(w->fc2_scale, {e, k, n / 32});
  if (!w->router_bias.empty()) {
    d["router_bias"] = nb::ndarray<nb::numpy, float>(w->router_bias.data(), {w->router_bias.size()}, owner);
  }
  if (!w->router_weight.empty()) {
    const size_t hid = static_cast<size_t>(w->config.hidden_size);
    d["router_weight"] = nb::ndarray<nb::numpy, uint16_t>(w->router_weight.data(),
                                                          {w->router_weight.size() / hid, hid}, owner);
  }
  const k3::MoeModelConfig& c = w->config;
  nb::dict cfg;
  cfg["model_type"] = c.model_type;
  cfg["hidden_size"] = c.hidden_size;
  cfg["hidden"] = s.hidden;
  cfg["intermediate"] = s.intermediate;
  cfg["num_experts"] = s.num_experts;
  cfg["top_k"] = s.top_k;
  cfg["ep_size"] = s.ep_size;
  cfg["ep_rank"] = s.ep_rank;
  cfg["n_group"] = c.n_group;
  cfg["topk_group"] = c.topk_group;
  cfg["renormalize"] = c.renormalize;
  cfg["routed_scaling_factor"] = c.routed_scaling_factor;
  cfg["scoring_func"] = c.scoring_func;
  cfg["hidden_act"] = c.hidden_act;
  cfg["situ_beta"] = c.situ_beta;
  cfg["situ_linear_beta"] = c.situ_linear_beta;
  cfg["source"] = c.source;
  d["config"] = cfg;
  // The router's keyword arguments, decided by the library (k3::routing_from_config), or the
  // reason this checkpoint cannot be routed by k3 (raised by MoeLayer.routing()).
  if (auto rc = k3::routing_from_config(c); rc.is_ok()) {
    nb::dict rd;
    rd["top_k"] = rc->top_k;
    rd["n_group"] = rc->n_group;
    rd["topk_group"] = rc->topk_group;
    rd["renormalize"] = rc->renormalize;
    rd["routed_scaling_factor"] = rc->routed_scaling_factor;
    d["routing"] = rd;
  } else {
    d["routing_error"] = rc.status().message();
  }
  if (auto act = k3::activation_from_config(c); !act.is_ok()) d["problem_error"] = act.status().message();
  d["layer"] = w->layer;
  return d;
}

// ---- KDA -----------------------------------------------------------------------------------
k3::kda::KdaConfig kda_config(int64_t heads, int64_t head_k, int64_t head_v, const std::string& gate, float lb,
                              bool beta_logits, bool l2norm, float scale, const std::string& layout) {
  k3::kda::KdaConfig c;
  c.num_heads = heads;
  c.head_k = head_k;
  c.head_v = head_v;
  c.gate = value(k3::kda::parse_gate_mode(gate));
  c.gate_lower_bound = lb;
  c.beta_logits = beta_logits;
  c.l2norm_qk = l2norm;
  c.scale = scale;
  c.layout = value(k3::kda::parse_state_layout(layout));
  check(k3::kda::validate_config(c));
  return c;
}

// Decode (one token per sequence, states in a pool indexed by state_indices, updated in place)
// and speculative verify (T draft tokens per sequence, every prefix state written to its slot).
template <typename Act, typename Vec, typename OptVec>
k3::kda::KdaInputs step_inputs(const Act& q, const Act& k, const Act& v, const Vec& g, const Vec& beta,
                               const OptVec& a_log, const OptVec& dt_bias) {
  k3::kda::KdaInputs in;
  in.q = k3::kda::ActSpan::of(span(q));
  in.k = k3::kda::ActSpan::of(span(k));
  in.v = k3::kda::ActSpan::of(span(v));
  in.g = span(g);
  in.beta = span(beta);
  in.a_log = span(a_log);
  in.dt_bias = span(dt_bias);
  return in;
}

const k3::KdaBackend* kda_backend(const std::string& name) {
  return name.empty() ? &k3::default_kda_backend() : value(k3::find_kda_backend(name));
}

// Runs one KDA entry of the registry (run_kda_*) on the backend `name` ("" = the default one) with
// the GIL released.
template <typename Entry, typename Args>
void run_kda(Entry entry, const std::string& backend, int threads, const std::string& isa,
             const k3::kda::KdaConfig& cfg, const Args& args) {
  const k3::KdaBackend* b = kda_backend(backend);
  const k3::BackendOptions opt = options(threads, isa);
  nb::gil_scoped_release release;
  check(entry(*b, cfg, args, opt));
}

// q, k, v as FP32 or BF16 bits (uint16); the Python layer picks the overload.
template <typename A>
void kda_prefill(const k3::kda::KdaConfig& cfg, In<A> q, In<A> k, In<A> v, In<float> g, In<float> beta,
                 std::optional<In<float>> a_log, std::optional<In<float>> dt_bias, std::optional<In<int64_t>> cu,
                 std::optional<In<float>> initial_state, const std::string& backend, int threads,
                 const std::string& isa, Out<float> o, std::optional<Out<float>> final_state) {
  k3::kda::KdaInputs in = step_inputs(q, k, v, g, beta, a_log, dt_bias);
  in.cu_seqlens = span(cu);
  in.initial_state = span(initial_state);
  const k3::kda::KdaOutputs out{span(o), final_state ? span(*final_state) : std::span<float>()};
  const k3::BackendOptions opt = options(threads, isa);
  const k3::KdaBackend* b = kda_backend(backend);
  nb::gil_scoped_release release;
  check(k3::run_kda_prefill(*b, cfg, in, out, opt));
}

// The causal depthwise conv + SiLU of the KDA layer (k3/kda_ops.hpp), FP32 or BF16 storage (T =
// float / uint16_t bits); conv_state [N, D, state_len] is updated in place.
template <typename T>
void kda_conv(int64_t channels, int64_t width, bool silu, In<T> x, In<T> weight, std::optional<In<float>> bias,
              std::optional<In<int64_t>> cu_seqlens, std::optional<Out<T>> conv_state, Out<T> y, int64_t state_len,
              int threads) {
  using Args = std::conditional_t<std::is_same_v<T, float>, k3::kda::ConvArgs, k3::kda::ConvArgsBf16>;
  Args a;
  a.channels = channels;
  a.width = width;
  a.silu = silu;
  a.x = span(x);
  a.weight = span(weight);
  a.bias = span(bias);
  a.cu_seqlens = span(cu_seqlens);
  a.conv_state = conv_state ? span(*conv_state) : std::span<T>();
  a.y = span(y);
  a.state_len = state_len;
  nb::gil_scoped_release release;
  if constexpr (std::is_same_v<T, float>) {
    check(k3::kda::causal_conv1d(a, threads));
  } else {
    check(k3::kda::causal_conv1d_bf16(a, threads));
  }
}

template <typename A>
void kda_decode(const k3::kda::KdaConfig& cfg, In<A> q, In<A> k, In<A> v, In<float> g, In<float> beta,
                std::optional<In<float>> a_log, std::optional<In<float>> dt_bias, Out<float> state_pool,
                In<int32_t> state_indices, const std::string& backend, int threads, const std::string& isa,
                Out<float> o) {
  k3::kda::DecodeArgs args;
  args.in = step_inputs(q, k, v, g, beta, a_log, dt_bias);
  args.state_pool = span(state_pool);
  args.state_indices = span(state_indices);
  args.o = span(o);
  run_kda(k3::run_kda_decode, backend, threads, isa, cfg, args);
}

template <typename A>
void kda_verify(const k3::kda::KdaConfig& cfg, In<A> q, In<A> k, In<A> v, In<float> g, In<float> beta,
                std::optional<In<float>> a_log, std::optional<In<float>> dt_bias, int64_t draft_tokens,
                Out<float> state_pool, In<int32_t> state_indices, In<int32_t> num_accepted, const std::string& backend,
                int threads, const std::string& isa, Out<float> o) {
  k3::kda::VerifyArgs args;
  args.in = step_inputs(q, k, v, g, beta, a_log, dt_bias);
  args.draft_tokens = draft_tokens;
  args.state_pool = span(state_pool);
  args.state_indices = span(state_indices);
  args.num_accepted = span(num_accepted);
  args.o = span(o);
  run_kda(k3::run_kda_verify, backend, threads, isa, cfg, args);
}

// Speculative verify without snapshots (k3/kda.hpp): verify_replay reads the pool and fills the
// window pool; commit folds the accepted prefix into the states and consumes the windows.
template <typename A>
void kda_verify_replay(const k3::kda::KdaConfig& cfg, In<A> q, In<A> k, In<A> v, In<float> g, In<float> beta,
                       std::optional<In<float>> a_log, std::optional<In<float>> dt_bias,
                       std::optional<In<int64_t>> cu_seqlens, int64_t window_tokens, In<float> state_pool,
                       In<int32_t> state_indices, Out<float> window_pool, const std::string& backend, int threads,
                       const std::string& isa, Out<float> o) {
  k3::kda::ReplayVerifyArgs args;
  args.in = step_inputs(q, k, v, g, beta, a_log, dt_bias);
  args.in.cu_seqlens = span(cu_seqlens);
  args.window_tokens = window_tokens;
  args.state_pool = span(state_pool);
  args.state_indices = span(state_indices);
  args.window_pool = span(window_pool);
  args.o = span(o);
  run_kda(k3::run_kda_verify_replay, backend, threads, isa, cfg, args);
}

void kda_commit(const k3::kda::KdaConfig& cfg, int64_t window_tokens, Out<float> state_pool, Out<float> window_pool,
                In<int32_t> state_indices, In<int32_t> num_accepted, const std::string& backend, int threads,
                const std::string& isa) {
  k3::kda::CommitArgs args;
  args.window_tokens = window_tokens;
  args.state_pool = span(state_pool);
  args.window_pool = span(window_pool);
  args.state_indices = span(state_indices);
  args.num_accepted = span(num_accepted);
  run_kda(k3::run_kda_commit, backend, threads, isa, cfg, args);
}

int64_t kda_replay_window_floats(const k3::kda::KdaConfig& cfg, int64_t window_tokens) {
  return value(k3::kda::replay_window_floats(cfg, window_tokens));
}

// ---- CUDA (device arrays; these bindings have NEVER RUN ON A GPU, the C++ backend behind them
// ran on an H200, 2026-12-04) ---------------------------------------------------------------
// Arrays are CUDA DLPack tensors (torch / CuPy / JAX on the GPU), used in place: no copy, no
// allocation, no synchronization, so every call below can be captured in a CUDA graph. `stream`
// is a cudaStream_t as an integer (torch.cuda.current_stream().cuda_stream; 0 = the default
// stream). The caller owns the workspace (a uint8 device buffer of workspace_bytes, 256-byte
// aligned, e.g. from torch.empty / cupy.empty). Without CUDA in the build every entry raises.
template <typename T>
using DIn = nb::ndarray<const T, nb::c_contig, nb::device::cuda>;
template <typename T>
using DOut = nb::ndarray<T, nb::c_contig, nb::device::cuda>;
using DAny = nb::ndarray<nb::c_contig, nb::device::cuda>;

constexpr const char* kNoCuda =
    "k3 was built without CUDA (the default wheel is CPU-only): reinstall it with the CUDA backend, "
    "CMAKE_ARGS=\"-DK3_CUDA=ON\" pip install --no-build-isolation <k3 source directory> (needs nvcc)";

bool cuda_compiled() {
#ifdef K3_WITH_CUDA
  return true;
#else
  return false;
#endif
}

void require_cuda() {
  if (!cuda_compiled()) throw std::runtime_error(kNoCuda);
}

void* stream_of(uint64_t s) { return reinterpret_cast<void*>(static_cast<uintptr_t>(s)); }

template <typename A>
void on_device(const char* name, const A& a, int device) {
  if (a.device_id() != device) {
    throw nb::value_error((std::string(name) + " is on cuda:" + std::to_string(a.device_id()) +
                           ", the plan is for cuda:" + std::to_string(device))
                              .c_str());
  }
}
template <typename A>
void on_device(const char* name, const std::optional<A>& a, int device) {
  if (a) on_device(name, *a, device);
}

void* workspace_of(const DOut<uint8_t>& ws, int64_t need, int device) {
  on_device("workspace", ws, device);
  if (static_cast<int64_t>(ws.nbytes()) < need) {
    throw nb::value_error(("workspace has " + std::to_string(ws.nbytes()) + " bytes, the plan needs " +
                           std::to_string(need) + " (workspace_bytes)")
                              .c_str());
  }
  return ws.data();
}

bool is_dtype(const DAny& a, nb::dlpack::dtype_code code, int bits) {
  const nb::dlpack::dtype t = a.dtype();
  return t.code == static_cast<uint8_t>(code) && t.bits == bits && t.lanes == 1;
}
bool is_f32(const DAny& a) { return is_dtype(a, nb::dlpack::dtype_code::Float, 32); }
// BF16 / FP16 storage: the bit patterns as uint16, or the framework's own 16-bit float type.
bool is_16bit(const DAny& a, nb::dlpack::dtype_code code) {
  return is_dtype(a, nb::dlpack::dtype_code::UInt, 16) || is_dtype(a, code, 16);
}

k3::cuda::DeviceCaps caps_of(int device, const std::optional<nb::dict>& caps) {
  if (!caps) return value(k3::cuda::device_caps(device));
  k3::cuda::DeviceCaps c;
  const nb::dict& d = *caps;
  for (auto [key, val] : d) {
    const std::string k = nb::cast<std::string>(key);
    if (k == "name") c.name = nb::cast<std::string>(val);
    else if (k == "cc_major") c.cc_major = nb::cast<int>(val);
    else if (k == "cc_minor") c.cc_minor = nb::cast<int>(val);
    else if (k == "sm_count") c.sm_count = nb::cast<int>(val);
    else if (k == "smem_per_block_optin") c.smem_per_block_optin = nb::cast<int64_t>(val);
    else if (k == "compiled_archs") c.compiled_archs = nb::cast<std::vector<int>>(val);
    else if (k == "has_sm90_grouped") c.has_sm90_grouped = nb::cast<bool>(val);
    else if (k == "has_sm120_blockscaled") c.has_sm120_blockscaled = nb::cast<bool>(val);
    else
      throw nb::value_error(("caps has key '" + k + "'; the keys are name, cc_major, cc_minor, sm_count, "
                             "smem_per_block_optin, compiled_archs, has_sm90_grouped, has_sm120_blockscaled")
                                .c_str());
  }
  return c;
}

nb::dict device_caps_dict(int device) {
  require_cuda();
  const k3::cuda::DeviceCaps c = value(k3::cuda::device_caps(device));
  nb::dict d;
  d["name"] = c.name;
  d["cc_major"] = c.cc_major;
  d["cc_minor"] = c.cc_minor;
  d["sm_count"] = c.sm_count;
  d["smem_per_block_optin"] = c.smem_per_block_optin;
  d["compiled_archs"] = c.compiled_archs;
  d["has_sm90_grouped"] = c.has_sm90_grouped;  // the build has the prefill-sm90 GEMM (CUTLASS)
  d["has_sm120_blockscaled"] = c.has_sm120_blockscaled;  // ... and the w4a8-sm120-cutlass GEMM
  return d;
}

// -- KDA --
struct CudaKda {
  k3::cuda::KdaPlan plan;
  int device = 0;
};

CudaKda* cuda_kda_plan(const k3::kda::KdaConfig& cfg, int device, int64_t max_seqs, const std::string& algorithm,
                       std::optional<nb::dict> caps) {
  require_cuda();
  k3::cuda::KdaOptions o;
  o.device = caps_of(device, caps);
  o.max_seqs = max_seqs;
  o.algorithm = value(k3::kda::parse_algorithm(algorithm));
  return new CudaKda{value(k3::cuda::plan(cfg, o)), device};
}

template <typename A>
k3::kda::KdaInputs device_inputs(const CudaKda& c, const DIn<A>& q, const DIn<A>& k, const DIn<A>& v,
                                 const DIn<float>& g, const DIn<float>& beta, const std::optional<DIn<float>>& a_log,
                                 const std::optional<DIn<float>>& dt_bias) {
  on_device("q", q, c.device);
  on_device("k", k, c.device);
  on_device("v", v, c.device);
  on_device("g", g, c.device);
  on_device("beta", beta, c.device);
  on_device("a_log", a_log, c.device);
  on_device("dt_bias", dt_bias, c.device);
  return step_inputs(q, k, v, g, beta, a_log, dt_bias);
}

template <typename A>
void cuda_kda_prefill(const CudaKda& c, DIn<A> q, DIn<A> k, DIn<A> v, DIn<float> g, DIn<float> beta,
                      std::optional<DIn<float>> a_log, std::optional<DIn<float>> dt_bias,
                      std::optional<DIn<int64_t>> cu, std::optional<DIn<float>> initial_state, DOut<float> o,
                      std::optional<DOut<float>> final_state, DOut<uint8_t> workspace, uint64_t stream) {
  require_cuda();
  k3::kda::KdaInputs in = device_inputs(c, q, k, v, g, beta, a_log, dt_bias);
  on_device("cu_seqlens", cu, c.device);
  on_device("initial_state", initial_state, c.device);
  on_device("o", o, c.device);
  on_device("final_state", final_state, c.device);
  in.cu_seqlens = span(cu);
  in.initial_state = span(initial_state);
  const k3::kda::KdaOutputs out{span(o), span(final_state)};
  void* ws = workspace_of(workspace, c.plan.workspace_bytes, c.device);
  nb::gil_scoped_release release;
  check(k3::cuda::prefill(c.plan, in, out, ws, stream_of(stream)));
}

// The state pool: float32, or BF16 storage (uint16 bits or the framework's bfloat16).
void set_pool(const DAny& pool, std::span<float>& f32, std::span<uint16_t>& bf16) {
  if (is_f32(pool)) {
    f32 = {static_cast<float*>(pool.data()), pool.size()};
  } else if (is_16bit(pool, nb::dlpack::dtype_code::Bfloat)) {
    bf16 = {static_cast<uint16_t*>(pool.data()), pool.size()};
  } else {
    throw nb::value_error("state_pool must be float32 or BF16 (bfloat16, or its bits as uint16)");
  }
}

template <typename A>
void cuda_kda_decode(const CudaKda& c, DIn<A> q, DIn<A> k, DIn<A> v, DIn<float> g, DIn<float> beta,
                     std::optional<DIn<float>> a_log, std::optional<DIn<float>> dt_bias, DAny state_pool,
                     DIn<int32_t> state_indices, DOut<float> o, DOut<uint8_t> workspace, uint64_t stream) {
  require_cuda();
  k3::kda::DecodeArgs args;
  args.in = device_inputs(c, q, k, v, g, beta, a_log, dt_bias);
  on_device("state_pool", state_pool, c.device);
  on_device("state_indices", state_indices, c.device);
  on_device("o", o, c.device);
  set_pool(state_pool, args.state_pool, args.state_pool_bf16);
  args.state_indices = span(state_indices);
  args.o = span(o);
  void* ws = workspace_of(workspace, c.plan.workspace_bytes, c.device);
  nb::gil_scoped_release release;
  check(k3::cuda::decode(c.plan, args, ws, stream_of(stream)));
}

template <typename A>
void cuda_kda_verify(const CudaKda& c, DIn<A> q, DIn<A> k, DIn<A> v, DIn<float> g, DIn<float> beta,
                     std::optional<DIn<float>> a_log, std::optional<DIn<float>> dt_bias, int64_t draft_tokens,
                     DAny state_pool, DIn<int32_t> state_indices, DIn<int32_t> num_accepted, DOut<float> o,
                     DOut<uint8_t> workspace, uint64_t stream) {
  require_cuda();
  k3::kda::VerifyArgs args;
  args.in = device_inputs(c, q, k, v, g, beta, a_log, dt_bias);
  on_device("state_pool", state_pool, c.device);
  on_device("state_indices", state_indices, c.device);
  on_device("num_accepted", num_accepted, c.device);
  on_device("o", o, c.device);
  args.draft_tokens = draft_tokens;
  set_pool(state_pool, args.state_pool, args.state_pool_bf16);
  args.state_indices = span(state_indices);
  args.num_accepted = span(num_accepted);
  args.o = span(o);
  void* ws = workspace_of(workspace, c.plan.workspace_bytes, c.device);
  nb::gil_scoped_release release;
  check(k3::cuda::verify(c.plan, args, ws, stream_of(stream)));
}

// Synchronizes the stream (not for graph capture): raises when the last call on `workspace` set a
// status bit (bad cu_seqlens, slot out of range, duplicate slot, ...).
void cuda_kda_status(const CudaKda& c, DOut<uint8_t> workspace, uint64_t stream) {
  require_cuda();
  void* ws = workspace_of(workspace, c.plan.workspace_bytes, c.device);
  nb::gil_scoped_release release;
  check(k3::cuda::kda_status(c.plan, ws, stream_of(stream)));
}

// -- fused MoE --
struct CudaMoe {
  k3::cuda::MoePlan plan;
  k3::cuda::DeviceWeights weights;
  int device = 0;
};

// Plans for `device` and uploads the host weights (checkpoint layout) to the CURRENT CUDA device:
// the Python layer makes `device` current first. Synchronous (copies), not for graph capture.
CudaMoe* cuda_moe_prepare(const k3::MoeProblem& p, int64_t max_tokens, int device, std::optional<std::string> path,
                          std::optional<nb::dict> caps, In<uint8_t> fc1_q, In<uint8_t> fc1_scale, In<uint8_t> fc2_q,
                          In<uint8_t> fc2_scale) {
  require_cuda();
  k3::cuda::MoeOptions o;
  o.max_tokens = max_tokens;
  if (path) o.path = value(k3::cuda::moe_path_from_name(*path));  // before the device: a bad name is a ValueError
  o.device = caps_of(device, caps);
  auto plan = value(k3::cuda::plan(p, o));
  const MoeWeights w{fc1_q, fc1_scale, fc2_q, fc2_scale};
  std::optional<k3::Result<k3::cuda::DeviceWeights>> packed;
  {
    nb::gil_scoped_release release;
    packed.emplace(k3::cuda::prepack(plan, w.view()));
  }
  return new CudaMoe{std::move(plan), value(std::move(*packed)), device};
}

int64_t rows_of(const char* name, size_t elements, int64_t row) {
  if (row <= 0 || static_cast<int64_t>(elements) % row != 0) {
    throw nb::value_error((std::string(name) + " has " + std::to_string(elements) +
                           " elements, not a whole number of rows of " + std::to_string(row))
                              .c_str());
  }
  return static_cast<int64_t>(elements) / row;
}

// x [R, K] BF16 bits, topk_ids / topk_weights [R, top_k], out [R, K] (out dtype), m_device [1]
// int32 on the device: the kernels run min(m_device, max_tokens) rows, so the caller keeps
// m_device <= R (the host cannot read it without a synchronization).
void cuda_moe_run(const CudaMoe& c, DIn<uint16_t> x, DIn<int32_t> ids, DIn<float> weights, DAny out,
                  DIn<int32_t> m_device, DOut<uint8_t> workspace, uint64_t stream) {
  require_cuda();
  const auto& p = c.plan.problem;
  on_device("x", x, c.device);
  on_device("topk_ids", ids, c.device);
  on_device("topk_weights", weights, c.device);
  on_device("out", out, c.device);
  on_device("m_device", m_device, c.device);
  const int64_t rows = rows_of("x", x.size(), p.shape.hidden);
  if (rows > c.plan.max_tokens) {
    throw nb::value_error(("x has " + std::to_string(rows) + " rows, more than the plan's max_tokens = " +
                           std::to_string(c.plan.max_tokens))
                              .c_str());
  }
  const int64_t slots = rows * p.shape.top_k;
  if (static_cast<int64_t>(ids.size()) != slots) {
    throw nb::value_error(("topk_ids has " + std::to_string(ids.size()) + " elements, expected " +
                           std::to_string(slots) + " (rows of x * top_k)")
                              .c_str());
  }
  if (static_cast<int64_t>(weights.size()) != slots) {
    throw nb::value_error(("topk_weights has " + std::to_string(weights.size()) + " elements, expected " +
                           std::to_string(slots) + " (rows of x * top_k)")
                              .c_str());
  }
  const int64_t ob = k3::out_dtype_size(p.out_dtype);
  const bool dtype_ok = ob == 4 ? is_f32(out)
                                : is_16bit(out, p.out_dtype == k3::OutDType::kBF16 ? nb::dlpack::dtype_code::Bfloat
                                                                                   : nb::dlpack::dtype_code::Float);
  if (!dtype_ok || static_cast<int64_t>(out.nbytes()) != rows * p.shape.hidden * ob) {
    throw nb::value_error(("out has " + std::to_string(out.nbytes()) + " bytes of " + std::to_string(out.itemsize()) +
                           "-byte elements, expected [" + std::to_string(rows) + ", " +
                           std::to_string(p.shape.hidden) + "] of " + k3::out_dtype_name(p.out_dtype))
                              .c_str());
  }
  if (m_device.size() != 1) throw nb::value_error("m_device must hold one int32 (the token count)");
  k3::cuda::DeviceInputs in;
  in.m_device = m_device.data();
  in.x = x.data();
  in.topk_ids = ids.data();
  in.topk_weights = weights.data();
  in.out = out.data();
  void* ws = workspace_of(workspace, c.plan.workspace_bytes, c.device);
  nb::gil_scoped_release release;
  check(k3::cuda::run(c.plan, c.weights, in, ws, stream_of(stream)));
}

// -- routing --
// logits [R, E] float32, bias [E] or None, ids / weights [R, top_k]; m_device [1] int32 (<= R).
void cuda_route(DIn<float> logits, std::optional<DIn<float>> bias, DIn<int32_t> m_device, int num_experts, int top_k,
                int n_group, int topk_group, bool renormalize, float scaling, DOut<int32_t> ids, DOut<float> weights,
                uint64_t stream) {
  require_cuda();
  const int device = logits.device_id();
  on_device("bias", bias, device);
  on_device("m_device", m_device, device);
  on_device("topk_ids", ids, device);
  on_device("topk_weights", weights, device);
  k3::RoutingConfig cfg;
  cfg.num_experts = num_experts;
  cfg.top_k = top_k;
  cfg.n_group = n_group;
  cfg.topk_group = topk_group;
  cfg.renormalize = renormalize;
  cfg.routed_scaling_factor = scaling;
  const int64_t rows = rows_of("logits", logits.size(), num_experts);
  if (static_cast<int64_t>(ids.size()) != rows * top_k || static_cast<int64_t>(weights.size()) != rows * top_k) {
    throw nb::value_error(("topk_ids / topk_weights have " + std::to_string(ids.size()) + " / " +
                           std::to_string(weights.size()) + " elements, expected " + std::to_string(rows * top_k) +
                           " (rows of logits * top_k)")
                              .c_str());
  }
  if (bias && static_cast<int64_t>(bias->size()) != num_experts) {
    throw nb::value_error(("bias has " + std::to_string(bias->size()) + " elements, expected num_experts = " +
                           std::to_string(num_experts))
                              .c_str());
  }
  if (m_device.size() != 1) throw nb::value_error("m_device must hold one int32 (the token count)");
  nb::gil_scoped_release release;
  check(k3::cuda::route_device(cfg, m_device.data(), rows, logits.data(), bias ? bias->data() : nullptr, ids.data(),
                               weights.data(), stream_of(stream)));
}

// k3.bench("moe" | "kda", **options): the harness's benchmarks in this process. Options are the
// fields of the target's config (the flags of `k3 bench TARGET`, dashes as underscores); an
// unknown one is refused naming the known ones.
using Setter = std::function<void(nb::handle)>;

void apply_options(const std::string& caller, const nb::dict& options,
                   const std::vector<std::pair<std::string, Setter>>& fields) {
  for (auto [key, value] : options) {
    const std::string name = nb::cast<std::string>(key);
    auto it = std::find_if(fields.begin(), fields.end(), [&](const auto& f) { return f.first == name; });
    if (it == fields.end()) {
      std::string known;
      for (const auto& f : fields) known += (known.empty() ? "" : ", ") + f.first;
      throw nb::value_error((caller + ": unknown option '" + name + "' (known: " + known + ")").c_str());
    }
    try {
      it->second(value);
    } catch (const nb::cast_error&) {
      throw nb::type_error((caller + ": option '" + name + "' has the wrong type (" +
                            nb::cast<std::string>(nb::str(value.type())) + ")").c_str());
    }
  }
}

template <typename T>
Setter to(T& field) {
  return [&field](nb::handle v) { field = nb::cast<T>(v); };
}
Setter to_list(std::vector<int64_t>& field) {
  return [&field](nb::handle v) {
    if (nb::isinstance<nb::int_>(v)) {
      field = {nb::cast<int64_t>(v)};
    } else {
      field = nb::cast<std::vector<int64_t>>(v);
    }
  };
}
Setter to_isa(k3::IsaLevel& field) {
  return [&field](nb::handle v) { field = value(k3::parse_isa_level(nb::cast<std::string>(v))); };
}

// k3.validate(op, **options): the harness's correctness matrix (the records of `k3 validate
// --output`, as JSON, and the count of failed checks). Options go through the same table as
// k3.bench's: an unknown key is refused naming the known ones, a wrong type raises TypeError.
std::pair<std::string, int64_t> validate(const std::string& op, const nb::dict& opts) {
  k3::harness::ValidateOptions o;
  int threads = 0;
  std::string isa;
  apply_options("k3.validate", opts,
                {{"suite", to(o.suite)}, {"backend", to(o.backend)}, {"require", to(o.require)}, {"seed", to(o.seed)},
                 {"recipe", to(o.recipe)}, {"activation", to(o.activation)}, {"checkpoint", to(o.checkpoint)},
                 {"layer", to(o.layer)}, {"ep_size", to(o.ep_size)}, {"ep_rank", to(o.ep_rank)},
                 {"threads", to(threads)}, {"isa", to(isa)}, {"cuda_path", to(o.backend_options.path)}});
  const std::string path = o.backend_options.path;
  o.backend_options = options(threads, isa);
  o.backend_options.path = path;
  k3::Result<std::vector<k3::harness::ValidateRow>> rows = k3::invalid_argument("not run");
  {
    nb::gil_scoped_release release;
    rows = k3::harness::run_validation(op, o);
  }
  const auto& r = value(std::move(rows));
  return {k3::harness::validation_json(r, o), static_cast<int64_t>(k3::harness::count_rows(r).failed)};
}

// (the document as JSON, "" or the error of a sweep that went on past a failed case).
std::pair<std::string, std::string> bench(const std::string& target, const nb::dict& options) {
  k3::harness::BenchResult r;
  const std::string caller = "k3.bench(\"" + target + "\")";
  if (target == "moe") {
    k3::harness::MoeBenchConfig c;
    apply_options(caller, options,
                  {{"backend", to(c.backend)}, {"m", to_list(c.ms)}, {"full", to(c.full)}, {"recipe", to(c.recipe)},
                   {"routing", to(c.routing)}, {"activation", to(c.activation)}, {"hidden", to(c.hidden)},
                   {"intermediate", to(c.intermediate)}, {"experts", to(c.experts)}, {"top_k", to(c.top_k)},
                   {"ep_size", to(c.ep_size)}, {"ep_rank", to(c.ep_rank)}, {"iters", to(c.iters)},
                   {"warmup", to(c.warmup)}, {"input_sets", to(c.input_sets)}, {"bandwidth_mib", to(c.bandwidth_mib)},
                   {"seed", to(c.seed)}, {"threads", to(c.threads)}, {"isa", to_isa(c.isa)}, {"path", to(c.path)},
                   {"save_routing", to(c.save_routing)}, {"avx_vnni", to(c.avx_vnni)}});
    nb::gil_scoped_release release;
    r = k3::harness::bench_moe(c);
  } else if (target == "kda") {
    k3::harness::KdaBenchConfig c;
    apply_options(caller, options,
                  {{"backend", to(c.backend)}, {"heads", to(c.heads)}, {"head_dim", to(c.head_dim)},
                   {"prefill_t", to_list(c.prefill_t)}, {"decode_n", to_list(c.decode_n)},
                   {"verify_n", to_list(c.verify_n)}, {"draft_tokens", to(c.draft_tokens)}, {"iters", to(c.iters)},
                   {"pool_mib", to(c.pool_mib)}, {"bw_mib", to(c.bw_mib)}, {"threads", to(c.threads)},
                   {"isa", to_isa(c.isa)}});
    nb::gil_scoped_release release;
    r = k3::harness::bench_kda(c);
  } else if (target == "linear") {
    k3::harness::LinearBenchConfig c;
    apply_options(caller, options,
                  {{"shapes", to(c.shapes)}, {"recipes", to(c.recipes)}, {"m", to_list(c.m)}, {"iters", to(c.iters)},
                   {"rounds", to(c.rounds)}, {"pool_mib", to(c.pool_mib)}, {"bw_mib", to(c.bw_mib)},
                   {"threads", to(c.threads)}, {"isa", to_isa(c.isa)}, {"torch_python", to(c.torch_python)}});
    nb::gil_scoped_release release;
    r = k3::harness::bench_linear(c);
  } else if (target == "limits") {
    int threads = 0;
    int64_t buffer_mib = 1024;
    apply_options(caller, options, {{"threads", to(threads)}, {"buffer_mib", to(buffer_mib)}});
    nb::gil_scoped_release release;
    r = k3::harness::bench_limits(threads, buffer_mib);
  } else {
    throw nb::value_error(("k3.bench: target '" + target + "' is not one of the harness's (moe, kda, linear, limits)").c_str());
  }
  if (r.json.empty()) check(r.status.is_ok() ? k3::Status(k3::StatusCode::kInternal, "no document") : r.status);
  return {r.json, r.status.is_ok() ? std::string() : r.status.to_string()};
}

}  // namespace

// ---- the native model runner (k3/model.hpp) ---------------------------------------------------
struct NativeModel {
  std::unique_ptr<k3::Model> model;
};

NativeModel* model_load(const std::string& dir, int threads, const std::string& isa, const std::string& trunk,
                        const std::string& experts, int max_seqs, int64_t max_context, int64_t max_batch_tokens,
                        bool progress) {
  check(k3::check_thread_count(threads, "threads"));
  k3::ModelOptions o;
  o.threads = threads;
  if (!isa.empty()) o.isa = value(k3::parse_isa_level(isa));
  o.trunk = value(k3::parse_trunk_format(trunk));
  if (experts == "w4a16") {
    o.experts = k3::Recipe::kW4A16;
  } else if (experts == "w4a8") {
    o.experts = k3::Recipe::kW4A8;
  } else {
    throw nb::value_error(("experts = \"" + experts + "\" is not one of: w4a16, w4a8").c_str());
  }
  o.max_seqs = max_seqs;
  o.max_context = max_context;
  o.max_batch_tokens = max_batch_tokens;
  if (progress) o.progress = [](const std::string& s) { std::fprintf(stderr, "%s\n", s.c_str()); };
  std::unique_ptr<k3::Model> m;
  {
    nb::gil_scoped_release release;
    auto r = k3::Model::load(dir, o);
    if (r) m = std::move(r.value());
    else {
      nb::gil_scoped_acquire acquire;
      check(r.status());
    }
  }
  return new NativeModel{std::move(m)};
}

void model_forward(NativeModel& m, In<int32_t> tokens, std::optional<In<int64_t>> cu_seqlens, In<int32_t> slots,
                   bool all_logits, Out<float> logits) {
  k3::Status st;
  {
    nb::gil_scoped_release release;
    st = m.model->forward(span(tokens), span(cu_seqlens), span(slots), all_logits, span(logits));
  }
  check(st);
}

nb::dict model_info(const NativeModel& m) {
  const k3::ModelInfo& i = m.model->info();
  nb::dict d;
  d["family"] = i.family;
  d["directory"] = i.directory;
  d["vocab_size"] = i.config.vocab_size;
  d["hidden_size"] = i.config.hidden;
  d["num_layers"] = i.config.layers;
  d["eos_token_ids"] = i.config.eos_token_ids;
  d["trunk"] = k3::trunk_format_name(i.trunk);
  d["experts"] = k3::recipe_name(i.experts);
  d["threads"] = i.threads;
  d["isa"] = k3::isa_level_name(i.isa);
  d["max_seqs"] = i.max_seqs;
  d["max_context"] = i.max_context;
  d["max_batch_tokens"] = i.max_batch_tokens;
  d["packed_bytes"] = i.packed_bytes;
  d["state_bytes"] = i.state_bytes;
  d["step_bytes"] = i.step_bytes;
  d["peak_rss_bytes"] = i.peak_rss_bytes;
  d["load_seconds"] = i.load_seconds;
  d["describe"] = i.describe();
  return d;
}

std::vector<int32_t> model_generate(NativeModel& m, int slot, In<int32_t> prompt, int64_t max_new_tokens,
                                    float temperature, int top_k, float top_p, uint64_t seed,
                                    std::vector<int32_t> stop_ids) {
  k3::SamplingOptions so{temperature, top_k, top_p, seed};
  k3::Result<std::vector<int32_t>> r = k3::invalid_argument("not run");
  {
    nb::gil_scoped_release release;
    r = m.model->generate(slot, span(prompt), max_new_tokens, so, stop_ids);
  }
  return value(std::move(r));
}

NB_MODULE(_k3, m) {
  m.doc() = "k3: Kimi-K3 MoE and Kimi Delta Attention kernels (CPU backend; see the k3 package)";
  m.def("read_bandwidth", [](int threads, int64_t mib) {
        if (threads < 0 || threads > 4096) throw nb::value_error(("threads = " + std::to_string(threads) + " must be in [0, 4096]").c_str());
        if (mib < 16 || mib > (int64_t{1} << 20)) throw nb::value_error(("mib = " + std::to_string(mib) + " must be in [16, 2^20]").c_str());
        k3::MeasuredRate r;
        {
          nb::gil_scoped_release release;
          r = k3::measure_read_bandwidth(threads > 0 ? threads : k3::hardware_thread_count(), mib << 20);
        }
        nb::dict d;
        d["value"] = r.value;
        d["median"] = r.median;
        d["min"] = r.min;
        d["max"] = r.max;
        d["what"] = r.what;
        return d;
      }, "threads"_a, "mib"_a,
      "The harness's read-bandwidth probe (k3 bench limits): bytes/s over a buffer of `mib` MiB, best of several trials.");
  m.def("validate", &validate, "op"_a, "options"_a,
        "The harness's correctness matrix (k3.validate): (the records as JSON, the number of failed checks).");
  m.def("bench", &bench, "target"_a, "options"_a,
        "The harness's benchmarks (k3.bench): (the document as JSON, the error of a sweep that went on past a failed case or \"\").");
  m.def("info", &info, "Machine, ISA level and the backends of each op with their availability.");

  m.def("mx_quantize", &mx_quantize, "x"_a.noconvert(), "rows"_a, "cols"_a, "element"_a, "rule"_a, "q"_a.noconvert(), "scales"_a.noconvert());
  m.def("mx_quantize_bf16", &mx_quantize_bf16, "x"_a.noconvert(), "rows"_a, "cols"_a, "element"_a, "rule"_a, "q"_a.noconvert(),
        "scales"_a.noconvert());
  m.def("mx_dequantize", &mx_dequantize, "q"_a.noconvert(), "scales"_a.noconvert(), "rows"_a, "cols"_a, "element"_a, "out"_a.noconvert());
  m.def("route", &route, "logits"_a.noconvert(), "bias"_a.noconvert().none(), "m"_a, "num_experts"_a, "top_k"_a, "n_group"_a,
        "topk_group"_a, "renormalize"_a, "routed_scaling_factor"_a, "ids"_a.noconvert(), "weights"_a.noconvert());

  nb::class_<k3::MoeProblem>(m, "MoeProblem")
      .def("__repr__", [](const k3::MoeProblem& p) {
        return "MoeProblem(K=" + std::to_string(p.shape.hidden) + ", N=" + std::to_string(p.shape.intermediate) +
               ", E=" + std::to_string(p.shape.num_experts) + ", top_k=" + std::to_string(p.shape.top_k) +
               ", ep=" + std::to_string(p.shape.ep_rank) + "/" + std::to_string(p.shape.ep_size) + ", " +
               k3::recipe_name(p.recipe) + ", " + k3::activation_name(p.activation.kind) + ")";
      })
      .def_prop_ro("local_experts", [](const k3::MoeProblem& p) { return p.shape.local_experts(); })
      .def_prop_ro("num_experts", [](const k3::MoeProblem& p) { return p.shape.num_experts; })
      .def_prop_ro("first_local_expert", [](const k3::MoeProblem& p) { return p.shape.first_local_expert(); })
      .def_prop_ro("out_bytes", [](const k3::MoeProblem& p) { return k3::out_dtype_size(p.out_dtype); });
  m.def("expert_range", [](int num_experts, int ep_size, int ep_rank) {
    if (num_experts < 1 || ep_size < 1 || ep_size > num_experts || ep_rank < 0 || ep_rank >= ep_size) {
      throw nb::value_error(("expert_range: num_experts = " + std::to_string(num_experts) + ", ep_size = " +
                             std::to_string(ep_size) + ", ep_rank = " + std::to_string(ep_rank) +
                             ": needs 1 <= ep_size <= num_experts and 0 <= ep_rank < ep_size").c_str());
    }
    const k3::ExpertRange r = k3::expert_range(num_experts, ep_size, ep_rank);
    return std::make_pair(r.first, r.count);
  }, "num_experts"_a, "ep_size"_a, "ep_rank"_a);
  m.def("moe_problem", &moe_problem, "hidden"_a, "intermediate"_a, "num_experts"_a, "top_k"_a, "ep_size"_a,
        "ep_rank"_a, "recipe"_a, "activation"_a, "out_dtype"_a, "situ_beta"_a, "situ_linear_beta"_a,
        "swiglu_alpha"_a, "swiglu_beta"_a, "swiglu_limit"_a);
  m.def("moe_run", &moe_run, "problem"_a, "fc1_q"_a.noconvert(), "fc1_scale"_a.noconvert(), "fc2_q"_a.noconvert(), "fc2_scale"_a.noconvert(), "x"_a.noconvert(), "topk_ids"_a.noconvert(),
        "topk_weights"_a.noconvert(), "m"_a, "backend"_a, "threads"_a, "isa"_a, "out"_a.noconvert());

  nb::class_<PreparedMoe>(m, "PreparedMoe")
      .def_prop_ro("backend", [](const PreparedMoe& c) { return c.layer->backend(); })
      .def_prop_ro("describe", [](const PreparedMoe& c) { return c.layer->describe(); })
      .def_prop_ro("kernel", [](const PreparedMoe& c) { return c.layer->kernel(); })
      .def_prop_ro("workspace_bytes", [](const PreparedMoe& c) { return c.layer->workspace_bytes(); })
      .def_prop_ro("max_tokens", [](const PreparedMoe& c) { return c.layer->max_tokens(); })
      .def("run", &prepared_moe_run, "x"_a.noconvert(), "topk_ids"_a.noconvert(), "topk_weights"_a.noconvert(), "m"_a, "out"_a.noconvert())
      .def("time_native", &prepared_moe_time_native, "x"_a.noconvert(), "topk_ids"_a.noconvert(), "topk_weights"_a.noconvert(), "m"_a, "out"_a.noconvert(), "iters"_a);
  m.def("moe_prepare", &moe_prepare, nb::rv_policy::take_ownership, "problem"_a, "backend"_a, "max_tokens"_a,
        "threads"_a, "isa"_a, "fc1_q"_a.noconvert(), "fc1_scale"_a.noconvert(), "fc2_q"_a.noconvert(), "fc2_scale"_a.noconvert());

  m.def("linear_run", &linear_run, "k"_a.noconvert(), "n"_a, "recipe"_a, "out_dtype"_a, "codes"_a.noconvert().none(),
        "scales"_a.noconvert().none(), "bf16"_a.noconvert().none(), "bias"_a.noconvert().none(),
        "x"_a.noconvert(), "m"_a, "backend"_a, "threads"_a, "isa"_a, "out"_a.noconvert());
  nb::class_<CpuLinear>(m, "CpuLinear")
      .def_prop_ro("describe", [](const CpuLinear& c) { return c.layer->describe(); })
      .def_prop_ro("max_tokens", [](const CpuLinear& c) { return c.layer->max_tokens(); })
      .def_prop_ro("packed_bytes", [](const CpuLinear& c) { return c.layer->weight_bytes(); })
      .def("run", &cpu_linear_run, "x"_a.noconvert(), "m"_a, "out"_a.noconvert())
      .def("time_native", &cpu_linear_time_native, "x"_a.noconvert(), "m"_a, "out"_a.noconvert(), "iters"_a);
  m.def("rms_norm_bf16", &rms_norm<uint16_t>, "x"_a.noconvert(), "weight"_a.noconvert(), "y"_a.noconvert(), "dim"_a,
        "eps"_a, "threads"_a, "RMSNorm of rows of BF16 bits (k3/norm.hpp); y may be x.");
  m.def("rms_norm_f32", &rms_norm<float>, "x"_a.noconvert(), "weight"_a.noconvert(), "y"_a.noconvert(), "dim"_a,
        "eps"_a, "threads"_a, "RMSNorm of rows of FP32 values (k3/norm.hpp); y may be x.");
  m.def("rms_norm_gated_bf16", &rms_norm_gated<uint16_t>, "x"_a.noconvert(), "gate"_a.noconvert(),
        "weight"_a.noconvert(), "y"_a.noconvert(), "dim"_a, "eps"_a, "threads"_a,
        "Gated RMSNorm of rows of BF16 bits (k3/norm.hpp); y may be x.");
  m.def("head_gemv_bf16", &head_gemv_bf16, "w"_a.noconvert(), "x"_a.noconvert(), "y"_a.noconvert(), "heads"_a,
        "k"_a, "n"_a, "threads"_a, "isa"_a,
        "y[h, :] = x[h, :] . w[h] for each head (w BF16 bits [H, K, N], x and y FP32): FP32 sums over k in "
        "order, the same bits on every ISA level and thread count.");
  nb::class_<NativeModel>(m, "NativeModel")
      .def_prop_ro("info", &model_info)
      .def("forward", &model_forward, "tokens"_a.noconvert(), "cu_seqlens"_a.noconvert().none(), "slots"_a.noconvert(),
           "all_logits"_a, "logits"_a.noconvert())
      .def("reset", [](NativeModel& mm, int slot) { check(mm.model->reset(slot)); }, "slot"_a)
      .def("position", [](const NativeModel& mm, int slot) { return value(mm.model->position(slot)); }, "slot"_a)
      .def("generate", &model_generate, "slot"_a, "prompt"_a.noconvert(), "max_new_tokens"_a, "temperature"_a,
           "top_k"_a, "top_p"_a, "seed"_a, "stop_ids"_a);
  m.def("model_load", &model_load, nb::rv_policy::take_ownership, "dir"_a, "threads"_a, "isa"_a, "trunk"_a,
        "experts"_a, "max_seqs"_a, "max_context"_a, "max_batch_tokens"_a, "progress"_a,
        "Load a Kimi-Linear checkpoint directory into the native runner (k3/model.hpp).");
  m.def("cpu_linear_prepare", &cpu_linear_prepare, nb::rv_policy::take_ownership, "k"_a.noconvert(), "n"_a, "recipe"_a,
        "out_dtype"_a, "codes"_a.noconvert().none(), "scales"_a.noconvert().none(), "bf16"_a.noconvert().none(),
        "bias"_a.noconvert().none(), "max_tokens"_a, "threads"_a, "isa"_a);
  m.def("load_checkpoint_layer", &load_checkpoint_layer, "dir"_a, "layer"_a, "ep_size"_a, "ep_rank"_a);
  nb::class_<k3::kda::KdaConfig>(m, "KdaConfig")
      .def_ro("num_heads", &k3::kda::KdaConfig::num_heads)
      .def_ro("head_k", &k3::kda::KdaConfig::head_k)
      .def_ro("head_v", &k3::kda::KdaConfig::head_v)
      .def("state_shape", [](const k3::kda::KdaConfig& c, int64_t n) {
        const auto d = k3::kda::state_shape(c, n);
        return nb::make_tuple(d[0], d[1], d[2], d[3]);
      }, "n"_a, "The shape of n states in the config's layout: (n, H, K, V) k_first, (n, H, V, K) v_first.");
  m.def("kda_config", &kda_config, "heads"_a, "head_k"_a, "head_v"_a, "gate"_a, "gate_lower_bound"_a,
        "beta_logits"_a, "l2norm_qk"_a, "scale"_a, "layout"_a);
  m.def("kda_conv_f32", &kda_conv<float>, "channels"_a, "width"_a, "silu"_a, "x"_a.noconvert(),
        "weight"_a.noconvert(), "bias"_a.noconvert().none(), "cu_seqlens"_a.noconvert().none(),
        "conv_state"_a.noconvert().none(), "y"_a.noconvert(), "state_len"_a, "threads"_a);
  m.def("kda_conv_bf16", &kda_conv<uint16_t>, "channels"_a, "width"_a, "silu"_a, "x"_a.noconvert(),
        "weight"_a.noconvert(), "bias"_a.noconvert().none(), "cu_seqlens"_a.noconvert().none(),
        "conv_state"_a.noconvert().none(), "y"_a.noconvert(), "state_len"_a, "threads"_a);
  m.def("kda_decode", &kda_decode<float>, "cfg"_a, "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), "g"_a.noconvert(), "beta"_a.noconvert(), "a_log"_a.noconvert().none(),
        "dt_bias"_a.noconvert().none(), "state_pool"_a.noconvert(), "state_indices"_a.noconvert(), "backend"_a, "threads"_a, "isa"_a, "o"_a.noconvert());
  m.def("kda_decode", &kda_decode<uint16_t>, "cfg"_a, "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), "g"_a.noconvert(), "beta"_a.noconvert(), "a_log"_a.noconvert().none(),
        "dt_bias"_a.noconvert().none(), "state_pool"_a.noconvert(), "state_indices"_a.noconvert(), "backend"_a, "threads"_a, "isa"_a, "o"_a.noconvert());
  m.def("kda_verify", &kda_verify<float>, "cfg"_a, "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), "g"_a.noconvert(), "beta"_a.noconvert(), "a_log"_a.noconvert().none(),
        "dt_bias"_a.noconvert().none(), "draft_tokens"_a, "state_pool"_a.noconvert(), "state_indices"_a.noconvert(), "num_accepted"_a.noconvert(), "backend"_a,
        "threads"_a, "isa"_a, "o"_a.noconvert());
  m.def("kda_verify", &kda_verify<uint16_t>, "cfg"_a, "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), "g"_a.noconvert(), "beta"_a.noconvert(), "a_log"_a.noconvert().none(),
        "dt_bias"_a.noconvert().none(), "draft_tokens"_a, "state_pool"_a.noconvert(), "state_indices"_a.noconvert(), "num_accepted"_a.noconvert(), "backend"_a,
        "threads"_a, "isa"_a, "o"_a.noconvert());
  m.def("kda_verify_replay", &kda_verify_replay<float>, "cfg"_a, "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(),
        "g"_a.noconvert(), "beta"_a.noconvert(), "a_log"_a.noconvert().none(), "dt_bias"_a.noconvert().none(),
        "cu_seqlens"_a.noconvert().none(), "window_tokens"_a, "state_pool"_a.noconvert(), "state_indices"_a.noconvert(),
        "window_pool"_a.noconvert(), "backend"_a, "threads"_a, "isa"_a, "o"_a.noconvert());
  m.def("kda_verify_replay", &kda_verify_replay<uint16_t>, "cfg"_a, "q"_a.noconvert(), "k"_a.noconvert(),
        "v"_a.noconvert(), "g"_a.noconvert(), "beta"_a.noconvert(), "a_log"_a.noconvert().none(),
        "dt_bias"_a.noconvert().none(), "cu_seqlens"_a.noconvert().none(), "window_tokens"_a,
        "state_pool"_a.noconvert(), "state_indices"_a.noconvert(), "window_pool"_a.noconvert(), "backend"_a,
        "threads"_a, "isa"_a, "o"_a.noconvert());
  m.def("kda_commit", &kda_commit, "cfg"_a, "window_tokens"_a, "state_pool"_a.noconvert(), "window_pool"_a.noconvert(),
        "state_indices"_a.noconvert(), "num_accepted"_a.noconvert(), "backend"_a, "threads"_a, "isa"_a);
  m.def("kda_replay_window_floats", &kda_replay_window_floats, "cfg"_a, "window_tokens"_a);
  m.def("kda_prefill", &kda_prefill<float>, "cfg"_a, "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), "g"_a.noconvert(), "beta"_a.noconvert(), "a_log"_a.noconvert().none(),
        "dt_bias"_a.noconvert().none(), "cu_seqlens"_a.noconvert().none(), "initial_state"_a.noconvert().none(), "backend"_a, "threads"_a, "isa"_a,
        "o"_a.noconvert(), "final_state"_a.noconvert().none());
  m.def("kda_prefill", &kda_prefill<uint16_t>, "cfg"_a, "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), "g"_a.noconvert(), "beta"_a.noconvert(), "a_log"_a.noconvert().none(),
        "dt_bias"_a.noconvert().none(), "cu_seqlens"_a.noconvert().none(), "initial_state"_a.noconvert().none(), "backend"_a, "threads"_a, "isa"_a,
        "o"_a.noconvert(), "final_state"_a.noconvert().none());

  // ---- CUDA (these bindings have NEVER RUN ON A GPU). Present in every build; without CUDA they raise.
  m.def("cuda_compiled", &cuda_compiled, "True when this build contains the CUDA backend.");
  m.def("cuda_require", &require_cuda, "Raises RuntimeError (how to build with CUDA) in a build without it.");
  m.def("cuda_device_caps", &device_caps_dict, "device"_a, "What CUDA device `device` offers, for planning.");
  nb::class_<CudaKda>(m, "CudaKdaPlan")
      .def_prop_ro("describe", [](const CudaKda& c) { return c.plan.describe(); })
      .def_prop_ro("workspace_bytes", [](const CudaKda& c) { return c.plan.workspace_bytes; })
      .def_prop_ro("max_seqs", [](const CudaKda& c) { return c.plan.max_seqs; })
      .def_prop_ro("device", [](const CudaKda& c) { return c.device; })
      .def("prefill", &cuda_kda_prefill<float>, "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), "g"_a.noconvert(), "beta"_a.noconvert(), "a_log"_a.noconvert().none(),
           "dt_bias"_a.noconvert().none(), "cu_seqlens"_a.noconvert().none(), "initial_state"_a.noconvert().none(), "o"_a.noconvert(), "final_state"_a.noconvert().none(),
           "workspace"_a.noconvert(), "stream"_a)
      .def("prefill", &cuda_kda_prefill<uint16_t>, "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), "g"_a.noconvert(), "beta"_a.noconvert(), "a_log"_a.noconvert().none(),
           "dt_bias"_a.noconvert().none(), "cu_seqlens"_a.noconvert().none(), "initial_state"_a.noconvert().none(), "o"_a.noconvert(), "final_state"_a.noconvert().none(),
           "workspace"_a.noconvert(), "stream"_a)
      .def("decode", &cuda_kda_decode<float>, "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), "g"_a.noconvert(), "beta"_a.noconvert(), "a_log"_a.noconvert().none(),
           "dt_bias"_a.noconvert().none(), "state_pool"_a.noconvert(), "state_indices"_a.noconvert(), "o"_a.noconvert(), "workspace"_a.noconvert(), "stream"_a)
      .def("decode", &cuda_kda_decode<uint16_t>, "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), "g"_a.noconvert(), "beta"_a.noconvert(), "a_log"_a.noconvert().none(),
           "dt_bias"_a.noconvert().none(), "state_pool"_a.noconvert(), "state_indices"_a.noconvert(), "o"_a.noconvert(), "workspace"_a.noconvert(), "stream"_a)
      .def("verify", &cuda_kda_verify<float>, "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), "g"_a.noconvert(), "beta"_a.noconvert(), "a_log"_a.noconvert().none(),
           "dt_bias"_a.noconvert().none(), "draft_tokens"_a, "state_pool"_a.noconvert(), "state_indices"_a.noconvert(), "num_accepted"_a.noconvert(), "o"_a.noconvert(),
           "workspace"_a.noconvert(), "stream"_a)
      .def("verify", &cuda_kda_verify<uint16_t>, "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), "g"_a.noconvert(), "beta"_a.noconvert(), "a_log"_a.noconvert().none(),
           "dt_bias"_a.noconvert().none(), "draft_tokens"_a, "state_pool"_a.noconvert(), "state_indices"_a.noconvert(), "num_accepted"_a.noconvert(), "o"_a.noconvert(),
           "workspace"_a.noconvert(), "stream"_a)
      .def("status", &cuda_kda_status, "workspace"_a.noconvert(), "stream"_a);
  m.def("cuda_kda_replan_max_seqs", [](int64_t planned, int64_t seqs) { return value(k3::cuda::kda_replan_max_seqs(planned, seqs)); },
        "planned"_a, "seqs"_a,
        "The max_seqs to rebuild a cached CUDA KDA plan with for a call of `seqs` sequences, or 0 when `planned` covers it.");
  m.def("cuda_kda_plan", &cuda_kda_plan, nb::rv_policy::take_ownership, "cfg"_a, "device"_a, "max_seqs"_a,
        "algorithm"_a, "caps"_a.none());
  nb::class_<CudaMoe>(m, "CudaMoe")
      .def_prop_ro("describe", [](const CudaMoe& c) { return c.plan.describe(); })
      .def_prop_ro("workspace_bytes", [](const CudaMoe& c) { return c.plan.workspace_bytes; })
      .def_prop_ro("max_tokens", [](const CudaMoe& c) { return c.plan.max_tokens; })
      .def_prop_ro("device", [](const CudaMoe& c) { return c.device; })
      .def("run", &cuda_moe_run, "x"_a.noconvert(), "topk_ids"_a.noconvert(), "topk_weights"_a.noconvert(), "out"_a.noconvert(), "m_device"_a.noconvert(), "workspace"_a.noconvert(),
           "stream"_a);
  m.def("cuda_moe_prepare", &cuda_moe_prepare, nb::rv_policy::take_ownership, "problem"_a, "max_tokens"_a,
        "device"_a, "path"_a.none(), "caps"_a.none(), "fc1_q"_a.noconvert(), "fc1_scale"_a.noconvert(), "fc2_q"_a.noconvert(), "fc2_scale"_a.noconvert());
  m.def("cuda_route", &cuda_route, "logits"_a.noconvert(), "bias"_a.noconvert().none(), "m_device"_a.noconvert(), "num_experts"_a, "top_k"_a,
        "n_group"_a, "topk_group"_a, "renormalize"_a, "routed_scaling_factor"_a, "topk_ids"_a.noconvert(), "topk_weights"_a.noconvert(),
        "stream"_a);
}
