// config.json of a Kimi-Linear checkpoint -> KimiLinearConfig (k3/model.hpp). Field names and
// defaults are transformers' KimiLinearConfig; every size is checked against a stated limit and
// every error names the field, the limit and the value.
#include <algorithm>
#include <exception>
#include <set>
#include <string>

#include "core/io/json_guard.hpp"
#include "core/io/json_keys.hpp"
#include "k3/model.hpp"

namespace k3 {

namespace {

using detail::Json;
using detail::Keys;

// An optional integer: the default when absent or null.
Status opt_int(const Keys& k, int64_t* out, int64_t dflt, int64_t lo, int64_t hi, const char* key,
               const char* alt = nullptr) {
  const Json* v = k.find(key, alt);
  if (v == nullptr || v->is_null()) {
    *out = dflt;
    return Status::ok();
  }
  return k.get_int(out, lo, hi, key, alt);
}

Status multiple_of_32(const std::string& where, const char* key, int64_t v) {
  if (v % 32 != 0) {
    return unsupported(where + ": \"" + key + "\" = " + std::to_string(v) +
                       " must be a multiple of 32 (k3's MX blocks run along every projection's input)");
  }
  return Status::ok();
}

}  // namespace

const char* trunk_format_name(TrunkFormat f) { return f == TrunkFormat::kBf16 ? "bf16" : "mxfp8"; }

Result<TrunkFormat> parse_trunk_format(const std::string& s) {
  if (s == "mxfp8") return TrunkFormat::kMxfp8;
  if (s == "bf16") return TrunkFormat::kBf16;
  return invalid_argument("trunk format \"" + s + "\" is not one of: mxfp8, bf16");
}

Result<KimiLinearConfig> parse_kimi_linear_config(const std::string& text, const std::string& source) {
  if (detail::json_max_nesting(text) > detail::kMaxJsonDepth) {
    return invalid_argument(source + ": JSON nesting deeper than " + std::to_string(detail::kMaxJsonDepth));
  }
  Json root;
  try {
    root = Json::parse(text);
  } catch (const std::exception& e) {
    return invalid_argument(source + " is not valid JSON: " + e.what());
  }
  if (!root.is_object()) return invalid_argument(source + " must hold a JSON object");
  const Keys k(root, source);

  std::string model_type;
  if (const Json* v = k.find("model_type"); v != nullptr && v->is_string()) model_type = v->get<std::string>();
  std::string arch;
  if (const Json* v = k.find("architectures"); v != nullptr && v->is_array() && !v->empty() && (*v)[0].is_string()) {
    arch = (*v)[0].get<std::string>();
  }
  if (model_type == "kimi_k3" || arch.find("KimiK3") != std::string::npos || root.contains("text_config")) {
    return unsupported(source + ": a Kimi-K3 checkpoint (model_type \"" + model_type +
                       "\"): the runner does not run Kimi-K3 yet (its AttnRes, latent MoE, gated MLA and full-rank "
                       "KDA gate are not implemented); it runs Kimi-Linear (model_type \"kimi_linear\")");
  }
  if (model_type != "kimi_linear") {
    return unsupported(source + ": \"model_type\" = \"" + model_type +
                       "\" is not a model the runner knows (it runs \"kimi_linear\", transformers' "
                       "KimiLinearForCausalLM)");
  }

  KimiLinearConfig c;
  K3_RETURN_IF_ERROR(k.get_int(&c.vocab_size, 1, kModelMaxVocab, "vocab_size"));
  K3_RETURN_IF_ERROR(k.get_int(&c.hidden, 32, kModelMaxHidden, "hidden_size"));
  K3_RETURN_IF_ERROR(k.get_int(&c.layers, 1, kModelMaxLayers, "num_hidden_layers"));
  K3_RETURN_IF_ERROR(opt_int(k, &c.intermediate, 9216, 32, kModelMaxIntermediate, "intermediate_size"));
  K3_RETURN_IF_ERROR(opt_int(k, &c.moe_intermediate, 1024, 32, kModelMaxIntermediate, "moe_intermediate_size"));
  K3_RETURN_IF_ERROR(opt_int(k, &c.first_k_dense, 1, 0, c.layers, "first_k_dense_replace"));
  if (const Json* v = k.find("rms_norm_eps"); v != nullptr) {
    K3_RETURN_IF_ERROR(k.get_float_in(&c.rms_norm_eps, 0.0f, 1.0f, "rms_norm_eps"));
  }
  // MLA
  K3_RETURN_IF_ERROR(k.get_int(&c.mla_heads, 1, kModelMaxHeads, "num_attention_heads"));
  int64_t kv_heads = 0;
  K3_RETURN_IF_ERROR(opt_int(k, &kv_heads, c.mla_heads, 1, kModelMaxHeads, "num_key_value_heads"));
  if (kv_heads != c.mla_heads) {
    return unsupported(source + ": \"num_key_value_heads\" = " + std::to_string(kv_heads) +
                       " must equal \"num_attention_heads\" = " + std::to_string(c.mla_heads) +
                       " (MLA expands one latent to every head)");
  }
  K3_RETURN_IF_ERROR(opt_int(k, &c.q_lora_rank, 0, 0, kModelMaxHidden, "q_lora_rank"));
  K3_RETURN_IF_ERROR(opt_int(k, &c.kv_lora_rank, 512, 32, kModelMaxHidden, "kv_lora_rank"));
  K3_RETURN_IF_ERROR(opt_int(k, &c.qk_nope, 128, 1, kModelMaxHeadDim, "qk_nope_head_dim"));
  K3_RETURN_IF_ERROR(opt_int(k, &c.qk_rope, 64, 0, kModelMaxHeadDim, "qk_rope_head_dim"));
  K3_RETURN_IF_ERROR(opt_int(k, &c.v_head, 128, 1, kModelMaxHeadDim, "v_head_dim"));
  // MoE
  int64_t v64 = 0;
  K3_RETURN_IF_ERROR(opt_int(k, &v64, 256, 1, 4096, "num_experts", "num_local_experts"));
  c.num_experts = static_cast<int>(v64);
  K3_RETURN_IF_ERROR(opt_int(k, &v64, 8, 1, 32, "num_experts_per_token", "num_experts_per_tok"));
  c.top_k = static_cast<int>(v64);
  if (c.top_k > c.num_experts) {
    return invalid_argument(source + ": \"num_experts_per_token\" = " + std::to_string(c.top_k) +
                            " exceeds \"num_experts\" = " + std::to_string(c.num_experts));
  }
  K3_RETURN_IF_ERROR(opt_int(k, &v64, 1, 0, 64, "num_shared_experts", "n_shared_experts"));
  c.shared_experts = static_cast<int>(v64);
  K3_RETURN_IF_ERROR(opt_int(k, &v64, 1, 1, 4096, "num_expert_group", "n_group"));
  c.n_group = static_cast<int>(v64);
  K3_RETURN_IF_ERROR(opt_int(k, &v64, 1, 1, 4096, "topk_group"));
  c.topk_group = static_cast<int>(v64);
  if (const Json* v = k.find("moe_renormalize", "norm_topk_prob"); v != nullptr && !v->is_null()) {
    K3_RETURN_IF_ERROR(k.get_bool(&c.renormalize, "moe_renormalize", "norm_topk_prob"));
  }
  c.routed_scaling_factor = 2.446f;  // transformers' default
  if (const Json* v = k.find("routed_scaling_factor"); v != nullptr && !v->is_null()) {
    K3_RETURN_IF_ERROR(k.get_float_in(&c.routed_scaling_factor, 1e-6f, 1e6f, "routed_scaling_factor"));
  }
  if (const Json* v = k.find("tie_word_embeddings"); v != nullptr && !v->is_null()) {
    K3_RETURN_IF_ERROR(k.get_bool(&c.tie_word_embeddings, "tie_word_embeddings"));
  }
  if (const Json* v = k.find("eos_token_id"); v != nullptr && !v->is_null()) {
    const auto add = [&](const Json& e) -> Status {
      if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() >= c.vocab_size) {
        return invalid_argument(source + ": \"eos_token_id\" = " + detail::json_quote(e) + " must be an id in [0, " +
                                std::to_string(c.vocab_size) + ")");
      }
      c.eos_token_ids.push_back(static_cast<int32_t>(e.get<int64_t>()));
      return Status::ok();
    };
    if (v->is_array()) {
      for (const Json& e : *v) K3_RETURN_IF_ERROR(add(e));
    } else {
      K3_RETURN_IF_ERROR(add(*v));
    }
  }

