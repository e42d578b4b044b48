// config.json facts -> the activation, router configuration and fused-MoE problem of a layer
// (k3/checkpoint.hpp).
#include <string>

#include "k3/checkpoint.hpp"
#include "k3/safetensors.hpp"

namespace k3 {

Result<Activation> activation_from_config(const MoeModelConfig& c) {
  auto kind = parse_activation(c.hidden_act);
  if (!kind.is_ok()) {
    return unsupported(c.source + ": hidden_act '" + st::printable_name(c.hidden_act) +
                       "' is not a fused-MoE activation of k3 (situ, swiglu, silu)");
  }
  Activation a;
  a.kind = kind.value();
  a.situ_beta = c.situ_beta;
  a.situ_linear_beta = c.situ_linear_beta;
  return a;
}

Result<RoutingConfig> routing_from_config(const MoeModelConfig& c) {
  if (c.scoring_func != "sigmoid") {
    return unsupported(c.source + ": scoring_func = '" + st::printable_name(c.scoring_func) +
                       "' cannot be routed by k3: its router implements only scoring_func = 'sigmoid' (sigmoid "
                       "scores + e_score_correction_bias, Kimi-K3 / DeepSeek-V3 style); an input with "
                       "'topk_ids' + 'topk_weights' instead of 'logits' needs no routing");
  }
  RoutingConfig r;
  r.num_experts = c.num_experts;
  r.top_k = c.top_k;
  r.n_group = c.n_group;
  r.topk_group = c.topk_group;
  r.renormalize = c.renormalize;
  r.routed_scaling_factor = c.routed_scaling_factor;
  const Status st = validate_routing_config(r);
  if (!st.is_ok()) return invalid_argument(c.source + ": " + st.message());
  return r;
}

Result<MoeProblem> moe_problem_from_layer(const MoeLayerWeights& l, Recipe recipe, OutDType out_dtype) {
  K3_ASSIGN_OR_RETURN(const Activation act, activation_from_config(l.config));
  MoeProblem p;
  p.shape = l.shape;
  p.recipe = recipe;
  p.activation = act;
  p.out_dtype = out_dtype;
  K3_RETURN_IF_ERROR(validate_moe_shape(p.shape));
  return p;
}

Result<MoeProblem> moe_problem_from_layer(const MoeLayerWeights& l, Recipe recipe, OutDType out_dtype, int top_k) {
  MoeLayerWeights shape_only;  // the layer's facts without copying its weights
  shape_only.shape = l.shape;
  shape_only.shape.top_k = top_k;
  shape_only.config = l.config;
  auto p = moe_problem_from_layer(shape_only, recipe, out_dtype);
  if (!p.is_ok()) {
    return Status(p.status().code(), "top_k = " + std::to_string(top_k) + " (slots per token of the inputs): " +
                                         p.status().message());
  }
  return p;
}

}  // namespace k3
