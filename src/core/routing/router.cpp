// The Kimi-K3 / DeepSeek-V3 router (k3/routing.hpp).
#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "k3/formats.hpp"
#include "k3/moe_ref.hpp"
#include "k3/portable_math.hpp"
#include "k3/routing.hpp"

namespace k3 {

// Built from IEEE operations only (k3/portable_math.hpp), so the CUDA router matches it bit for bit.
float router_sigmoid(float x) { return sigmoid_f32(x); }

namespace {

std::string num(int64_t v) { return std::to_string(v); }

// The ranking of docs/moe.md plus the NaN policy: a before b when a's key is larger, NaN keys
// last, equal keys by lower index. A total order, so any correct sort gives the same result.
struct Better {
  const float* key;
  bool operator()(int a, int b) const {
    const float ka = key[a], kb = key[b];
    const bool na = std::isnan(ka), nb = std::isnan(kb);
    if (na != nb) return nb;
    if (!na && ka != kb) return ka > kb;
    return a < b;
  }
};

// Routes one token. scratch: [E] choice, [E] candidate indices, [n_group] group scores / order.
void route_token(const RoutingConfig& cfg, const float* logits, std::span<const float> bias, int32_t* ids,
                 float* weights, std::vector<float>& s, std::vector<float>& choice, std::vector<int>& cand,
                 std::vector<float>& gscore, std::vector<int>& gorder) {
  const int e_count = cfg.num_experts;
  for (int e = 0; e < e_count; ++e) {
    s[e] = router_sigmoid(logits[e]);
    choice[e] = bias.empty() ? s[e] : s[e] + bias[e];
  }
  cand.clear();
  if (cfg.n_group > 1) {
    const int gsize = e_count / cfg.n_group;
    for (int g = 0; g < cfg.n_group; ++g) {
      // The two best non-NaN choices of the group (Better order).
      int best = -1, second = -1;
      for (int e = g * gsize; e < (g + 1) * gsize; ++e) {
        if (std::isnan(choice[e])) continue;
        if (best < 0 || Better{choice.data()}(e, best)) {
          second = best;
          best = e;
        } else if (second < 0 || Better{choice.data()}(e, second)) {
          second = e;
        }
      }
      gscore[g] = best < 0 ? NAN : (second < 0 ? choice[best] : choice[best] + choice[second]);
      gorder[g] = g;
    }
    std::sort(gorder.begin(), gorder.end(), Better{gscore.data()});
    for (int i = 0; i < cfg.topk_group; ++i) {
      const int g = gorder[i];
      if (std::isnan(gscore[g])) break;
      for (int e = g * gsize; e < (g + 1) * gsize; ++e) cand.push_back(e);
    }
  } else {
    cand.resize(e_count);
    std::iota(cand.begin(), cand.end(), 0);
  }
  // NaN choices are never selected.
  cand.erase(std::remove_if(cand.begin(), cand.end(), [&](int e) { return std::isnan(choice[e]); }), cand.end());
  const int take = std::min<int>(cfg.top_k, static_cast<int>(cand.size()));
  std::partial_sort(cand.begin(), cand.begin() + take, cand.end(), Better{choice.data()});
  float sum = 0.0f;
  for (int i = 0; i < take; ++i) sum += s[cand[i]];
  const float denom = sum + kRenormalizeEpsilon;
  for (int i = 0; i < cfg.top_k; ++i) {
    if (i >= take) {
      ids[i] = -1;
      weights[i] = 0.0f;
      continue;
    }
    ids[i] = cand[i];
    const float w = cfg.renormalize ? s[cand[i]] / denom : s[cand[i]];
    weights[i] = w * cfg.routed_scaling_factor;
  }
}

}  // namespace

Status validate_routing_config(const RoutingConfig& cfg) {
  if (cfg.num_experts < 1 || cfg.num_experts > kMaxRoutingExperts) {
    return invalid_argument("routing: num_experts = " + num(cfg.num_experts) + " must be in [1, 4096]");
  }
  if (cfg.top_k < 1 || cfg.top_k > kMaxTopK || cfg.top_k > cfg.num_experts) {
    return invalid_argument("routing: top_k = " + num(cfg.top_k) + " must be in [1, min(32, num_experts = " +
                            num(cfg.num_experts) + ")]");
  }
  if (cfg.n_group < 1 || cfg.num_experts % cfg.n_group != 0) {
    return invalid_argument("routing: n_group = " + num(cfg.n_group) + " must be >= 1 and divide num_experts = " +
                            num(cfg.num_experts));
  }
  if (cfg.topk_group < 1 || cfg.topk_group > cfg.n_group) {
    return invalid_argument("routing: topk_group = " + num(cfg.topk_group) + " must be in [1, n_group = " +
                            num(cfg.n_group) + "]");
  }
  const int64_t reachable = static_cast<int64_t>(cfg.topk_group) * (cfg.num_experts / cfg.n_group);
  if (reachable < cfg.top_k) {
    return invalid_argument("routing: topk_group = " + num(cfg.topk_group) + " groups of " +
                            num(cfg.num_experts / cfg.n_group) + " experts hold " + num(reachable) +
                            " experts, fewer than top_k = " + num(cfg.top_k));
  }
  if (!std::isfinite(cfg.routed_scaling_factor)) {
    return invalid_argument("routing: routed_scaling_factor = " + std::to_string(cfg.routed_scaling_factor) +
                            " must be finite");
  }
  return Status::ok();
}

Status route(const RoutingConfig& cfg, int64_t m, std::span<const float> logits, std::span<const float> bias,
             std::span<int32_t> ids, std::span<float> weights) {
  K3_RETURN_IF_ERROR(validate_routing_config(cfg));
  if (m < 0) return invalid_argument("routing: m = " + num(m) + " must be >= 0");
  const int64_t e = cfg.num_experts, k = cfg.top_k;
  auto need = [](const char* name, size_t have, int64_t want) {
    return static_cast<int64_t>(have) == want
               ? Status::ok()
               : invalid_argument(std::string("routing: ") + name + " has " + num(static_cast<int64_t>(have)) +
                                  " elements, expected " + num(want));
  };
  K3_RETURN_IF_ERROR(need("logits [M, E]", logits.size(), m * e));
  if (!bias.empty()) K3_RETURN_IF_ERROR(need("bias [E]", bias.size(), e));
  K3_RETURN_IF_ERROR(need("ids [M, top_k]", ids.size(), m * k));
  K3_RETURN_IF_ERROR(need("weights [M, top_k]", weights.size(), m * k));
#pragma omp parallel if (m * e >= 65536)
  {
    std::vector<float> s(e), choice(e), gscore(cfg.n_group);
    std::vector<int> cand, gorder(cfg.n_group);
    cand.reserve(e);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < m; ++t) {
      route_token(cfg, logits.data() + t * e, bias, ids.data() + t * k, weights.data() + t * k, s, choice, cand,
                  gscore, gorder);
    }
  }
  return Status::ok();
}

