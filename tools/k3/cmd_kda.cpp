// `k3 kda run --input FILE --output FILE`: runs the KDA core on tensors a user brings in a
// safetensors file and writes `o` and `final_state`, so results can be compared with another
// engine. Tensor names (shapes with an optional leading batch dim of 1):
//   q, k [T, H, K] and v [T, H, V]: BF16 (used as is), F16 or F32
//   g [T, H, K]: the log decay, or the gate input f when A_log is present (or --gate says so)
//   beta [T, H] (beta itself, fla's convention) or beta_logits [T, H] (sigmoid applied inside)
//   A_log [>= H], dt_bias [H, K] or [H * K]: the gated modes (--gate safe | softplus)
//   cu_seqlens [N + 1] I64 or I32 (optional), initial_state [N, H, K, V] / [N, H, V, K] (optional)
// Non-BF16 float inputs may be F16, BF16, F32 or F64 and are converted to FP32 (F64 rounds).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "command.hpp"
#include "k3/atomic_file.hpp"
#include "k3/build_info.hpp"
#include "k3/formats.hpp"
#include "k3/kda.hpp"
#include "k3/safetensors.hpp"

namespace k3::tool {
namespace {

struct RunArgs {
  std::string input, output;
  std::string gate;  // "" = from the tensors present
  std::string layout = "k_first";
  std::string backend = "cpu";  // cpu | fp32-reference | fp64-reference
  std::string algorithm = "auto";
  float scale = 0.0f;
  float lower_bound = -5.0f;
  bool no_l2norm = false;
  int threads = 0;
};

std::string dims(const std::vector<int64_t>& s) { return st::shape_string(s); }

// The tensor's shape without a leading batch dim of 1 when the rank is one above `rank`.
std::vector<int64_t> squeeze(const st::TensorInfo& t, size_t rank) {
  std::vector<int64_t> s = t.shape;
  if (s.size() == rank + 1 && s[0] == 1) s.erase(s.begin());
  return s;
}

Result<std::vector<float>> to_f32(const st::File& f, const st::TensorInfo& t) {
  const auto b = f.bytes(t);
  // Sizes come from the file: checked before allocating (parse_header already bounds numel).
  K3_RETURN_IF_ERROR(kda::check_buffer_bytes("tensor '" + st::printable_name(t.name) + "' as FP32", t.numel(), 4));
  const size_t n = static_cast<size_t>(t.numel());
  std::vector<float> out(n);
  switch (t.dtype) {
    case st::DType::kF32:
      if (n > 0) std::memcpy(out.data(), b.data(), n * 4);  // empty: data() may be null
      break;
    case st::DType::kF64:
      for (size_t i = 0; i < n; ++i) {
        double d;
        std::memcpy(&d, b.data() + 8 * i, 8);
        out[i] = static_cast<float>(d);
      }
      break;
    case st::DType::kBF16:
    case st::DType::kF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, b.data() + 2 * i, 2);
        out[i] = t.dtype == st::DType::kBF16 ? bf16_to_f32(h) : fp16_to_f32(h);
      }
      break;
    default:
      return invalid_argument("tensor '" + t.name + "' has dtype " + st::dtype_name(t.dtype) +
                              ", expected F32, F64, BF16 or F16");
  }
  return out;
}

// Everything read from the input file, owned.
struct Loaded {
  kda::KdaConfig cfg;
  std::vector<uint16_t> q16, k16, v16;
  std::vector<float> q32, k32, v32, g, beta, a_log, dt_bias, initial_state;
  std::vector<int64_t> cu_seqlens;
  int64_t tokens = 0, seqs = 1;
  kda::KdaInputs inputs() const {
    kda::KdaInputs in;
    in.q = q16.empty() ? kda::ActSpan::of(std::span<const float>(q32)) : kda::ActSpan::of(std::span<const uint16_t>(q16));
    in.k = k16.empty() ? kda::ActSpan::of(std::span<const float>(k32)) : kda::ActSpan::of(std::span<const uint16_t>(k16));
    in.v = v16.empty() ? kda::ActSpan::of(std::span<const float>(v32)) : kda::ActSpan::of(std::span<const uint16_t>(v16));
    in.g = g, in.beta = beta, in.a_log = a_log, in.dt_bias = dt_bias;
    in.cu_seqlens = cu_seqlens, in.initial_state = initial_state;
    return in;
  }
};

Result<const st::TensorInfo*> need(const st::File& f, const char* name) {
  const st::TensorInfo* t = f.find(name);
  if (t == nullptr) return invalid_argument(f.path() + ": tensor '" + name + "' is missing");
  return t;
}

