// KDA inputs from a safetensors file (k3/harness/kda_io.hpp): the input path of `k3 kda run`, in the
// library so that the fuzz target (fuzz/fuzz_kda_input.cpp) and tests run exactly this code.
#include "k3/harness/kda_io.hpp"

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/kda/kda_math.hpp"
#include "k3/formats.hpp"

namespace k3::kda {
namespace {

std::string dims(const std::vector<int64_t>& s) { return st::shape_string(s); }

// The tensor's shape without a leading batch dim of 1 when the rank is one above `rank`.
std::vector<int64_t> squeeze(const st::TensorInfo& t, size_t rank) {
  std::vector<int64_t> s = t.shape;
  if (s.size() == rank + 1 && s[0] == 1) s.erase(s.begin());
  return s;
}

Result<std::vector<float>> to_f32(const st::File& f, const st::TensorInfo& t) {
  switch (t.dtype) {
    case st::DType::kF32:
    case st::DType::kF64:
    case st::DType::kBF16:
    case st::DType::kF16: break;
    default:
      return invalid_argument("tensor '" + st::printable_name(t.name) + "' has dtype " + st::dtype_name(t.dtype) +
                              ", expected F32, F64, BF16 or F16");
  }
  const auto b = f.bytes(t);
  // Sizes come from the file: checked before allocating (parse_header already bounds numel).
  K3_RETURN_IF_ERROR(check_buffer_bytes("tensor '" + st::printable_name(t.name) + "' as FP32", t.numel(), 4));
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
    default:  // BF16, F16
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, b.data() + 2 * i, 2);
        out[i] = t.dtype == st::DType::kBF16 ? bf16_to_f32(h) : fp16_to_f32(h);
      }
      break;
  }
  return out;
}

Result<const st::TensorInfo*> need(const st::File& f, const char* name) {
  const st::TensorInfo* t = f.find(name);
  if (t == nullptr) return invalid_argument(f.path() + ": tensor '" + name + "' is missing");
  return t;
}

Status load_act(const st::File& f, const st::TensorInfo& t, std::vector<uint16_t>& b16, std::vector<float>& f32) {
  if (t.dtype == st::DType::kBF16) {
    K3_RETURN_IF_ERROR(check_buffer_bytes("tensor '" + st::printable_name(t.name) + "'", t.numel(), 2));
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
    return invalid_argument("tensor '" + st::printable_name(t.name) + "' has shape " + dims(t.shape) + ", expected " +
                            dims(want) + " " + what);
  }
  return Status::ok();
}

Status load_cu_seqlens(const st::File& f, const st::TensorInfo& cu, int64_t tokens, std::vector<int64_t>& out) {
  if (cu.shape.size() != 1) return invalid_argument("tensor 'cu_seqlens' has shape " + dims(cu.shape) + ", expected [N + 1]");
  if (cu.dtype != st::DType::kI64 && cu.dtype != st::DType::kI32) {
    return invalid_argument(std::string("tensor 'cu_seqlens' has dtype ") + st::dtype_name(cu.dtype) +
                            ", expected I64 or I32");
  }
  K3_RETURN_IF_ERROR(check_buffer_bytes("tensor 'cu_seqlens' as I64", cu.numel(), 8));
  const auto bytes = f.bytes(cu);
  out.resize(static_cast<size_t>(cu.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    if (cu.dtype == st::DType::kI64) {
      std::memcpy(&out[i], bytes.data() + 8 * i, 8);
    } else {
      int32_t x;
      std::memcpy(&x, bytes.data() + 4 * i, 4);
      out[i] = x;
    }
  }
  // A cu_seqlens tensor that is present must be valid (an empty one is not "one sequence").
  if (Status st = check_cu_seqlens(out, tokens); !st.is_ok()) return invalid_argument(f.path() + ": tensor " + st.message());
  return Status::ok();
}

}  // namespace