Status router_logits(int64_t m, int64_t hidden, int num_experts, std::span<const uint16_t> x,
                     std::span<const uint16_t> gate, std::span<float> logits) {
  if (m < 0 || hidden <= 0 || num_experts < 1) {
    return invalid_argument("router_logits: m = " + num(m) + ", hidden = " + num(hidden) + ", num_experts = " +
                            num(num_experts) + " must be >= 0, > 0, >= 1");
  }
  const int64_t e = num_experts;
  if (static_cast<int64_t>(x.size()) != m * hidden || static_cast<int64_t>(gate.size()) != e * hidden ||
      static_cast<int64_t>(logits.size()) != m * e) {
    return invalid_argument("router_logits: x has " + num(static_cast<int64_t>(x.size())) + " (expected M*hidden = " +
                            num(m * hidden) + "), gate " + num(static_cast<int64_t>(gate.size())) +
                            " (expected E*hidden = " + num(e * hidden) + "), logits " +
                            num(static_cast<int64_t>(logits.size())) + " (expected M*E = " + num(m * e) + ") elements");
  }
#pragma omp parallel for schedule(static) if (m * e * hidden >= (1 << 22))
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t j = 0; j < e; ++j) {
      double acc = 0;
      for (int64_t i = 0; i < hidden; ++i) {
        acc += static_cast<double>(bf16_to_f32(x[t * hidden + i])) * bf16_to_f32(gate[j * hidden + i]);
      }
      logits[t * e + j] = round_to_f32(acc);  // overflow -> +-Inf, never undefined behaviour
    }
  }
  return Status::ok();
}

}  // namespace k3
