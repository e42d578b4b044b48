// The Kimi-Linear runner (k3/model.hpp, docs/runner.md): transformers' KimiLinearForCausalLM
// computed on k3's ops, one forward() per step for a batch of sequences.
//
// Per decoder layer, on the T new tokens of the call (BF16 rows between ops):
//   h = RMSNorm(x);  x = x + (KDA(h) | MLA(h));  h = RMSNorm(x);  x = x + (MLP(h) | MoE(h))
// KDA:  one fused linear [q | k | v | f_a | b | g_a] -> short conv + SiLU (k3::kda::causal_conv1d_bf16,
//       rolling state per slot) -> the gate g = -exp(A_log) * softplus(f_b(f_a) + dt_bias) and
//       beta = sigmoid(b) as transformers computes them -> the KDA core (prefill, or decode in place
//       on the state pool) -> gated RMSNorm with g_b(g_a) -> o_proj.
// MLA:  fused [q_proj | kv_a_proj_with_mqa] -> latent c = RMSNorm(kv_a) (eps 1e-6) and the shared
//       key part k_r appended to the slot's cache -> absorbed attention (no RoPE): per head,
//       q_lat = q_nope W_uk, scores (q_lat c_s + q_r k_r,s) / sqrt(Dn + Dr), softmax, ctx = sum p_s c_s,
//       o = ctx W_uv -> o_proj.
// MLP:  fused [gate | up] -> silu(gate) * up -> down (layer 0, and the shared experts).
// MoE:  FP32 router logits -> k3::route (sigmoid + bias, grouped top-k) -> the fused MoE on MXFP4
//       experts -> + shared experts.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "k3/backend.hpp"
#include "k3/cpu_linear.hpp"
#include "k3/formats.hpp"
#include "k3/kda.hpp"
#include "k3/kda_ops.hpp"
#include "k3/model.hpp"
#include "k3/mx.hpp"
#include "k3/norm.hpp"
#include "k3/routing.hpp"
#include "k3/safetensors.hpp"

namespace k3 {

namespace {

using u16 = uint16_t;
inline float f32(u16 h) { return bf16_to_f32(h); }
inline u16 bf16(float x) { return bf16_from_f32(x); }

template <typename T>
std::span<uint8_t> bytes_of(std::vector<T>& v) {
  return {reinterpret_cast<uint8_t*>(v.data()), v.size() * sizeof(T)};
}

std::string shape_str(const std::vector<int64_t>& s) { return st::shape_string(s); }

int64_t peak_rss_bytes() {
  rusage ru{};
  if (::getrusage(RUSAGE_SELF, &ru) != 0) return 0;
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;
}

// ---- tensors from the checkpoint ----------------------------------------------------------------

class Loader {
 public:
  explicit Loader(const st::Checkpoint& ck) : ck_(ck) {}

  bool has(const std::string& name) const { return ck_.contains(name); }

  // BF16 bits of a BF16 or F32 tensor (F32 rounded to nearest even) of exactly `shape`.
  Result<std::vector<u16>> bf16(const std::string& name, const std::vector<int64_t>& shape) const {
    K3_ASSIGN_OR_RETURN(auto span, find(name, shape));
    std::vector<u16> out(static_cast<size_t>(span.info->numel()));
    if (span.info->dtype == st::DType::kBF16) {
      std::memcpy(out.data(), span.data.data(), out.size() * 2);
    } else {
      for (size_t i = 0; i < out.size(); ++i) {
        float v;
        std::memcpy(&v, span.data.data() + i * 4, 4);
        out[i] = k3::bf16_from_f32(v);
      }
    }
    return out;
  }
  // FP32 values of a BF16 or F32 tensor with `numel` elements (shape free: A_log is [1, 1, H, 1]).
  Result<std::vector<float>> f32(const std::string& name, const std::vector<int64_t>& shape, bool any_shape = false) const {
    K3_ASSIGN_OR_RETURN(auto span, find(name, shape, any_shape));
    std::vector<float> out(static_cast<size_t>(span.info->numel()));
    if (span.info->dtype == st::DType::kBF16) {
      for (size_t i = 0; i < out.size(); ++i) {
        u16 h;
        std::memcpy(&h, span.data.data() + i * 2, 2);
        out[i] = k3::bf16_to_f32(h);
      }
    } else {
      std::memcpy(out.data(), span.data.data(), out.size() * 4);
    }
    return out;
  }
  // Checks name, dtype and shape without reading the data.
  Status check(const std::string& name, const std::vector<int64_t>& shape) const { return find(name, shape).status(); }
  // The shape of a present tensor.
  Result<std::vector<int64_t>> shape(const std::string& name) const {
    auto found = ck_.find(name);
    if (!found) {
      return invalid_argument("tensor " + name + " is missing from " + ck_.directory() + ": " +
                              found.status().message());
    }
    return found->second->shape;
  }

 private:
  struct Span {
    const st::TensorInfo* info;
    std::span<const uint8_t> data;
  };
  Result<Span> find(const std::string& name, const std::vector<int64_t>& shape, bool any_shape = false) const {
    auto found = ck_.find(name);
    if (!found) {
      return invalid_argument("tensor " + name + " (" + shape_str(shape) + ", BF16 or F32) is missing from " +
                              ck_.directory() + ": " + found.status().message());
    }
    const st::File* file = found->first;
    const st::TensorInfo* info = found->second;
    int64_t want = 1;
    for (int64_t d : shape) want *= d;
    const bool shape_ok = any_shape ? info->numel() == want : info->shape == shape;
    const bool dtype_ok = info->dtype == st::DType::kBF16 || info->dtype == st::DType::kF32;
    if (!shape_ok || !dtype_ok) {
      return invalid_argument("tensor " + name + " in " + file->path() + ": expected " + shape_str(shape) +
                              (any_shape ? " (any shape of that size)" : "") + " BF16 or F32, found " +
                              shape_str(info->shape) + " " + st::dtype_name(info->dtype));
    }
    return Span{info, file->bytes(*info)};
  }
  const st::Checkpoint& ck_;
};

// ---- a packed linear layer -------------------------------------------------------------------------

struct Lin {
  std::unique_ptr<PreparedLinear> h;
  int64_t k = 0, n = 0;
  int64_t bytes() const { return h ? h->weight_bytes() : 0; }
};

struct Layer {
  bool mla = false;
  bool dense = false;  // dense MLP instead of MoE
  std::vector<u16> in_norm, post_norm;
  // KDA
  Lin kda_in, f_b, g_b, o_proj;
  std::vector<u16> conv_w;     // [3P, W]
  std::vector<float> neg_a;    // [H]: -exp(A_log) (A_log rounded to BF16, as a BF16 transformers model holds it)
  std::vector<float> dt_bias;  // [P]
  std::vector<u16> o_norm;     // [D]
  std::unique_ptr<PreparedKda> kda;
  std::vector<float> kda_state;  // [slots, H, D, D]
  std::vector<u16> conv_state;   // [slots, 3P, W - 1]
  // MLA
  Lin mla_in, q_b, mla_o;
  std::vector<u16> q_a_norm, kv_a_norm;
  std::vector<u16> w_uk;    // [Hm, Dn, C]
  std::vector<u16> w_uv;    // [Hm, C, Dv]
  std::vector<u16> latent;  // [slots, max_context, C + Dr]
  // MLP / MoE
  Lin mlp_in, mlp_down;     // dense MLP or shared experts: [gate | up], down
  bool shared = false;
  std::vector<float> router_t;     // [Hd, E] (transposed FP32 gate)
  std::vector<float> router_bias;  // [E]
  std::unique_ptr<PreparedMoe> moe;
};

class KimiLinearModel final : public Model {
 public:
  static Result<std::unique_ptr<Model>> load(const std::string& dir, const ModelOptions& opt);