KdaInputs InputFile::inputs() const {
  KdaInputs in;
  in.q = q16.empty() ? ActSpan::of(std::span<const float>(q32)) : ActSpan::of(std::span<const uint16_t>(q16));
  in.k = k16.empty() ? ActSpan::of(std::span<const float>(k32)) : ActSpan::of(std::span<const uint16_t>(k16));
  in.v = v16.empty() ? ActSpan::of(std::span<const float>(v32)) : ActSpan::of(std::span<const uint16_t>(v16));
  in.g = g, in.beta = beta, in.a_log = a_log, in.dt_bias = dt_bias;
  in.cu_seqlens = cu_seqlens, in.initial_state = initial_state;
  return in;
}

Result<InputFile> load_input_file(const st::File& f, const InputFileOptions& a) {
  InputFile L;
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
  if (Status st = validate_config(L.cfg); !st.is_ok()) {
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
    L.cfg.gate = alog != nullptr ? GateMode::kSafe : GateMode::kLogDecay;
  } else {
    auto m = parse_gate_mode(a.gate);
    if (!m.is_ok()) return m.status();
    L.cfg.gate = m.value();
  }
  if (L.cfg.gate != GateMode::kLogDecay) {
    if (alog == nullptr) {
      return invalid_argument(std::string("--gate ") + gate_mode_name(L.cfg.gate) + " needs the tensor 'A_log'");
    }
    if (alog->numel() < H) {
      return invalid_argument("tensor 'A_log' has shape " + dims(alog->shape) + ", expected at least H = " +
                              std::to_string(H) + " elements (the first H are used)");
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
    K3_RETURN_IF_ERROR(load_cu_seqlens(f, *cu, T, L.cu_seqlens));
    L.seqs = static_cast<int64_t>(L.cu_seqlens.size()) - 1;
  }
  auto layout = parse_state_layout(a.layout);
  if (!layout.is_ok()) return layout.status();
  L.cfg.layout = layout.value();
  if (const st::TensorInfo* s0 = f.find("initial_state"); s0 != nullptr) {
    const bool kf = L.cfg.layout == StateLayout::kKFirst;
    K3_RETURN_IF_ERROR(expect_shape(*s0, {L.seqs, H, kf ? K : V, kf ? V : K},
                                    kf ? "([N, H, K, V]; --layout v_first for [N, H, V, K])" : "([N, H, V, K])"));
    auto sv = to_f32(f, *s0);
    if (!sv.is_ok()) return sv.status();
    L.initial_state = std::move(sv.value());
  }
  L.cfg.scale = a.scale;
  L.cfg.gate_lower_bound = a.lower_bound;
  L.cfg.l2norm_qk = a.l2norm_qk;
  if (Status st = validate_config(L.cfg); !st.is_ok()) return st;  // --scale, --lower-bound
  // Everything a backend checks (the parameters' values included), so that a loaded file runs.
  auto out = output_elements(L, 4);
  if (!out.is_ok()) return out.status();
  auto shape = detail::validate_prefill_sizes(L.cfg, L.inputs(), out->o, out->final_state);
  if (!shape.is_ok()) return invalid_argument(f.path() + ": " + shape.status().message());
  return L;
}

Result<OutputElements> output_elements(const InputFile& L, int64_t elem_bytes) {
  const KdaConfig& c = L.cfg;
  const auto o = checked_product("output 'o' [T, H, V]", {L.tokens, c.num_heads, c.head_v});
  if (!o.is_ok()) return o.status();
  const auto s = checked_product("output 'final_state' [N, H, K, V]", {L.seqs, c.num_heads, c.head_k, c.head_v});
  if (!s.is_ok()) return s.status();
  K3_RETURN_IF_ERROR(check_buffer_bytes("output 'o' [T, H, V] = " + dims({L.tokens, c.num_heads, c.head_v}), o.value(),
                                        elem_bytes));
  K3_RETURN_IF_ERROR(check_buffer_bytes(
      "output 'final_state' [N, H, K, V] = " + dims({L.seqs, c.num_heads, c.head_k, c.head_v}), s.value(), elem_bytes));
  return OutputElements{o.value(), s.value()};
}

}  // namespace k3::kda
