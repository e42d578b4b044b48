// k3/checkpoint.hpp — Kimi-K3 (and DeepSeek-V3-style) MoE checkpoints: the model facts from
// config.json and one MoE layer's routed experts for one expert-parallel rank, loaded into the
// FC1 / FC2 tensors of k3/moe.hpp (docs/moe.md, "Checkpoint tensors").
//
// Tensor names (w1 = gate, w3 = up, w2 = down; MXFP4 codes packed two per byte, E8M0 scales):
//   {P}model.layers.{L}.block_sparse_moe.experts.{E}.w{1,2,3}.weight_packed   U8 [rows, cols/2]
//   {P}model.layers.{L}.block_sparse_moe.experts.{E}.w{1,2,3}.weight_scale    U8 [rows, cols/32]
//   {P}model.layers.{L}.block_sparse_moe.gate.weight                          BF16 [E, hidden_size]
//   {P}model.layers.{L}.block_sparse_moe.gate.e_score_correction_bias         BF16 or F32 [E]
// with P = "language_model." (Kimi-K3, a multimodal wrapper) or "" (text-only Kimi checkpoints);
// w1 / w3 are [N, K], w2 is [K, N] (K = routed_expert_hidden_size, N = moe_intermediate_size).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "k3/moe.hpp"
#include "k3/routing.hpp"
#include "k3/status.hpp"