  const ModelInfo& info() const override { return info_; }
  Status reset(int slot) override;
  Result<int64_t> position(int slot) const override;
  Status forward(std::span<const int32_t> tokens, std::span<const int64_t> cu_seqlens, std::span<const int32_t> slots,
                 bool all_logits, std::span<float> logits) override;

 private:
  Status prepare_lin(Lin* out, std::vector<u16> w, int64_t n, int64_t k);
  Result<Lin> load_lin(const Loader& ld, const std::vector<std::string>& names, int64_t k);
  Status load_layer(const Loader& ld, int64_t i, Layer* L);
  Status run_lin(const Lin& l, int64_t m, std::span<const u16> x, std::vector<u16>* out);
  void rms(std::span<const u16> x, std::span<const u16> w, int64_t rows, int64_t d, float eps, std::vector<u16>* y);
  Status kda_forward(Layer& L, int64_t t, std::span<const u16> h, std::vector<u16>* out);
  Status mla_forward(Layer& L, int64_t t, std::span<const u16> h, std::vector<u16>* out);
  Status mlp_forward(const Layer& L, int64_t t, std::span<const u16> h, std::vector<u16>* out);
  Status moe_forward(Layer& L, int64_t t, std::span<const u16> h, std::vector<u16>* out);
  Status forward_checked(std::span<const int32_t> tokens, bool all_logits, std::span<float> logits);

