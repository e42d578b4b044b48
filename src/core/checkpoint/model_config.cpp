// config.json -> MoeModelConfig (k3/checkpoint.hpp). Kimi-K3 keeps the text model's facts in
// "text_config"; DeepSeek-V3-style configs keep them at the top level under other names.
#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/io/json_guard.hpp"
#include "core/io/json_keys.hpp"
#include "k3/harness/atomic_file.hpp"
#include "k3/checkpoint.hpp"
#include "k3/harness/digest.hpp"
#include "k3/safetensors.hpp"

namespace k3 {

namespace {

using Json = nlohmann::json;
constexpr uintmax_t kMaxConfigBytes = 16u << 20;

using detail::Keys;

constexpr int64_t kMaxDim = int64_t{1} << 24;

// compressed-tensors: {"quant_method", "format", "config_groups": {"group_0": {"weights": {"group_size": 32}}}}
Status parse_quantization(const Json& q, const std::string& where, MoeModelConfig* cfg) {
  if (!q.is_object()) return invalid_argument(where + ": \"quantization_config\" must be an object");
  if (auto it = q.find("quant_method"); it != q.end() && it->is_string()) cfg->quant_method = it->get<std::string>();
  if (auto it = q.find("format"); it != q.end() && it->is_string()) cfg->quant_format = it->get<std::string>();
  if (auto groups = q.find("config_groups"); groups != q.end() && groups->is_object()) {
    for (const auto& [name, g] : groups->items()) {
      if (!g.is_object()) continue;
      auto w = g.find("weights");
      if (w == g.end() || !w->is_object()) continue;
      auto gs = w->find("group_size");
      if (gs != w->end() && gs->is_number_integer() && gs->get<int64_t>() > 0 && gs->get<int64_t>() < (1 << 20)) {
        cfg->quant_group_size = static_cast<int>(gs->get<int64_t>());
      }
    }
  }
  return Status::ok();
}

Result<MoeModelConfig> parse_impl(const std::string& json_text, const std::string& source) {
  if (const int depth = detail::json_max_nesting(json_text); depth > detail::kMaxJsonDepth) {
    return invalid_argument(source + ": JSON nests " + std::to_string(depth) + " levels deep (limit " +
                            std::to_string(detail::kMaxJsonDepth) + ")");
  }
  Json root;
  detail::StrictJsonError err;
  if (!detail::parse_strict_json(json_text, /*only_spaces=*/false, /*base=*/0, &root, &err)) {
    return invalid_argument(source + ": " + err.message);
  }
  if (!root.is_object()) return invalid_argument(source + ": must be a JSON object");

  MoeModelConfig cfg;
  cfg.source = source;
  cfg.synthetic = root.contains("k3_synthetic");
  const Keys top(root, source);
  K3_RETURN_IF_ERROR(top.get_string(&cfg.model_type, "model_type"));
  const auto tc = root.find("text_config");
  const bool nested = tc != root.end();
  if (nested && !tc->is_object()) return invalid_argument(source + ": \"text_config\" must be an object");
  const Json& text = nested ? *tc : root;
  const Keys k(text, nested ? source + ": text_config" : source);

  K3_RETURN_IF_ERROR(k.get_int(&cfg.hidden_size, 1, kMaxDim, "hidden_size"));
  K3_RETURN_IF_ERROR(k.get_int(&cfg.intermediate, 1, kMaxDim, "moe_intermediate_size"));
  // Latent MoE (Kimi-K3): experts run on routed_expert_hidden_size; without it they run on hidden_size.
  if (k.find("routed_expert_hidden_size") != nullptr || cfg.model_type == "kimi_k3") {
    K3_RETURN_IF_ERROR(k.get_int(&cfg.expert_hidden, 1, kMaxDim, "routed_expert_hidden_size"));
  } else {
    cfg.expert_hidden = cfg.hidden_size;
  }
  K3_RETURN_IF_ERROR(k.get_int(&cfg.num_experts, 1, 1 << 20, "num_experts", "n_routed_experts"));
  K3_RETURN_IF_ERROR(k.get_int(&cfg.top_k, 1, 1 << 20, "num_experts_per_token", "num_experts_per_tok"));
  K3_RETURN_IF_ERROR(k.get_int(&cfg.n_group, 1, 1 << 20, "num_expert_group", "n_group"));
  K3_RETURN_IF_ERROR(k.get_int(&cfg.topk_group, 1, 1 << 20, "topk_group"));
  K3_RETURN_IF_ERROR(k.get_bool(&cfg.renormalize, "moe_renormalize", "norm_topk_prob"));
  K3_RETURN_IF_ERROR(k.get_float(&cfg.routed_scaling_factor, "routed_scaling_factor"));
  K3_RETURN_IF_ERROR(k.get_string(&cfg.scoring_func, "moe_router_activation_func", "scoring_func"));
  K3_RETURN_IF_ERROR(k.get_string(&cfg.hidden_act, "hidden_act"));
  if (cfg.hidden_act == "situ") {
    K3_RETURN_IF_ERROR(k.get_float_in(&cfg.situ_beta, kMinSituBeta, kMaxSituBeta, "activation_situ_beta"));
    K3_RETURN_IF_ERROR(
        k.get_float_in(&cfg.situ_linear_beta, kMinSituBeta, kMaxSituBeta, "activation_situ_linear_beta"));
  }
  K3_RETURN_IF_ERROR(k.get_int(&cfg.num_hidden_layers, 1, 1 << 20, "num_hidden_layers"));
  K3_RETURN_IF_ERROR(k.get_int(&cfg.first_k_dense_replace, 0, 1 << 20, "first_k_dense_replace"));

  if (cfg.top_k > cfg.num_experts) {
    return invalid_argument(k.where() + ": top-k = " + std::to_string(cfg.top_k) + " exceeds the " +
                            std::to_string(cfg.num_experts) + " experts");
  }
  if (cfg.num_experts % cfg.n_group != 0 || cfg.topk_group > cfg.n_group) {
    return invalid_argument(k.where() + ": expert groups n_group = " + std::to_string(cfg.n_group) +
                            ", topk_group = " + std::to_string(cfg.topk_group) + " must satisfy n_group | " +
                            std::to_string(cfg.num_experts) + " experts and topk_group <= n_group");
  }
  if (cfg.first_k_dense_replace > cfg.num_hidden_layers) {
    return invalid_argument(k.where() + ": first_k_dense_replace = " + std::to_string(cfg.first_k_dense_replace) +
                            " exceeds num_hidden_layers = " + std::to_string(cfg.num_hidden_layers));
  }
  if (cfg.scoring_func != "sigmoid" && cfg.scoring_func != "softmax") {
    return invalid_argument(k.where() + ": router scoring function '" + st::printable_name(cfg.scoring_func) +
                            "' is not supported (expected sigmoid or softmax)");
  }
  // quantization_config sits next to the text facts (Kimi-K3) or at the top level.
  if (auto q = text.find("quantization_config"); q != text.end()) {
    K3_RETURN_IF_ERROR(parse_quantization(*q, k.where(), &cfg));
  } else if (auto q2 = root.find("quantization_config"); q2 != root.end()) {
    K3_RETURN_IF_ERROR(parse_quantization(*q2, source, &cfg));
  }
  return cfg;
}

}  // namespace

Result<MoeModelConfig> parse_model_config(const std::string& json_text, const std::string& source) {
  try {
    auto cfg = parse_impl(json_text, source);
    if (cfg.is_ok()) {
      cfg.value().sha256 = sha256_hex({reinterpret_cast<const uint8_t*>(json_text.data()), json_text.size()});
    }
    return cfg;
  } catch (const std::exception& e) {  // std::bad_alloc; parsing itself reports errors as values
    return invalid_argument(source + ": cannot parse: " + e.what());
  }
}

Result<MoeModelConfig> load_model_config(const std::string& checkpoint_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path dir(checkpoint_dir);
  if (fs::is_regular_file(dir, ec)) dir = dir.has_parent_path() ? dir.parent_path() : fs::path(".");
  const fs::path path = dir / "config.json";
  const std::string ps = path.string();
  if (struct stat st {}; ::stat(ps.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {  // never open a FIFO
    return io_error(ps + ": is " + std::string(file_kind_name(st.st_mode)) + ", not a regular file");
  }
  const auto size = fs::file_size(path, ec);
  if (ec) return io_error(ps + ": cannot read (" + ec.message() + "); the model facts come from the checkpoint's config.json");
  if (size > kMaxConfigBytes) {
    return io_error(ps + ": " + std::to_string(size) + " bytes exceeds the limit of " + std::to_string(kMaxConfigBytes));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return io_error(ps + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_model_config(ss.str(), ps);
}

Result<MoeShape> moe_shape_from_config(const MoeModelConfig& cfg, int ep_size, int ep_rank) {
  MoeShape s;
  s.hidden = cfg.expert_hidden;
  s.intermediate = cfg.intermediate;
  s.num_experts = cfg.num_experts;
  s.top_k = cfg.top_k;
  s.ep_size = ep_size;
  s.ep_rank = ep_rank;
  if (Status st = validate_moe_shape(s); !st.is_ok()) {
    return Status(st.code(), cfg.source + ": " + st.message());
  }
  return s;
}

}  // namespace k3