namespace k3 {

// Accepted range of the SiTU betas read from config.json (activation_situ_beta and
// activation_situ_linear_beta; Kimi-K3 uses 4 and 25). beta * tanh(x / beta) is meaningless for a
// beta that overflows or underflows FP32, and values this far from 1 are a corrupt config: they
// are refused at load time, naming the key and the file.
inline constexpr float kMinSituBeta = 1e-3f;
inline constexpr float kMaxSituBeta = 1e6f;

// Model facts from config.json (Kimi-K3 spelling under "text_config", or DeepSeek-V3 spelling at top level).
struct MoeModelConfig {
  std::string model_type;            // "kimi_k3" / "deepseek_v3" / ...
  int64_t hidden_size = 0;           // 7168
  int64_t expert_hidden = 0;         // K: routed_expert_hidden_size (3584); hidden_size if absent in DeepSeek configs
  int64_t intermediate = 0;          // N: moe_intermediate_size (3072)
  int num_experts = 0;               // 896
  int top_k = 0;                     // 16
  int n_group = 1, topk_group = 1;
  bool renormalize = true;
  float routed_scaling_factor = 1.0f;
  std::string scoring_func;          // "sigmoid"
  std::string hidden_act;            // "situ" / "silu" / "swiglu"
  float situ_beta = 4.0f, situ_linear_beta = 25.0f;  // each in [kMinSituBeta, kMaxSituBeta]
  int num_hidden_layers = 0, first_k_dense_replace = 0;
  // quantization_config (empty when the config has none): quant_method "compressed-tensors",
  // format "mxfp4-pack-quantized", weight group size 32 (0 when not stated).
  std::string quant_method;
  std::string quant_format;
  int quant_group_size = 0;
  std::string source;                // the config.json path the facts came from
  std::string sha256;                // SHA-256 (hex) of the config.json bytes parsed: ranks compare it
  bool synthetic = false;            // written by `k3 checkpoint synth` (has a "k3_synthetic" object)
};

// Parses config.json text. `source` names the file in errors. A missing or mistyped key is an
// error naming the key (both spellings where two exist), the object it was looked up in and the file.
Result<MoeModelConfig> parse_model_config(const std::string& json_text, const std::string& source);
// Reads `checkpoint_dir`/config.json (a path to a .safetensors file reads the config next to it).
Result<MoeModelConfig> load_model_config(const std::string& checkpoint_dir);  // missing key -> error naming it

// The MoeShape of `cfg` on EP rank `ep_rank` of `ep_size`, validated (validate_moe_shape).
Result<MoeShape> moe_shape_from_config(const MoeModelConfig& cfg, int ep_size, int ep_rank);

// Checkpoint tensor names with the Kimi-K3 prefix "language_model.". proj is 1 (gate), 2 (down) or 3 (up).
std::string kimi_expert_tensor_name(int layer, int expert, int proj, bool scale, const std::string& prefix = "language_model.");
std::string kimi_router_weight_name(int layer, const std::string& prefix = "language_model.");
std::string kimi_router_bias_name(int layer, const std::string& prefix = "language_model.");

// A Kimi MoE tensor name taken apart: the inverse of the three functions above, for any prefix.
// Grammar: <prefix>model.layers.{L}.block_sparse_moe. followed by experts.{E}.w{1,2,3}.weight_packed,
// experts.{E}.w{1,2,3}.weight_scale, gate.weight or gate.e_score_correction_bias; L and E are
// decimal without sign, below 2^24. Anything else (another tensor of the model, a malformed or
// truncated name) is std::nullopt. One parser for the loader and `k3 checkpoint inspect`.
struct KimiMoeTensor {
  enum class Kind : uint8_t { kExpert, kRouterWeight, kRouterBias };
  Kind kind = Kind::kExpert;
  std::string prefix;  // what precedes "model.layers.", e.g. "language_model." or ""
  int layer = 0;
  int expert = -1;     // kExpert only
  int proj = 0;        // kExpert only: 1 gate, 2 down, 3 up
  bool scale = false;  // kExpert only: weight_scale (else weight_packed)
};
std::optional<KimiMoeTensor> parse_kimi_moe_tensor_name(std::string_view name);

// One MoE layer's routed experts for one EP rank, in the layout of k3/moe.hpp (FC1 = [gate; up]).
struct MoeLayerWeights {
  MoeShape shape;                    // hidden = K, intermediate = N, num_experts, top_k, ep_size, ep_rank
  std::vector<uint8_t> fc1_q;        // [E_local, 2N, K/2]
  std::vector<uint8_t> fc1_scale;    // [E_local, 2N, K/32]
  std::vector<uint8_t> fc2_q;        // [E_local, K, N/2]
  std::vector<uint8_t> fc2_scale;    // [E_local, K, N/32]
  std::vector<uint16_t> router_weight;  // [E, hidden_size] BF16 bits (empty if the checkpoint lacks it)
  std::vector<float> router_bias;       // [E] e_score_correction_bias as FP32 (empty if absent)
  MoeModelConfig config;             // the facts the layer was loaded with
  int layer = 0;
  MoeWeightsView view() const;
};

// Loads layer `layer` for EP rank `ep_rank` of `ep_size` (global experts [r*E_local, (r+1)*E_local)).
// Errors: the layer is dense or out of range; experts the rank needs are missing (all named, as
// ranges, with the experts the checkpoint does hold for that layer); a tensor with the wrong
// dtype or shape (each named with what was expected); a quantization format other than MXFP4.
Result<MoeLayerWeights> load_moe_layer(const std::string& checkpoint_dir, int layer, int ep_size, int ep_rank);
// The same with the checkpoint's config already read (load_model_config(checkpoint_dir)), for a
// caller that checked its own arguments against it first: config.json is read once.
Result<MoeLayerWeights> load_moe_layer(const MoeModelConfig& config, const std::string& checkpoint_dir, int layer,
                                       int ep_size, int ep_rank);

// ---- config.json -> what the backends take ---------------------------------------------------
// Activation from hidden_act ("situ" with the config's betas, "swiglu", "silu"); anything else is
// an UNSUPPORTED error naming the value and the config file.
Result<Activation> activation_from_config(const MoeModelConfig& c);
// The router's facts, for callers that route logits. scoring_func must be "sigmoid" (the only
// scoring k3's router implements): anything else is an UNSUPPORTED error naming the value, the
// config file and that reason; an invalid combination (validate_routing_config) names the file.
// Inputs that bring topk_ids / topk_weights are not routed and need none of it.
Result<RoutingConfig> routing_from_config(const MoeModelConfig& c);
// The fused-MoE problem of a loaded layer under a recipe and output dtype (shape from the layer,
// activation from its config), validated.
Result<MoeProblem> moe_problem_from_layer(const MoeLayerWeights& l, Recipe recipe, OutDType out_dtype);
// The same for inputs that bring their own number of slots per token (a topk_ids file may hold
// any top_k in [1, 32], not the config's): shape.top_k = top_k, validated (the error names top_k).
Result<MoeProblem> moe_problem_from_layer(const MoeLayerWeights& l, Recipe recipe, OutDType out_dtype, int top_k);

// "3, 7-9, 12" for a sorted list of ids; after `max_ranges` ranges "... (N more)".
std::string format_id_ranges(const std::vector<int>& sorted_ids, int max_ranges = 12);

}  // namespace k3