  ModelInfo info_;
  ModelOptions opt_;
  BackendOptions bopt_;
  const LinearBackend* lin_backend_ = nullptr;
  std::vector<u16> embed_, final_norm_;
  Lin lm_head_;
  std::vector<Layer> layers_;
  std::vector<int64_t> pos_;
  std::vector<uint8_t> ws_;
  // The call being run (set by forward before forward_checked).
  std::vector<int64_t> cu_;
  std::vector<int32_t> slots_;
  std::vector<int32_t> tok_seq_;   // token -> sequence of the call
  std::vector<int64_t> tok_pos_;   // token -> absolute position in its slot
};

Status KimiLinearModel::prepare_lin(Lin* out, std::vector<u16> w, int64_t n, int64_t k) {
  LinearProblem p;
  p.k = k;
  p.n = n;
  p.out_dtype = OutDType::kBF16;
  LinearWeightsView v;
  std::vector<uint8_t> codes, scales;
  if (info_.trunk == TrunkFormat::kMxfp8) {
    p.recipe = LinearRecipe::kW8A16;
    codes.resize(static_cast<size_t>(n * k));
    scales.resize(static_cast<size_t>(n * (k / 32)));
    K3_RETURN_IF_ERROR(mx_quantize_bf16(w, n, k, MxElement::kE4M3, ScaleRule::kRceil, codes, scales));
    v.codes = codes;
    v.scales = scales;
  } else {
    p.recipe = LinearRecipe::kW16A16;
    v.bf16 = w;
  }
  BackendOptions o = bopt_;
  o.max_tokens = opt_.max_batch_tokens;
  K3_ASSIGN_OR_RETURN(out->h, prepare_linear(*lin_backend_, p, v, o));
  out->k = k;
  out->n = n;
  return Status::ok();
}

// Rows of several [n_i, k] weights stacked along N into one layer (one pass over x).
Result<Lin> KimiLinearModel::load_lin(const Loader& ld, const std::vector<std::string>& names, int64_t k) {
  std::vector<u16> w;
  int64_t n = 0;
  for (const std::string& name : names) {
    K3_ASSIGN_OR_RETURN(auto shape, ld.shape(name));
    if (shape.size() != 2 || shape[1] != k) {
      return invalid_argument("tensor " + name + ": expected [N, " + std::to_string(k) + "] BF16 or F32, found " +
                              shape_str(shape));
    }
    K3_ASSIGN_OR_RETURN(auto part, ld.bf16(name, shape));
    w.insert(w.end(), part.begin(), part.end());
    n += shape[0];
  }
  Lin l;
  K3_RETURN_IF_ERROR(prepare_lin(&l, std::move(w), n, k));
  return l;
}

Status KimiLinearModel::load_layer(const Loader& ld, int64_t i, Layer* L) {
  const KimiLinearConfig& c = info_.config;
  const std::string pre = "model.layers." + std::to_string(i) + ".";
  const int64_t hd = c.hidden, H = c.kda_heads, D = c.kda_head_dim, P = H * D, W = c.conv_width;
  L->mla = c.layer_is_mla[static_cast<size_t>(i)];
  L->dense = c.layer_is_dense[static_cast<size_t>(i)];
  K3_ASSIGN_OR_RETURN(L->in_norm, ld.bf16(pre + "input_layernorm.weight", {hd}));
  K3_ASSIGN_OR_RETURN(L->post_norm, ld.bf16(pre + "post_attention_layernorm.weight", {hd}));
  const std::string a = pre + "self_attn.";
  if (!L->mla) {
    for (const char* nm : {"q_proj", "k_proj", "v_proj"}) {
      K3_RETURN_IF_ERROR(ld.check(a + nm + ".weight", {P, hd}));
    }
    K3_RETURN_IF_ERROR(ld.check(a + "f_a_proj.weight", {D, hd}));
    K3_RETURN_IF_ERROR(ld.check(a + "b_proj.weight", {H, hd}));
    K3_RETURN_IF_ERROR(ld.check(a + "g_a_proj.weight", {D, hd}));
    K3_ASSIGN_OR_RETURN(L->kda_in, load_lin(ld, {a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight",
                                                 a + "f_a_proj.weight", a + "b_proj.weight", a + "g_a_proj.weight"},
                                            hd));
    K3_RETURN_IF_ERROR(ld.check(a + "f_b_proj.weight", {P, D}));
    K3_RETURN_IF_ERROR(ld.check(a + "g_b_proj.weight", {P, D}));
    K3_RETURN_IF_ERROR(ld.check(a + "o_proj.weight", {hd, P}));
    K3_ASSIGN_OR_RETURN(L->f_b, load_lin(ld, {a + "f_b_proj.weight"}, D));
    K3_ASSIGN_OR_RETURN(L->g_b, load_lin(ld, {a + "g_b_proj.weight"}, D));
    K3_ASSIGN_OR_RETURN(L->o_proj, load_lin(ld, {a + "o_proj.weight"}, P));
    L->conv_w.clear();
    for (const char* nm : {"q_conv1d", "k_conv1d", "v_conv1d"}) {
      K3_ASSIGN_OR_RETURN(auto w, ld.bf16(a + nm + ".weight", {P, 1, W}));
      L->conv_w.insert(L->conv_w.end(), w.begin(), w.end());
    }
    K3_ASSIGN_OR_RETURN(auto a_log, ld.f32(a + "A_log", {1, 1, H, 1}, true));
    L->neg_a.resize(static_cast<size_t>(H));
    for (int64_t h = 0; h < H; ++h) {
      const float v = f32(bf16(a_log[static_cast<size_t>(h)]));
      if (!(v >= kda::kMinALog && v <= kda::kMaxALog)) {
        return invalid_argument("tensor " + a + "A_log: entry " + std::to_string(h) + " = " + std::to_string(v) +
                                " is outside [" + std::to_string(kda::kMinALog) + ", " +
                                std::to_string(kda::kMaxALog) + "]");
      }
      L->neg_a[static_cast<size_t>(h)] = -std::exp(v);
    }
    K3_ASSIGN_OR_RETURN(L->dt_bias, ld.f32(a + "dt_bias", {P}, true));
    K3_ASSIGN_OR_RETURN(L->o_norm, ld.bf16(a + "o_norm.weight", {D}));
    kda::KdaConfig kc;
    kc.num_heads = H;
    kc.head_k = D;
    kc.head_v = D;
    kc.gate = kda::GateMode::kLogDecay;
    kc.beta_logits = false;
    kc.l2norm_qk = true;
    kc.layout = kda::StateLayout::kKFirst;
    K3_ASSIGN_OR_RETURN(const KdaBackend* kb, find_kda_backend("cpu"));
    K3_ASSIGN_OR_RETURN(L->kda, prepare_kda(*kb, kc, bopt_));
    L->kda_state.assign(static_cast<size_t>(opt_.max_seqs * H * D * D), 0.0f);
    L->conv_state.assign(static_cast<size_t>(opt_.max_seqs * 3 * P * (W - 1)), 0);
  } else {
    const int64_t Hm = c.mla_heads, Dn = c.qk_nope, Dr = c.qk_rope, Dv = c.v_head, C = c.kv_lora_rank;
    const int64_t dq = Dn + Dr;
    K3_RETURN_IF_ERROR(ld.check(a + "kv_a_proj_with_mqa.weight", {C + Dr, hd}));
    if (c.q_lora_rank > 0) {
      K3_RETURN_IF_ERROR(ld.check(a + "q_a_proj.weight", {c.q_lora_rank, hd}));
      K3_ASSIGN_OR_RETURN(L->mla_in, load_lin(ld, {a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight"}, hd));
      K3_ASSIGN_OR_RETURN(L->q_a_norm, ld.bf16(a + "q_a_layernorm.weight", {c.q_lora_rank}));
      K3_RETURN_IF_ERROR(ld.check(a + "q_b_proj.weight", {Hm * dq, c.q_lora_rank}));
      K3_ASSIGN_OR_RETURN(L->q_b, load_lin(ld, {a + "q_b_proj.weight"}, c.q_lora_rank));
    } else {
      K3_RETURN_IF_ERROR(ld.check(a + "q_proj.weight", {Hm * dq, hd}));
      K3_ASSIGN_OR_RETURN(L->mla_in, load_lin(ld, {a + "q_proj.weight", a + "kv_a_proj_with_mqa.weight"}, hd));
    }
    K3_ASSIGN_OR_RETURN(L->kv_a_norm, ld.bf16(a + "kv_a_layernorm.weight", {C}));
    K3_ASSIGN_OR_RETURN(auto kvb, ld.bf16(a + "kv_b_proj.weight", {Hm * (Dn + Dv), C}));
    L->w_uk.resize(static_cast<size_t>(Hm * Dn * C));
    L->w_uv.resize(static_cast<size_t>(Hm * C * Dv));
    for (int64_t h = 0; h < Hm; ++h) {
      const u16* wh = kvb.data() + h * (Dn + Dv) * C;
      std::memcpy(L->w_uk.data() + h * Dn * C, wh, static_cast<size_t>(Dn * C) * 2);
      for (int64_t v = 0; v < Dv; ++v) {
        for (int64_t cc = 0; cc < C; ++cc) L->w_uv[static_cast<size_t>((h * C + cc) * Dv + v)] = wh[(Dn + v) * C + cc];
      }
    }
    K3_RETURN_IF_ERROR(ld.check(a + "o_proj.weight", {hd, Hm * Dv}));
    K3_ASSIGN_OR_RETURN(L->mla_o, load_lin(ld, {a + "o_proj.weight"}, Hm * Dv));
    L->latent.assign(static_cast<size_t>(opt_.max_seqs * opt_.max_context * (C + Dr)), 0);
  }
  if (L->dense) {
    // transformers' re-save names the dense MLP block_sparse_moe.*, the published checkpoint mlp.*
    const std::string m = ld.has(pre + "mlp.gate_proj.weight") ? pre + "mlp." : pre + "block_sparse_moe.";
    const int64_t I = c.intermediate;
    K3_RETURN_IF_ERROR(ld.check(m + "gate_proj.weight", {I, hd}));
    K3_RETURN_IF_ERROR(ld.check(m + "up_proj.weight", {I, hd}));
    K3_RETURN_IF_ERROR(ld.check(m + "down_proj.weight", {hd, I}));
    K3_ASSIGN_OR_RETURN(L->mlp_in, load_lin(ld, {m + "gate_proj.weight", m + "up_proj.weight"}, hd));
    K3_ASSIGN_OR_RETURN(L->mlp_down, load_lin(ld, {m + "down_proj.weight"}, I));
    return Status::ok();
  }
  const std::string m = pre + "block_sparse_moe.";
  const int64_t E = c.num_experts, I = c.moe_intermediate;
  if (c.shared_experts > 0) {
    const int64_t Is = I * c.shared_experts;
    const std::string s = m + "shared_experts.";
    K3_RETURN_IF_ERROR(ld.check(s + "gate_proj.weight", {Is, hd}));
    K3_RETURN_IF_ERROR(ld.check(s + "up_proj.weight", {Is, hd}));
    K3_RETURN_IF_ERROR(ld.check(s + "down_proj.weight", {hd, Is}));
    K3_ASSIGN_OR_RETURN(L->mlp_in, load_lin(ld, {s + "gate_proj.weight", s + "up_proj.weight"}, hd));
    K3_ASSIGN_OR_RETURN(L->mlp_down, load_lin(ld, {s + "down_proj.weight"}, Is));
    L->shared = true;
  }
  K3_ASSIGN_OR_RETURN(auto gate, ld.f32(m + "gate.weight", {E, hd}));
  L->router_t.resize(static_cast<size_t>(hd * E));
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t k = 0; k < hd; ++k) L->router_t[static_cast<size_t>(k * E + e)] = gate[static_cast<size_t>(e * hd + k)];
  }
  if (ld.has(m + "gate.e_score_correction_bias")) {
    K3_ASSIGN_OR_RETURN(L->router_bias, ld.f32(m + "gate.e_score_correction_bias", {E}));
  } else {
    L->router_bias.assign(static_cast<size_t>(E), 0.0f);
  }
  // Experts: w1 (gate) and w3 (up) [I, Hd] -> FC1 rows [gate; up]; w2 [Hd, I] -> FC2; MXFP4, RCEIL.
  std::vector<uint8_t> fc1_q(static_cast<size_t>(E * 2 * I * hd / 2)), fc1_s(static_cast<size_t>(E * 2 * I * hd / 32));
  std::vector<uint8_t> fc2_q(static_cast<size_t>(E * hd * I / 2)), fc2_s(static_cast<size_t>(E * hd * I / 32));
  for (int64_t e = 0; e < E; ++e) {
    const std::string x = m + "experts." + std::to_string(e) + ".";
    K3_ASSIGN_OR_RETURN(auto w1, ld.bf16(x + "w1.weight", {I, hd}));
    K3_ASSIGN_OR_RETURN(auto w3, ld.bf16(x + "w3.weight", {I, hd}));
    K3_ASSIGN_OR_RETURN(auto w2, ld.bf16(x + "w2.weight", {hd, I}));
    w1.insert(w1.end(), w3.begin(), w3.end());
    const auto q1 = std::span<uint8_t>(fc1_q).subspan(static_cast<size_t>(e * 2 * I * hd / 2), static_cast<size_t>(2 * I * hd / 2));
    const auto s1 = std::span<uint8_t>(fc1_s).subspan(static_cast<size_t>(e * 2 * I * hd / 32), static_cast<size_t>(2 * I * hd / 32));
    K3_RETURN_IF_ERROR(mx_quantize_bf16(w1, 2 * I, hd, MxElement::kE2M1, ScaleRule::kRceil, q1, s1));
    const auto q2 = std::span<uint8_t>(fc2_q).subspan(static_cast<size_t>(e * hd * I / 2), static_cast<size_t>(hd * I / 2));
    const auto s2 = std::span<uint8_t>(fc2_s).subspan(static_cast<size_t>(e * hd * I / 32), static_cast<size_t>(hd * I / 32));
    K3_RETURN_IF_ERROR(mx_quantize_bf16(w2, hd, I, MxElement::kE2M1, ScaleRule::kRceil, q2, s2));
  }
  MoeProblem p;
  p.shape.hidden = hd;
  p.shape.intermediate = I;
  p.shape.num_experts = static_cast<int>(E);
  p.shape.top_k = c.top_k;
  p.recipe = info_.experts;
  p.activation.kind = ActivationKind::kSiLU;
  p.out_dtype = OutDType::kBF16;
  K3_ASSIGN_OR_RETURN(const MoeBackend* mb, find_moe_backend("cpu"));
  BackendOptions o = bopt_;
  o.max_tokens = opt_.max_batch_tokens;
  K3_ASSIGN_OR_RETURN(L->moe, prepare_moe(*mb, p, MoeWeightsView{fc1_q, fc1_s, fc2_q, fc2_s, {}, {}}, o));
  return Status::ok();
}

Result<std::unique_ptr<Model>> KimiLinearModel::load(const std::string& dir, const ModelOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  K3_RETURN_IF_ERROR(check_thread_count(opt.threads, "threads"));
  if (opt.max_seqs < 1 || opt.max_seqs > kModelMaxSeqs) {
    return invalid_argument("max_seqs = " + std::to_string(opt.max_seqs) + " must be in [1, " +
                            std::to_string(kModelMaxSeqs) + "]");
  }
  if (opt.max_context < 1 || opt.max_context > kModelMaxContext) {
    return invalid_argument("max_context = " + std::to_string(opt.max_context) + " must be in [1, " +
                            std::to_string(kModelMaxContext) + "]");
  }
  if (opt.max_batch_tokens < 1 || opt.max_batch_tokens > 65536) {
    return invalid_argument("max_batch_tokens = " + std::to_string(opt.max_batch_tokens) + " must be in [1, 65536]");
  }
  auto m = std::unique_ptr<KimiLinearModel>(new KimiLinearModel());
  m->opt_ = opt;
  m->bopt_.threads = opt.threads > 0 ? opt.threads : hardware_thread_count();
  m->bopt_.isa = opt.isa;
  auto say = [&](const std::string& s) {
    if (opt.progress) opt.progress(s);
  };

  K3_ASSIGN_OR_RETURN(auto ck, st::Checkpoint::open(dir));
  const std::string cfg_path = ck.directory() + "/config.json";
  std::ifstream in(cfg_path, std::ios::binary);
  if (!in) return io_error("cannot read " + cfg_path + " (a checkpoint directory holds config.json)");
  std::stringstream ss;
  ss << in.rdbuf();
  if (ss.str().size() > (16u << 20)) return invalid_argument(cfg_path + " is larger than 16 MiB");
  K3_ASSIGN_OR_RETURN(KimiLinearConfig c, parse_kimi_linear_config(ss.str(), cfg_path));

  ModelInfo& info = m->info_;
  info.family = "kimi_linear";
  info.directory = ck.directory();
  info.config = c;
  info.trunk = opt.trunk;
  info.experts = opt.experts;
  info.threads = m->bopt_.threads;
  info.max_seqs = opt.max_seqs;
  info.max_context = opt.max_context;
  info.max_batch_tokens = opt.max_batch_tokens;
  info.isa = opt.isa.value_or(best_isa_level());

  // The state pool, checked against memory before anything large is allocated.
  int64_t state = 0;
  for (int64_t i = 0; i < c.layers; ++i) {
    if (c.layer_is_mla[static_cast<size_t>(i)]) {
      state += opt.max_seqs * opt.max_context * (c.kv_lora_rank + c.qk_rope) * 2;
    } else {
      state += opt.max_seqs * (c.kda_heads * c.kda_head_dim * c.kda_head_dim * 4 +
                               3 * c.kda_heads * c.kda_head_dim * (c.conv_width - 1) * 2);
    }
  }
  info.state_bytes = state;
  K3_RETURN_IF_ERROR(kda::check_buffer_bytes("the state pool (max_seqs x max_context)", state, 1));

  K3_ASSIGN_OR_RETURN(m->lin_backend_, find_linear_backend("cpu"));
  const Loader ld(ck);
  say("k3: loading " + info.directory + " (Kimi-Linear, " + std::to_string(c.layers) + " layers, " +
      std::to_string(c.num_experts) + " experts top-" + std::to_string(c.top_k) + "; trunk " +
      trunk_format_name(opt.trunk) + ", experts " + recipe_name(opt.experts) + ")");
  K3_ASSIGN_OR_RETURN(m->embed_, ld.bf16("model.embed_tokens.weight", {c.vocab_size, c.hidden}));
  K3_ASSIGN_OR_RETURN(m->final_norm_, ld.bf16("model.norm.weight", {c.hidden}));
  const std::string head = ld.has("lm_head.weight") || !c.tie_word_embeddings ? "lm_head.weight"
                                                                               : "model.embed_tokens.weight";
  K3_RETURN_IF_ERROR(ld.check(head, {c.vocab_size, c.hidden}));
  K3_ASSIGN_OR_RETURN(m->lm_head_, m->load_lin(ld, {head}, c.hidden));
  m->layers_.resize(static_cast<size_t>(c.layers));
  for (int64_t i = 0; i < c.layers; ++i) {
    Layer& L = m->layers_[static_cast<size_t>(i)];
    say("k3: packing layer " + std::to_string(i + 1) + " of " + std::to_string(c.layers) + " (" +
        (c.layer_is_mla[static_cast<size_t>(i)] ? "MLA" : "KDA") + ", " + (c.layer_is_dense[static_cast<size_t>(i)] ? "dense MLP" : "MoE") +
        ")");
    K3_RETURN_IF_ERROR(m->load_layer(ld, i, &L));
  }
  // Sizes: packed weights, one decode step's bytes, the shared workspace.
  int64_t packed = static_cast<int64_t>(m->embed_.size() + m->final_norm_.size()) * 2 + m->lm_head_.bytes();
  int64_t step = m->lm_head_.bytes() + c.hidden * 2;
  int64_t ws = 0;
  const int64_t expert_bytes = 3 * c.moe_intermediate * c.hidden * 17 / 32;  // 4 bits + one E8M0 per 32
  for (Layer& L : m->layers_) {
    int64_t lb = 0;
    for (const Lin* l : {&L.kda_in, &L.f_b, &L.g_b, &L.o_proj, &L.mla_in, &L.q_b, &L.mla_o, &L.mlp_in, &L.mlp_down}) {
      lb += l->bytes();
      if (l->h) ws = std::max(ws, l->h->workspace_bytes());
    }
    lb += static_cast<int64_t>(L.w_uk.size() + L.w_uv.size() + L.in_norm.size() + L.post_norm.size()) * 2 +
          static_cast<int64_t>(L.router_t.size()) * 4;
    packed += lb;
    step += lb;
    if (L.moe) {
      packed += expert_bytes * c.num_experts;
      step += expert_bytes * c.top_k;
      ws = std::max(ws, L.moe->workspace_bytes());
    }
    if (L.kda) ws = std::max(ws, L.kda->workspace_bytes());
  }
  ws = std::max(ws, m->lm_head_.h->workspace_bytes());
  m->ws_.assign(static_cast<size_t>(ws), 0);
  m->pos_.assign(static_cast<size_t>(opt.max_seqs), 0);
  info.packed_bytes = packed;
  info.step_bytes = step;
  info.peak_rss_bytes = peak_rss_bytes();
  info.load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  say("k3: packed " + std::to_string(packed >> 20) + " MiB in " + std::to_string(info.load_seconds).substr(0, 5) +
      " s; peak RSS " + std::to_string(info.peak_rss_bytes >> 20) + " MiB; state pool " +
      std::to_string(state >> 20) + " MiB");
  return std::unique_ptr<Model>(std::move(m));
}

Status KimiLinearModel::reset(int slot) {
  if (slot < 0 || slot >= opt_.max_seqs) {
    return invalid_argument("slot = " + std::to_string(slot) + " must be in [0, max_seqs = " +
                            std::to_string(opt_.max_seqs) + ")");
  }
  const KimiLinearConfig& c = info_.config;
  for (Layer& L : layers_) {
    if (L.mla) {
      const int64_t row = opt_.max_context * (c.kv_lora_rank + c.qk_rope);
      std::fill(L.latent.begin() + slot * row, L.latent.begin() + (slot + 1) * row, u16{0});
    } else {
      const int64_t s = c.kda_heads * c.kda_head_dim * c.kda_head_dim;
      std::fill(L.kda_state.begin() + slot * s, L.kda_state.begin() + (slot + 1) * s, 0.0f);
      const int64_t cs = 3 * c.kda_heads * c.kda_head_dim * (c.conv_width - 1);
      std::fill(L.conv_state.begin() + slot * cs, L.conv_state.begin() + (slot + 1) * cs, u16{0});
    }
  }
  pos_[static_cast<size_t>(slot)] = 0;
  return Status::ok();
}

Result<int64_t> KimiLinearModel::position(int slot) const {
  if (slot < 0 || slot >= opt_.max_seqs) {
    return invalid_argument("slot = " + std::to_string(slot) + " must be in [0, max_seqs = " +
                            std::to_string(opt_.max_seqs) + ")");
  }
  return pos_[static_cast<size_t>(slot)];
}

Status KimiLinearModel::run_lin(const Lin& l, int64_t m, std::span<const u16> x, std::vector<u16>* out) {
  out->resize(static_cast<size_t>(m * l.n));
  return l.h->run(m, x.first(static_cast<size_t>(m * l.k)), std::span<uint8_t>(ws_).first(static_cast<size_t>(l.h->workspace_bytes())),
                  bytes_of(*out));
}

void KimiLinearModel::rms(std::span<const u16> x, std::span<const u16> w, int64_t rows, int64_t d, float eps,
                          std::vector<u16>* y) {
  y->resize(static_cast<size_t>(rows * d));
  RmsNormArgs<u16> a;
  a.dim = d;
  a.eps = eps;
  a.x = x.first(static_cast<size_t>(rows * d));
  a.weight = w;
  a.y = *y;
  (void)rms_norm(a, bopt_.threads);  // sizes are the runner's own; checked at load
}

// Columns [c0, c0 + w) of rows of width ld.
std::vector<u16> columns(std::span<const u16> x, int64_t rows, int64_t ld, int64_t c0, int64_t w) {
  std::vector<u16> out(static_cast<size_t>(rows * w));
  for (int64_t r = 0; r < rows; ++r) std::memcpy(out.data() + r * w, x.data() + r * ld + c0, static_cast<size_t>(w) * 2);
  return out;
}

Status KimiLinearModel::kda_forward(Layer& L, int64_t t, std::span<const u16> h, std::vector<u16>* out) {
  const KimiLinearConfig& c = info_.config;
  const int64_t H = c.kda_heads, D = c.kda_head_dim, P = H * D, W = c.conv_width, S = W - 1;
  const int64_t n_seq = static_cast<int64_t>(slots_.size());
  std::vector<u16> f;
  K3_RETURN_IF_ERROR(run_lin(L.kda_in, t, h, &f));
  const int64_t ld = L.kda_in.n;
  std::vector<u16> qkv = columns(f, t, ld, 0, 3 * P);
  std::vector<u16> fa = columns(f, t, ld, 3 * P, D);
  std::vector<u16> ga = columns(f, t, ld, 3 * P + D + H, D);
  // Short conv + SiLU on the slots' rolling states.
  const int64_t cs = 3 * P * S;
  std::vector<u16> state(static_cast<size_t>(n_seq * cs));
  for (int64_t n = 0; n < n_seq; ++n) {
    std::memcpy(state.data() + n * cs, L.conv_state.data() + slots_[static_cast<size_t>(n)] * cs, static_cast<size_t>(cs) * 2);
  }
  std::vector<u16> y(static_cast<size_t>(t * 3 * P));
  kda::ConvArgsBf16 ca;
  ca.channels = 3 * P;
  ca.width = W;
  ca.silu = true;
  ca.x = qkv;
  ca.weight = L.conv_w;
  ca.cu_seqlens = cu_;
  ca.conv_state = state;
  ca.y = y;
  ca.state_len = S;
  K3_RETURN_IF_ERROR(kda::causal_conv1d_bf16(ca, bopt_.threads));
  for (int64_t n = 0; n < n_seq; ++n) {
    std::memcpy(L.conv_state.data() + slots_[static_cast<size_t>(n)] * cs, state.data() + n * cs, static_cast<size_t>(cs) * 2);
  }
  std::vector<u16> q = columns(y, t, 3 * P, 0, P), k = columns(y, t, 3 * P, P, P), v = columns(y, t, 3 * P, 2 * P, P);
  // The gate and beta, as transformers computes them from BF16 projections.
  std::vector<u16> fb, gb;
  K3_RETURN_IF_ERROR(run_lin(L.f_b, t, fa, &fb));
  K3_RETURN_IF_ERROR(run_lin(L.g_b, t, ga, &gb));
  std::vector<float> g(static_cast<size_t>(t * P)), beta(static_cast<size_t>(t * H));
  for (int64_t r = 0; r < t; ++r) {
    for (int64_t p = 0; p < P; ++p) {
      const float x = f32(fb[static_cast<size_t>(r * P + p)]) + L.dt_bias[static_cast<size_t>(p)];
      const float sp = x > 20.0f ? x : std::log(1.0f + std::exp(x));
      g[static_cast<size_t>(r * P + p)] = L.neg_a[static_cast<size_t>(p / D)] * sp;
    }
    for (int64_t hh = 0; hh < H; ++hh) {
      const float b = f32(f[static_cast<size_t>(r * ld + 3 * P + D + hh)]);
      beta[static_cast<size_t>(r * H + hh)] = f32(bf16(1.0f / (1.0f + std::exp(-b))));
    }
  }
  std::vector<float> o(static_cast<size_t>(t * P));
  kda::KdaInputs ki;
  ki.q = kda::ActSpan::of(std::span<const u16>(q));
  ki.k = kda::ActSpan::of(std::span<const u16>(k));
  ki.v = kda::ActSpan::of(std::span<const u16>(v));
  ki.g = g;
  ki.beta = beta;
  const auto wsk = std::span<uint8_t>(ws_).first(static_cast<size_t>(L.kda->workspace_bytes()));
  if (t == n_seq) {  // one token per sequence: decode in place on the pool
    kda::DecodeArgs da;
    da.in = ki;
    da.state_pool = L.kda_state;
    da.state_indices = slots_;
    da.o = o;
    K3_RETURN_IF_ERROR(L.kda->decode(da, wsk));
  } else {
    const int64_t ss = H * D * D;
    std::vector<float> init(static_cast<size_t>(n_seq * ss)), fin(static_cast<size_t>(n_seq * ss));
    for (int64_t n = 0; n < n_seq; ++n) {
      std::memcpy(init.data() + n * ss, L.kda_state.data() + slots_[static_cast<size_t>(n)] * ss, static_cast<size_t>(ss) * 4);
    }
    ki.cu_seqlens = cu_;
    ki.initial_state = init;
    kda::KdaOutputs ko;
    ko.o = o;
    ko.final_state = fin;
    K3_RETURN_IF_ERROR(L.kda->prefill(ki, ko, wsk));
    for (int64_t n = 0; n < n_seq; ++n) {
      std::memcpy(L.kda_state.data() + slots_[static_cast<size_t>(n)] * ss, fin.data() + n * ss, static_cast<size_t>(ss) * 4);
    }
  }
  std::vector<u16> ob(o.size()), yn(o.size());
  for (size_t i = 0; i < o.size(); ++i) ob[i] = bf16(o[i]);
  GatedRmsNormRowsArgs<u16> na;
  na.dim = D;
  na.eps = c.rms_norm_eps;
  na.x = ob;
  na.gate = gb;
  na.weight = L.o_norm;
  na.y = yn;
  K3_RETURN_IF_ERROR(rms_norm_gated(na, bopt_.threads));
  return run_lin(L.o_proj, t, yn, out);
}

// Sum of a[i] * b[i] (b BF16) in 16 interleaved FP32 partial sums, then pairwise: a fixed order.
inline float dot_bf16(const float* a, const u16* b, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * f32(b[i + j]);
  }
  for (; i < n; ++i) acc[i % 16] += a[i] * f32(b[i]);
  for (int w = 8; w >= 1; w /= 2) {
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  }
  return acc[0];
}

Status KimiLinearModel::mla_forward(Layer& L, int64_t t, std::span<const u16> h, std::vector<u16>* out) {
  const KimiLinearConfig& c = info_.config;
  const int64_t Hm = c.mla_heads, Dn = c.qk_nope, Dr = c.qk_rope, Dv = c.v_head, C = c.kv_lora_rank, dq = Dn + Dr;
  const int64_t R = C + Dr;  // a cache row
  std::vector<u16> f, q;
  K3_RETURN_IF_ERROR(run_lin(L.mla_in, t, h, &f));
  const int64_t ld = L.mla_in.n;
  int64_t off = 0;
  if (c.q_lora_rank > 0) {
    std::vector<u16> qa = columns(f, t, ld, 0, c.q_lora_rank), qn;
    rms(qa, L.q_a_norm, t, c.q_lora_rank, 1e-6f, &qn);
    K3_RETURN_IF_ERROR(run_lin(L.q_b, t, qn, &q));
    off = c.q_lora_rank;
  } else {
    q = columns(f, t, ld, 0, Hm * dq);
    off = Hm * dq;
  }
  std::vector<u16> cl = columns(f, t, ld, off, C), cn;
  rms(cl, L.kv_a_norm, t, C, 1e-6f, &cn);
  for (int64_t r = 0; r < t; ++r) {
    u16* row = L.latent.data() + (slots_[static_cast<size_t>(tok_seq_[static_cast<size_t>(r)])] * opt_.max_context +
                                  tok_pos_[static_cast<size_t>(r)]) * R;
    std::memcpy(row, cn.data() + r * C, static_cast<size_t>(C) * 2);
    std::memcpy(row + C, f.data() + r * ld + off + C, static_cast<size_t>(Dr) * 2);
  }
  // q_lat[t, h] = q_nope[t, h] W_uk[h]   (FP32, [T, Hm, C])
  std::vector<float> qn(static_cast<size_t>(Hm * Dn)), qlat(static_cast<size_t>(t * Hm * C));
  for (int64_t r = 0; r < t; ++r) {
    for (int64_t hh = 0; hh < Hm; ++hh) {
      for (int64_t d = 0; d < Dn; ++d) qn[static_cast<size_t>(hh * Dn + d)] = f32(q[static_cast<size_t>(r * Hm * dq + hh * dq + d)]);
    }
    cpu::HeadGemvArgs a;
    a.heads = Hm;
    a.k = Dn;
    a.n = C;
    a.w = L.w_uk;
    a.x = qn;
    a.y = std::span<float>(qlat).subspan(static_cast<size_t>(r * Hm * C), static_cast<size_t>(Hm * C));
    K3_RETURN_IF_ERROR(cpu::head_gemv_bf16(a, bopt_.threads, opt_.isa));
  }
  // Attention per (token, head) over the slot's cache up to the token's position.
  const float scale = 1.0f / std::sqrt(static_cast<float>(dq));
  std::vector<float> ctx(static_cast<size_t>(t * Hm * C));
  const int64_t pairs = t * Hm;
#pragma omp parallel for schedule(dynamic, 1) num_threads(bopt_.threads)
  for (int64_t ph = 0; ph < pairs; ++ph) {
    const int64_t r = ph / Hm, hh = ph % Hm;
    const int64_t len = tok_pos_[static_cast<size_t>(r)] + 1;
    const u16* cache = L.latent.data() + slots_[static_cast<size_t>(tok_seq_[static_cast<size_t>(r)])] * opt_.max_context * R;
    const float* ql = qlat.data() + (r * Hm + hh) * C;
    float qr[kModelMaxHeadDim];
    for (int64_t d = 0; d < Dr; ++d) qr[d] = f32(q[static_cast<size_t>(r * Hm * dq + hh * dq + Dn + d)]);
    std::vector<float> s(static_cast<size_t>(len));
    float mx = -INFINITY;
    for (int64_t j = 0; j < len; ++j) {
      const u16* row = cache + j * R;
      const float v = (dot_bf16(ql, row, C) + dot_bf16(qr, row + C, Dr)) * scale;
      s[static_cast<size_t>(j)] = v;
      mx = std::max(mx, v);
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < len; ++j) {
      s[static_cast<size_t>(j)] = std::exp(s[static_cast<size_t>(j)] - mx);
      sum += s[static_cast<size_t>(j)];
    }
    const float inv = 1.0f / sum;
    float* cx = ctx.data() + (r * Hm + hh) * C;
    std::fill(cx, cx + C, 0.0f);
    for (int64_t j = 0; j < len; ++j) {
      const float p = s[static_cast<size_t>(j)] * inv;
      const u16* row = cache + j * R;
      for (int64_t cc = 0; cc < C; ++cc) cx[cc] += p * f32(row[cc]);
    }
  }
  // o[t, h] = ctx[t, h] W_uv[h] -> BF16 [T, Hm * Dv] -> o_proj
  std::vector<float> o(static_cast<size_t>(Hm * Dv));
  std::vector<u16> ob(static_cast<size_t>(t * Hm * Dv));
  for (int64_t r = 0; r < t; ++r) {
    cpu::HeadGemvArgs a;
    a.heads = Hm;
    a.k = C;
    a.n = Dv;
    a.w = L.w_uv;
    a.x = std::span<const float>(ctx).subspan(static_cast<size_t>(r * Hm * C), static_cast<size_t>(Hm * C));
    a.y = o;
    K3_RETURN_IF_ERROR(cpu::head_gemv_bf16(a, bopt_.threads, opt_.isa));
    for (int64_t i = 0; i < Hm * Dv; ++i) ob[static_cast<size_t>(r * Hm * Dv + i)] = bf16(o[static_cast<size_t>(i)]);
  }
  return run_lin(L.mla_o, t, ob, out);
}

Status KimiLinearModel::mlp_forward(const Layer& L, int64_t t, std::span<const u16> h, std::vector<u16>* out) {
  std::vector<u16> gu;
  K3_RETURN_IF_ERROR(run_lin(L.mlp_in, t, h, &gu));
  const int64_t I = L.mlp_in.n / 2;
  std::vector<u16> a(static_cast<size_t>(t * I));
  for (int64_t r = 0; r < t; ++r) {
    for (int64_t i = 0; i < I; ++i) {
      const float g = f32(gu[static_cast<size_t>(r * 2 * I + i)]);
      const float s = f32(bf16(g / (1.0f + std::exp(-g))));
      a[static_cast<size_t>(r * I + i)] = bf16(s * f32(gu[static_cast<size_t>(r * 2 * I + I + i)]));
    }
  }
  return run_lin(L.mlp_down, t, a, out);
}

Status KimiLinearModel::moe_forward(Layer& L, int64_t t, std::span<const u16> h, std::vector<u16>* out) {
  const KimiLinearConfig& c = info_.config;
  const int64_t hd = c.hidden, E = c.num_experts;
  // Router logits in FP32 (x widened from BF16, the gate's FP32 values), each summed over k in order.
  std::vector<float> logits(static_cast<size_t>(t * E), 0.0f);
  constexpr int64_t kEBlock = 64;
  const int64_t eblocks = (E + kEBlock - 1) / kEBlock;
#pragma omp parallel for schedule(static) num_threads(bopt_.threads)
  for (int64_t job = 0; job < t * eblocks; ++job) {
    const int64_t r = job / eblocks, e0 = (job % eblocks) * kEBlock, e1 = std::min(E, e0 + kEBlock);
    float* lg = logits.data() + r * E;
    for (int64_t k = 0; k < hd; ++k) {
      const float x = f32(h[static_cast<size_t>(r * hd + k)]);
      const float* w = L.router_t.data() + k * E;
      for (int64_t e = e0; e < e1; ++e) lg[e] += x * w[e];
    }
  }
  RoutingConfig rc;
  rc.num_experts = static_cast<int>(E);
  rc.top_k = c.top_k;
  rc.n_group = c.n_group;
  rc.topk_group = c.topk_group;
  rc.renormalize = c.renormalize;
  rc.routed_scaling_factor = c.routed_scaling_factor;
  std::vector<int32_t> ids(static_cast<size_t>(t * c.top_k));
  std::vector<float> wts(ids.size());
  K3_RETURN_IF_ERROR(route(rc, t, logits, L.router_bias, ids, wts));
  out->resize(static_cast<size_t>(t * hd));
  MoeInputsView in;
  in.m = t;
  in.x = h.first(static_cast<size_t>(t * hd));
  in.topk_ids = ids;
  in.topk_weights = wts;
  K3_RETURN_IF_ERROR(L.moe->run(in, std::span<uint8_t>(ws_).first(static_cast<size_t>(L.moe->workspace_bytes())),
                                bytes_of(*out)));
  if (L.shared) {
    std::vector<u16> s;
    K3_RETURN_IF_ERROR(mlp_forward(L, t, h, &s));
    for (size_t i = 0; i < out->size(); ++i) (*out)[i] = bf16(f32((*out)[i]) + f32(s[i]));
  }
  return Status::ok();
}

Status KimiLinearModel::forward(std::span<const int32_t> tokens, std::span<const int64_t> cu_seqlens,
                                std::span<const int32_t> slots, bool all_logits, std::span<float> logits) {
  const KimiLinearConfig& c = info_.config;
  const int64_t t = static_cast<int64_t>(tokens.size());
  if (t < 1 || t > opt_.max_batch_tokens) {
    return invalid_argument("tokens: " + std::to_string(t) + " tokens in one call; it takes 1 to max_batch_tokens = " +
                            std::to_string(opt_.max_batch_tokens));
  }
  cu_.clear();
  if (cu_seqlens.empty()) {
    cu_ = {0, t};
  } else {
    cu_.assign(cu_seqlens.begin(), cu_seqlens.end());
    if (cu_.size() < 2 || cu_.front() != 0 || cu_.back() != t) {
      return invalid_argument("cu_seqlens must start at 0 and end at the token count " + std::to_string(t));
    }
    for (size_t n = 0; n + 1 < cu_.size(); ++n) {
      if (cu_[n + 1] <= cu_[n]) {
        return invalid_argument("cu_seqlens[" + std::to_string(n + 1) + "] = " + std::to_string(cu_[n + 1]) +
                                " must exceed cu_seqlens[" + std::to_string(n) + "] = " + std::to_string(cu_[n]) +
                                " (every sequence brings at least one token)");
      }
    }
  }
  const int64_t n_seq = static_cast<int64_t>(cu_.size()) - 1;
  if (static_cast<int64_t>(slots.size()) != n_seq) {
    return invalid_argument("slots holds " + std::to_string(slots.size()) + " entries for " + std::to_string(n_seq) +
                            " sequences");
  }
  std::vector<bool> seen(static_cast<size_t>(opt_.max_seqs), false);
  for (int64_t n = 0; n < n_seq; ++n) {
    const int32_t s = slots[static_cast<size_t>(n)];
    if (s < 0 || s >= opt_.max_seqs) {
      return invalid_argument("slots[" + std::to_string(n) + "] = " + std::to_string(s) + " must be in [0, max_seqs = " +
                              std::to_string(opt_.max_seqs) + ")");
    }
    if (seen[static_cast<size_t>(s)]) {
      return invalid_argument("slots[" + std::to_string(n) + "] = " + std::to_string(s) + " is named twice");
    }
    seen[static_cast<size_t>(s)] = true;
    const int64_t len = cu_[static_cast<size_t>(n + 1)] - cu_[static_cast<size_t>(n)];
    const int64_t pos = pos_[static_cast<size_t>(s)];
    if (pos + len > opt_.max_context) {
      return out_of_range("slot " + std::to_string(s) + " holds " + std::to_string(pos) + " tokens; " +
                          std::to_string(len) + " more exceed max_context = " + std::to_string(opt_.max_context) +
                          " (the state pool's length per sequence: ModelOptions::max_context, --max-context)");
    }
  }
  for (int64_t i = 0; i < t; ++i) {
    const int32_t id = tokens[static_cast<size_t>(i)];
    if (id < 0 || id >= c.vocab_size) {
      return invalid_argument("tokens[" + std::to_string(i) + "] = " + std::to_string(id) + " is outside the vocabulary [0, " +
                              std::to_string(c.vocab_size) + ")");
    }
  }
  const int64_t rows = all_logits ? t : n_seq;
  if (static_cast<int64_t>(logits.size()) != rows * c.vocab_size) {
    return invalid_argument("logits holds " + std::to_string(logits.size()) + " floats; expected " +
                            std::to_string(rows) + " x vocab " + std::to_string(c.vocab_size));
  }
  slots_.assign(slots.begin(), slots.end());
  tok_seq_.resize(static_cast<size_t>(t));
  tok_pos_.resize(static_cast<size_t>(t));
  for (int64_t n = 0; n < n_seq; ++n) {
    for (int64_t i = cu_[static_cast<size_t>(n)]; i < cu_[static_cast<size_t>(n + 1)]; ++i) {
      tok_seq_[static_cast<size_t>(i)] = static_cast<int32_t>(n);
      tok_pos_[static_cast<size_t>(i)] = pos_[static_cast<size_t>(slots_[static_cast<size_t>(n)])] + i - cu_[static_cast<size_t>(n)];
    }
  }
  Status s = forward_checked(tokens, all_logits, logits);
  for (int64_t n = 0; n < n_seq; ++n) {
    const int32_t slot = slots_[static_cast<size_t>(n)];
    if (s.is_ok()) {
      pos_[static_cast<size_t>(slot)] += cu_[static_cast<size_t>(n + 1)] - cu_[static_cast<size_t>(n)];
    } else {
      (void)reset(slot);  // a failed step leaves no half-updated state behind
    }
  }
  return s;
}

Status KimiLinearModel::forward_checked(std::span<const int32_t> tokens, bool all_logits, std::span<float> logits) {
  const KimiLinearConfig& c = info_.config;
  const int64_t t = static_cast<int64_t>(tokens.size()), hd = c.hidden;
  std::vector<u16> x(static_cast<size_t>(t * hd)), h, a;
  for (int64_t i = 0; i < t; ++i) {
    std::memcpy(x.data() + i * hd, embed_.data() + tokens[static_cast<size_t>(i)] * hd, static_cast<size_t>(hd) * 2);
  }
  const auto add = [&](const std::vector<u16>& y) {
    for (size_t i = 0; i < x.size(); ++i) x[i] = bf16(f32(x[i]) + f32(y[i]));
  };
  for (Layer& L : layers_) {
    rms(x, L.in_norm, t, hd, c.rms_norm_eps, &h);
    K3_RETURN_IF_ERROR(L.mla ? mla_forward(L, t, h, &a) : kda_forward(L, t, h, &a));
    add(a);
    rms(x, L.post_norm, t, hd, c.rms_norm_eps, &h);
    K3_RETURN_IF_ERROR(L.dense ? mlp_forward(L, t, h, &a) : moe_forward(L, t, h, &a));
    add(a);
  }
  std::vector<u16> sel;
  int64_t rows = t;
  if (all_logits) {
    sel = std::move(x);
  } else {
    rows = static_cast<int64_t>(cu_.size()) - 1;
    sel.resize(static_cast<size_t>(rows * hd));
    for (int64_t n = 0; n < rows; ++n) {
      std::memcpy(sel.data() + n * hd, x.data() + (cu_[static_cast<size_t>(n + 1)] - 1) * hd, static_cast<size_t>(hd) * 2);
    }
  }
  rms(sel, final_norm_, rows, hd, c.rms_norm_eps, &h);
  std::vector<u16> lg;
  K3_RETURN_IF_ERROR(run_lin(lm_head_, rows, h, &lg));
  for (size_t i = 0; i < lg.size(); ++i) logits[i] = f32(lg[i]);
  return Status::ok();
}

}  // namespace

std::string ModelInfo::describe() const {
  std::ostringstream o;
  const KimiLinearConfig& c = config;
  int64_t mla = 0;
  for (bool b : c.layer_is_mla) mla += b ? 1 : 0;
  int64_t dense = 0;
  for (bool b : c.layer_is_dense) dense += b ? 1 : 0;
  o << "model        " << family << " at " << directory << "\n"
    << "layers       " << c.layers << " (" << (c.layers - mla) << " KDA, " << mla << " MLA; " << dense
    << " dense MLP), hidden " << c.hidden << ", vocab " << c.vocab_size << "\n"
    << "experts      " << c.num_experts << " top-" << c.top_k << " + " << c.shared_experts << " shared, width "
    << c.moe_intermediate << ", MXFP4 " << recipe_name(experts) << "\n"
    << "trunk        " << trunk_format_name(trunk) << "\n"
    << "threads      " << threads << ", ISA " << isa_level_name(isa) << "\n"
    << "packed       " << (packed_bytes >> 20) << " MiB; one decode step reads " << (step_bytes >> 20)
    << " MiB; state pool " << (state_bytes >> 20) << " MiB; peak RSS " << (peak_rss_bytes >> 20) << " MiB\n";
  return o.str();
}

Result<std::unique_ptr<Model>> Model::load(const std::string& directory, const ModelOptions& options) {
  return KimiLinearModel::load(directory, options);
}

}  // namespace k3