  // KDA: linear_attn_config
  const Json* la = k.find("linear_attn_config");
  if (la == nullptr || !la->is_object()) {
    return invalid_argument(source + " lacks the object \"linear_attn_config\" (KDA heads, head_dim, "
                            "full_attn_layers)");
  }
  const Keys lk(*la, source + " \"linear_attn_config\"");
  K3_RETURN_IF_ERROR(lk.get_int(&c.kda_heads, 1, kModelMaxHeads, "num_heads"));
  K3_RETURN_IF_ERROR(lk.get_int(&c.kda_head_dim, 1, kModelMaxHeadDim, "head_dim"));
  K3_RETURN_IF_ERROR(opt_int(lk, &c.conv_width, 4, 2, 8, "short_conv_kernel_size"));
  c.layer_is_mla.assign(static_cast<size_t>(c.layers), false);
  const auto read_list = [&](const char* key, std::set<int64_t>* out) -> Status {
    const Json* v = lk.find(key);
    if (v == nullptr || v->is_null()) return Status::ok();
    if (!v->is_array()) return lk.mistyped(key, *v, "a list of 1-based layer numbers");
    for (const Json& e : *v) {
      if (!e.is_number_integer() || e.get<int64_t>() < 1 || e.get<int64_t>() > c.layers) {
        return invalid_argument(lk.where() + ": \"" + key + "\" holds " + detail::json_quote(e) +
                                ", not a 1-based layer number in [1, " + std::to_string(c.layers) + "]");
      }
      if (!out->insert(e.get<int64_t>()).second) {
        return invalid_argument(lk.where() + ": \"" + key + "\" names layer " + std::to_string(e.get<int64_t>()) +
                                " twice");
      }
    }
    return Status::ok();
  };
  // Layer types, with transformers' precedence: "layer_types", else both lists of
  // linear_attn_config (1-based), else every fourth layer after the first is MLA.
  const auto type_list = [&](const char* key, const char* a_name, const char* b_name, std::vector<bool>* out) -> Status {
    const Json* v = k.find(key);
    if (v == nullptr || v->is_null()) return Status::ok();
    if (!v->is_array() || static_cast<int64_t>(v->size()) != c.layers) {
      return k.mistyped(key, *v, ("a list of " + std::to_string(c.layers) + " strings (one per layer)").c_str());
    }
    out->assign(static_cast<size_t>(c.layers), false);
    for (size_t i = 0; i < v->size(); ++i) {
      const Json& e = (*v)[i];
      if (e.is_string() && e.get<std::string>() == a_name) {
        (*out)[i] = true;
      } else if (!(e.is_string() && e.get<std::string>() == b_name)) {
        return invalid_argument(source + ": \"" + key + "\"[" + std::to_string(i) + "] = " + detail::json_quote(e) +
                                " must be \"" + a_name + "\" or \"" + b_name + "\"");
      }
    }
    return Status::ok();
  };
  std::set<int64_t> full, kda;
  if (k.find("layer_types") != nullptr && !k.find("layer_types")->is_null()) {
    K3_RETURN_IF_ERROR(type_list("layer_types", "full_attention", "linear_attention", &c.layer_is_mla));
  } else if (lk.find("full_attn_layers") != nullptr && lk.find("kda_layers") != nullptr) {
    K3_RETURN_IF_ERROR(read_list("full_attn_layers", &full));
    K3_RETURN_IF_ERROR(read_list("kda_layers", &kda));
    for (int64_t l : full) {
      if (kda.count(l)) {
        return invalid_argument(lk.where() + ": layer " + std::to_string(l) +
                                " is in both \"full_attn_layers\" and \"kda_layers\"");
      }
      c.layer_is_mla[static_cast<size_t>(l - 1)] = true;
    }
    for (int64_t l = 1; l <= c.layers; ++l) {
      if (!full.count(l) && !kda.count(l)) {
        return invalid_argument(lk.where() + ": layer " + std::to_string(l) +
                                " is in neither \"full_attn_layers\" nor \"kda_layers\"");
      }
    }
  } else {
    for (int64_t i = 0; i < c.layers; ++i) c.layer_is_mla[static_cast<size_t>(i)] = i > 0 && i % 4 == 0;
  }
  c.layer_is_dense.assign(static_cast<size_t>(c.layers), false);
  if (k.find("mlp_layer_types") != nullptr && !k.find("mlp_layer_types")->is_null()) {
    K3_RETURN_IF_ERROR(type_list("mlp_layer_types", "dense", "sparse", &c.layer_is_dense));
  } else {
    for (int64_t i = 0; i < c.first_k_dense; ++i) c.layer_is_dense[static_cast<size_t>(i)] = true;
  }