Status load_act(const st::File& f, const st::TensorInfo& t, std::vector<uint16_t>& b16, std::vector<float>& f32) {
  if (t.dtype == st::DType::kBF16) {
    K3_RETURN_IF_ERROR(kda::check_buffer_bytes("tensor '" + st::printable_name(t.name) + "'", t.numel(), 2));
    b16.resize(static_cast<size_t>(t.numel()));
    if (!b16.empty()) std::memcpy(b16.data(), f.bytes(t).data(), b16.size() * 2);  // empty: data() may be null
    return Status::ok();
  }
  auto v = to_f32(f, t);
  if (!v.is_ok()) return v.status();
  f32 = std::move(v.value());
  return Status::ok();
}

Status expect_shape(const st::TensorInfo& t, const std::vector<int64_t>& want, const char* what) {
  const auto got = squeeze(t, want.size());
  if (got != want) {
    return invalid_argument("tensor '" + t.name + "' has shape " + dims(t.shape) + ", expected " + dims(want) + " " +
                            what);
  }
  return Status::ok();
}

Result<Loaded> load(const st::File& f, const RunArgs& a) {
  Loaded L;
  auto q = need(f, "q"), k = need(f, "k"), v = need(f, "v"), g = need(f, "g");
  for (const auto* r : {&q, &k, &v, &g}) {
    if (!r->is_ok()) return r->status();
  }
  const auto qs = squeeze(*q.value(), 3);
  if (qs.size() != 3) return invalid_argument("tensor 'q' has shape " + dims(q.value()->shape) + ", expected [T, H, K]");
  const int64_t T = qs[0], H = qs[1], K = qs[2];
  const auto vs = squeeze(*v.value(), 3);
  if (vs.size() != 3 || vs[0] != T || vs[1] != H) {
    return invalid_argument("tensor 'v' has shape " + dims(v.value()->shape) + ", expected [T, H, V] with T = " +
                            std::to_string(T) + ", H = " + std::to_string(H));
  }
  const int64_t V = vs[2];
  K3_RETURN_IF_ERROR(expect_shape(*k.value(), {T, H, K}, "([T, H, K] like q)"));
  K3_RETURN_IF_ERROR(expect_shape(*g.value(), {T, H, K}, "([T, H, K] like q)"));
  L.tokens = T;
  L.cfg.num_heads = H;
  L.cfg.head_k = K;
  L.cfg.head_v = V;
  // H, K, V within the library's limits before any size product is formed from them (a [0, H, K]
  // tensor holds no bytes whatever H and K are).
  if (Status st = kda::validate_config(L.cfg); !st.is_ok()) {
    return invalid_argument("tensors 'q' " + dims(q.value()->shape) + " / 'v' " + dims(v.value()->shape) + ": " +
                            st.message());
  }
  K3_RETURN_IF_ERROR(load_act(f, *q.value(), L.q16, L.q32));
  K3_RETURN_IF_ERROR(load_act(f, *k.value(), L.k16, L.k32));
  K3_RETURN_IF_ERROR(load_act(f, *v.value(), L.v16, L.v32));
  auto gv = to_f32(f, *g.value());
  if (!gv.is_ok()) return gv.status();
  L.g = std::move(gv.value());

  const st::TensorInfo* beta = f.find("beta");
  const st::TensorInfo* logits = f.find("beta_logits");
  if ((beta == nullptr) == (logits == nullptr)) {
    return invalid_argument(f.path() + ": give exactly one of 'beta' (beta itself) and 'beta_logits' (sigmoid inside)");
  }
  const st::TensorInfo* b = beta != nullptr ? beta : logits;
  K3_RETURN_IF_ERROR(expect_shape(*b, {T, H}, "([T, H])"));
  auto bv = to_f32(f, *b);
  if (!bv.is_ok()) return bv.status();
  L.beta = std::move(bv.value());
  L.cfg.beta_logits = logits != nullptr;

  const st::TensorInfo* alog = f.find("A_log");
  const st::TensorInfo* bias = f.find("dt_bias");
  if (a.gate.empty()) {
    L.cfg.gate = alog != nullptr ? kda::GateMode::kSafe : kda::GateMode::kLogDecay;
  } else {
    auto m = kda::parse_gate_mode(a.gate);
    if (!m.is_ok()) return m.status();
    L.cfg.gate = m.value();
  }
  if (L.cfg.gate != kda::GateMode::kLogDecay) {
    if (alog == nullptr) {
      return invalid_argument(std::string("--gate ") + kda::gate_mode_name(L.cfg.gate) + " needs the tensor 'A_log'");
    }
    auto av = to_f32(f, *alog);
    if (!av.is_ok()) return av.status();
    L.a_log = std::move(av.value());
    if (bias != nullptr) {
      if (bias->numel() != H * K) {
        return invalid_argument("tensor 'dt_bias' has shape " + dims(bias->shape) + ", expected [H, K] = [" +
                                std::to_string(H) + ", " + std::to_string(K) + "] or [H * K]");
      }
      auto dv = to_f32(f, *bias);
      if (!dv.is_ok()) return dv.status();
      L.dt_bias = std::move(dv.value());
    }
  } else if (alog != nullptr || bias != nullptr) {
    return invalid_argument("the file holds A_log / dt_bias but --gate log_decay uses g as the decay directly");
  }

  if (const st::TensorInfo* cu = f.find("cu_seqlens"); cu != nullptr) {
    if (cu->shape.size() != 1) return invalid_argument("tensor 'cu_seqlens' has shape " + dims(cu->shape) + ", expected [N + 1]");
    const auto bytes = f.bytes(*cu);
    L.cu_seqlens.resize(static_cast<size_t>(cu->numel()));
    for (size_t i = 0; i < L.cu_seqlens.size(); ++i) {
      if (cu->dtype == st::DType::kI64) {
        std::memcpy(&L.cu_seqlens[i], bytes.data() + 8 * i, 8);
      } else if (cu->dtype == st::DType::kI32) {
        int32_t x;
        std::memcpy(&x, bytes.data() + 4 * i, 4);
        L.cu_seqlens[i] = x;
      } else {
        return invalid_argument(std::string("tensor 'cu_seqlens' has dtype ") + st::dtype_name(cu->dtype) +
                                ", expected I64 or I32");
      }
    }
    // A cu_seqlens tensor that is present must be valid (an empty one is not "one sequence").
    if (Status st = kda::check_cu_seqlens(L.cu_seqlens, T); !st.is_ok()) {
      return invalid_argument(f.path() + ": tensor " + st.message());
    }
    L.seqs = static_cast<int64_t>(L.cu_seqlens.size()) - 1;
  }
  auto layout = kda::parse_state_layout(a.layout);
  if (!layout.is_ok()) return layout.status();
  L.cfg.layout = layout.value();
  if (const st::TensorInfo* s0 = f.find("initial_state"); s0 != nullptr) {
    const bool kf = L.cfg.layout == kda::StateLayout::kKFirst;
    K3_RETURN_IF_ERROR(expect_shape(*s0, {L.seqs, H, kf ? K : V, kf ? V : K},
                                    kf ? "([N, H, K, V]; --layout v_first for [N, H, V, K])" : "([N, H, V, K])"));
    auto sv = to_f32(f, *s0);
    if (!sv.is_ok()) return sv.status();
    L.initial_state = std::move(sv.value());
  }
  L.cfg.scale = a.scale;
  L.cfg.gate_lower_bound = a.lower_bound;
  L.cfg.l2norm_qk = !a.no_l2norm;
  return L;
}

