#include "validate_moe_checkpoint.hpp"

#include <cmath>
#include <cstdio>

#include "k3/checkpoint.hpp"
#include "k3/expert_map.hpp"
#include "k3/formats.hpp"
#include "k3/routing.hpp"
#include "k3/harness/ep_flags.hpp"

namespace k3::harness {
namespace {

ValidateRow fail_row(const std::string& name, const std::string& why) {
  // (Aggregate initialization: assigning a literal to a member string trips GCC 12's -Wrestrict.)
  return ValidateRow{"moe", name, std::string("-"), 1.0, 0.0, 0.0, "", false, why, false};
}

// Routed inputs for M tokens: x (the expert input, K wide) ~ N(0, 1) in BF16; ids / weights from
// the checkpoint's router applied to a random unit-RMS hidden state (hidden_size wide) when the
// checkpoint holds the router, else from seeded uniform routing.
Status routed_inputs(const MoeLayerWeights& l, const RoutingConfig& rc, int64_t m, uint64_t seed, MoeCase& c) {
  MoeCaseSpec spec;
  spec.problem = c.problem;
  spec.m = m;
  spec.seed = seed;
  K3_RETURN_IF_ERROR(regenerate_inputs(spec, c));
  if (l.router_weight.empty()) return Status::ok();
  const int64_t hs = l.config.hidden_size;
  MoeCaseSpec hspec;  // a hidden state drawn the same way as x, hidden_size wide
  hspec.problem.shape = {hs, 32, 1, 1, 1, 0};
  hspec.m = m;
  hspec.seed = seed ^ 0x5eed;
  MoeCase h;
  h.problem = hspec.problem;
  K3_RETURN_IF_ERROR(regenerate_inputs(hspec, h));
  std::vector<float> logits(m * rc.num_experts);
  K3_RETURN_IF_ERROR(router_logits(m, hs, rc.num_experts, h.x, l.router_weight, logits));
  return route(rc, m, logits, l.router_bias, c.topk_ids, c.topk_weights);
}

}  // namespace

void validate_on_checkpoint(const ValidateOptions& o, const std::vector<Recipe>& recipes, const MoeCheckFn& check,
                            std::vector<ValidateRow>& rows) {
  const std::string tag = "ckpt L" + std::to_string(o.layer) + " ep" + std::to_string(o.ep_size) + "r" +
                          std::to_string(o.ep_rank);
  if (const Status ep = check_ep_flags(o.ep_size, o.ep_rank, o.checkpoint); !ep.is_ok()) {
    rows.push_back(fail_row(tag + " flags", ep.to_string()));
    return;
  }
  auto layer = load_moe_layer(o.checkpoint, o.layer, o.ep_size, o.ep_rank);
  if (!layer.is_ok()) {
    rows.push_back(fail_row(tag + " load", layer.status().to_string()));
    return;
  }
  MoeLayerWeights& l = layer.value();
  auto rc = routing_from_config(l.config);
  auto prob = moe_problem_from_layer(l, Recipe::kW4A8, OutDType::kBF16);
  if (!rc.is_ok() || !prob.is_ok()) {
    rows.push_back(fail_row(tag + " config", (rc.is_ok() ? prob.status() : rc.status()).to_string()));
    return;
  }
  if (!o.activation.empty() && o.activation != activation_name(prob->activation.kind)) {
    rows.push_back(fail_row(tag + " activation", "--activation " + o.activation + " differs from the checkpoint's hidden_act '" +
                                                     l.config.hidden_act + "' (" + l.config.source + ")"));
    return;
  }
  MoeCase c;
  c.problem = prob.value();
  c.fc1_q = std::move(l.fc1_q);
  c.fc1_scale = std::move(l.fc1_scale);
  c.fc2_q = std::move(l.fc2_q);
  c.fc2_scale = std::move(l.fc2_scale);
  std::vector<int64_t> ms;
  if (o.suite == "smoke") ms = {1, 8};
  else if (o.suite == "real") ms = {1, 128};
  else ms = {1, 8, 128};
  for (int64_t m : ms) {
    const Status st = routed_inputs(l, rc.value(), m, o.seed + static_cast<uint64_t>(m), c);
    if (!st.is_ok()) {
      rows.push_back(fail_row(tag + " m" + std::to_string(m) + " inputs", st.to_string()));
      continue;
    }
    // The number of this rank's slots goes into the name: with real routing a small M may hold none
    // (then the output is all zeros and the row only checks that).
    auto map = map_expert_parallel(c.problem.shape, c.m, c.topk_ids);
    const std::string name = tag + " m" + std::to_string(m) + (l.router_weight.empty() ? " uniform" : " routed") +
                             " loc" + std::to_string(map.is_ok() ? map->local_slots : -1);
    for (Recipe r : recipes) {
      c.problem.recipe = r;
      o.report("moe: " + name + " " + recipe_name(r));
      check(name, c, true);
    }
  }
}

}  // namespace k3::harness