  // The projections' input widths run through MX blocks of 32.
  K3_RETURN_IF_ERROR(multiple_of_32(source, "hidden_size", c.hidden));
  K3_RETURN_IF_ERROR(multiple_of_32(source, "linear_attn_config.head_dim", c.kda_head_dim));
  K3_RETURN_IF_ERROR(multiple_of_32(source, "intermediate_size", c.intermediate));
  K3_RETURN_IF_ERROR(multiple_of_32(source, "moe_intermediate_size", c.moe_intermediate));
  K3_RETURN_IF_ERROR(multiple_of_32(source, "kv_lora_rank", c.kv_lora_rank));
  if (c.q_lora_rank > 0) K3_RETURN_IF_ERROR(multiple_of_32(source, "q_lora_rank", c.q_lora_rank));
  if ((c.mla_heads * c.v_head) % 32 != 0) {
    return unsupported(source + ": num_attention_heads * v_head_dim = " + std::to_string(c.mla_heads * c.v_head) +
                       " must be a multiple of 32 (the MLA output projection's input)");
  }
  if (c.num_experts % c.n_group != 0 || c.topk_group > c.n_group) {
    return invalid_argument(source + ": \"num_expert_group\" = " + std::to_string(c.n_group) +
                            " must divide \"num_experts\" = " + std::to_string(c.num_experts) +
                            " and be >= \"topk_group\" = " + std::to_string(c.topk_group));
  }
  return c;
}

}  // namespace k3