int fail(const Status& st) {
  std::fprintf(stderr, "k3 kda run: %s\n", st.to_string().c_str());
  return 2;
}

#define K3_RETURN_IF_ERROR_INT(expr)              \
  do {                                            \
    const ::k3::Status k3_st_ = (expr);           \
    if (!k3_st_.is_ok()) return fail(k3_st_);     \
  } while (0)

template <typename T>
std::span<const uint8_t> as_bytes(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

int run(const RunArgs& a) {
  // Paths first: the input must be a regular file (a FIFO is refused, not waited on) and the
  // output must not be the input.
  K3_RETURN_IF_ERROR_INT(check_input_file("--input", a.input));
  K3_RETURN_IF_ERROR_INT(check_output_path("--output", a.output));
  K3_RETURN_IF_ERROR_INT(check_output_not_input("--output", a.output, "--input", a.input));
  auto file = st::File::open(a.input);
  if (!file.is_ok()) return fail(file.status());
  auto loaded = load(file.value(), a);
  if (!loaded.is_ok()) return fail(loaded.status());
  const Loaded& L = loaded.value();
  const kda::KdaInputs in = L.inputs();
  const auto& c = L.cfg;
  // Output sizes come from the file's shapes (N from cu_seqlens): checked before allocating.
  const auto o_elems = kda::checked_product("output 'o' [T, H, V]", {L.tokens, c.num_heads, c.head_v});
  const auto s_elems = kda::checked_product("output 'final_state' [N, H, K, V]", {L.seqs, c.num_heads, c.head_k, c.head_v});
  if (!o_elems.is_ok()) return fail(o_elems.status());
  if (!s_elems.is_ok()) return fail(s_elems.status());
  const int64_t elem = a.backend == "fp64-reference" ? 8 : 4;
  K3_RETURN_IF_ERROR_INT(kda::check_buffer_bytes("output 'o' [T, H, V] = " + dims({L.tokens, c.num_heads, c.head_v}),
                                                 o_elems.value(), elem));
  K3_RETURN_IF_ERROR_INT(kda::check_buffer_bytes(
      "output 'final_state' [N, H, K, V] = " + dims({L.seqs, c.num_heads, c.head_k, c.head_v}), s_elems.value(), elem));
  const int64_t o_size = o_elems.value(), s_size = s_elems.value();
  const bool kf = c.layout == kda::StateLayout::kKFirst;
  const std::vector<int64_t> o_shape = {L.tokens, c.num_heads, c.head_v};
  const std::vector<int64_t> s_shape = {L.seqs, c.num_heads, kf ? c.head_k : c.head_v, kf ? c.head_v : c.head_k};
  st::Writer w;
  std::string algo = a.algorithm;
  if (a.backend == "fp64-reference") {
    std::vector<double> o(static_cast<size_t>(o_size)), s(static_cast<size_t>(s_size));
    if (Status st = kda::reference_fp64(c, in, o, s); !st.is_ok()) return fail(st);
    K3_RETURN_IF_ERROR_INT(w.add("o", st::DType::kF64, o_shape, as_bytes(o)));
    K3_RETURN_IF_ERROR_INT(w.add("final_state", st::DType::kF64, s_shape, as_bytes(s)));
    algo = "recurrent";
  } else {
    std::vector<float> o(static_cast<size_t>(o_size)), s(static_cast<size_t>(s_size));
    if (a.backend == "fp32-reference") {
      if (Status st = kda::reference_fp32(c, in, {o, s}); !st.is_ok()) return fail(st);
      algo = "recurrent";
    } else if (a.backend == "cpu") {
      auto alg = kda::parse_algorithm(a.algorithm);
      if (!alg.is_ok()) return fail(alg.status());
      kda::CpuOptions opt;
      opt.threads = a.threads;
      opt.algorithm = alg.value();
      if (Status st = kda::prefill(c, in, {o, s}, opt); !st.is_ok()) return fail(st);
    } else {
      return fail(invalid_argument("--backend " + a.backend + " is unknown (expected cpu, fp32-reference or fp64-reference)"));
    }
    K3_RETURN_IF_ERROR_INT(w.add("o", st::DType::kF32, o_shape, as_bytes(o)));
    K3_RETURN_IF_ERROR_INT(w.add("final_state", st::DType::kF32, s_shape, as_bytes(s)));
  }
  w.set_metadata({{"k3_version", build::kVersion},
                  {"backend", a.backend},
                  {"algorithm", algo},
                  {"gate", kda::gate_mode_name(c.gate)},
                  {"state_layout", kda::state_layout_name(c.layout)},
                  {"beta", c.beta_logits ? "logits" : "given"},
                  {"scale", std::to_string(c.effective_scale())}});
  if (Status st = w.write(a.output, "--output"); !st.is_ok()) return fail(st);
  std::printf("k3 kda run: T = %lld, N = %lld, H = %lld, K = %lld, V = %lld, gate %s, %s state, backend %s (%s) -> %s\n",
              static_cast<long long>(L.tokens), static_cast<long long>(L.seqs), static_cast<long long>(c.num_heads),
              static_cast<long long>(c.head_k), static_cast<long long>(c.head_v), kda::gate_mode_name(c.gate),
              kda::state_layout_name(c.layout), a.backend.c_str(), algo.c_str(), a.output.c_str());
  return 0;
}

const CommandRegistration kRegistration("kda", 30, [](CLI::App& app) -> std::function<int()> {
  auto* cmd = app.add_subcommand("kda", "Kimi Delta Attention on user tensors");
  cmd->require_subcommand(1);
  auto* r = cmd->add_subcommand("run", "Run the KDA core on a safetensors file; writes o and final_state");
  auto a = std::make_shared<RunArgs>();
  r->add_option("--input", a->input, "safetensors file with q, k, v, g, beta | beta_logits [, A_log, dt_bias, "
                                     "cu_seqlens, initial_state]")
      ->required();
  r->add_option("--output", a->output, "safetensors file to write (o, final_state)")->required();
  r->add_option("--gate", a->gate, "log_decay | safe | softplus (default: safe if A_log is present, else log_decay)");
  r->add_option("--layout", a->layout, "State layout: k_first [N,H,K,V] or v_first [N,H,V,K]")->capture_default_str();
  r->add_option("--backend", a->backend, "cpu | fp32-reference | fp64-reference")->capture_default_str();
  r->add_option("--algorithm", a->algorithm, "CPU: auto | recurrent | chunked")->capture_default_str();
  r->add_option("--scale", a->scale, "Output scale (0: K^-0.5)")->capture_default_str();
  r->add_option("--lower-bound", a->lower_bound, "lb of the safe gate")->capture_default_str();
  r->add_flag("--no-l2norm", a->no_l2norm, "q and k are already normalized (no L2 norm inside)");
  r->add_option("--threads", a->threads, "CPU threads (default: K3_NUM_THREADS or all CPUs)");
  return [a]() { return run(*a); };
});

}  // namespace
}  // namespace k3::tool
