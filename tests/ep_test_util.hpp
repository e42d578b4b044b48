// Expert-parallel test problems: one full layer (all experts, ep_size 1) generated once, sliced
// into the experts of each EP rank, with the tokens split over the ranks. Every rank builds the
// same full case from the seed, so it knows the single-process output (the oracle of the
// distributed run) without communication.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "k3/backend.hpp"
#include "k3/cpu_moe.hpp"
#include "k3/harness/moe_case.hpp"

namespace k3test {

// The cpu backend's prepared layer through the registry (what the expert-parallel driver takes).
inline k3::Result<std::unique_ptr<k3::PreparedMoe>> prepare_cpu(const k3::MoeProblem& p, const k3::MoeWeightsView& w,
                                                                int threads, std::optional<k3::IsaLevel> isa = {},
                                                                int64_t max_tokens = 0) {
  auto cpu = k3::find_moe_backend("cpu");
  if (!cpu.is_ok()) return cpu.status();
  k3::BackendOptions o;
  o.threads = threads;
  o.isa = isa;
  o.max_tokens = max_tokens;
  return k3::prepare_moe(*cpu.value(), p, w, o);
}

enum class EpTokens { kUneven, kAllOnRankZero };
enum class EpRouting { kFromCase, kFirstExpertsOnly };

struct EpFullCase {
  k3::MoeCase c;                   // ep_size 1: all experts, all tokens
  std::vector<int64_t> token_off;  // [W + 1] rank r owns tokens [token_off[r], token_off[r+1])
};

inline EpFullCase make_ep_full_case(k3::Recipe recipe, k3::OutDType out, k3::RoutingPattern routing, int64_t m,
                                   int world, EpTokens tokens, EpRouting ids, uint64_t seed) {
  k3::MoeCaseSpec spec;
  spec.problem.shape = {64, 64, 32, 4, 1, 0};
  spec.problem.recipe = recipe;
  spec.problem.out_dtype = out;
  spec.m = m;
  spec.routing = routing;
  spec.seed = seed;
  auto r = k3::make_moe_case(spec);
  EpFullCase f{std::move(r).value(), {}};
  if (ids == EpRouting::kFirstExpertsOnly) {  // experts 0..3 only: at W >= 8 only rank 0 computes
    for (int64_t t = 0; t < m; ++t) {
      for (int s = 0; s < 4; ++s) f.c.topk_ids[static_cast<size_t>(t * 4 + s)] = static_cast<int32_t>((t + s) % 4);
    }
  }
  f.token_off.assign(static_cast<size_t>(world) + 1, 0);
  for (int q = 0; q < world; ++q) {
    int64_t n = 0;
    if (tokens == EpTokens::kAllOnRankZero) {
      n = q == 0 ? m : 0;
    } else {  // uneven: rank q gets a share growing with q, the last rank the rest; rank 1 none
      n = q == 1 ? 0 : std::min<int64_t>(m - f.token_off[static_cast<size_t>(q)], (q + 1) * m / (2 * world) + 1);
      if (q == world - 1) n = m - f.token_off[static_cast<size_t>(q)];
    }
    f.token_off[static_cast<size_t>(q) + 1] = f.token_off[static_cast<size_t>(q)] + n;
  }
  return f;
}

// The experts of rank r of W, as a view into the full case's arrays.
inline k3::MoeWeightsView slice_experts(const k3::MoeCase& full, int world, int rank) {
  const k3::MoeShape& s = full.problem.shape;
  const k3::ExpertRange own = k3::expert_range(s.num_experts, world, rank);
  const size_t el = static_cast<size_t>(own.count), e0 = static_cast<size_t>(own.first);
  const size_t k = static_cast<size_t>(s.hidden), n = static_cast<size_t>(s.intermediate);
  auto part = [&](const std::vector<uint8_t>& v, size_t per_expert) {
    return std::span<const uint8_t>(v.data() + e0 * per_expert, el * per_expert);
  };
  k3::MoeWeightsView w;
  w.fc1_q = part(full.fc1_q, 2 * n * k / 2);
  w.fc1_scale = part(full.fc1_scale, 2 * n * k / 32);
  w.fc2_q = part(full.fc2_q, k * n / 2);
  w.fc2_scale = part(full.fc2_scale, k * n / 32);
  return w;
}

// Rank r's tokens of the full case.
inline k3::MoeInputsView rank_tokens(const EpFullCase& f, int rank) {
  const int64_t k = f.c.problem.shape.hidden, topk = f.c.problem.shape.top_k;
  const int64_t t0 = f.token_off[static_cast<size_t>(rank)], n = f.token_off[static_cast<size_t>(rank) + 1] - t0;
  return {n, std::span<const uint16_t>(f.c.x.data() + t0 * k, static_cast<size_t>(n * k)),
          std::span<const int32_t>(f.c.topk_ids.data() + t0 * topk, static_cast<size_t>(n * topk)),
          std::span<const float>(f.c.topk_weights.data() + t0 * topk, static_cast<size_t>(n * topk))};
}

// Single-process output of the whole layer (the oracle): [M, K] in the output dtype; a status on failure.
inline k3::Result<std::vector<uint8_t>> run_full_layer(const k3::MoeCase& c, const k3::cpu::MoeOptions& opt) {
  K3_ASSIGN_OR_RETURN(auto plan, k3::cpu::plan(c.problem, opt));
  K3_ASSIGN_OR_RETURN(auto packed, k3::cpu::prepack(plan, c.weights()));
  std::vector<uint8_t> ws(static_cast<size_t>(plan.workspace_bytes));
  std::vector<uint8_t> out(static_cast<size_t>(c.m * c.problem.shape.hidden * k3::out_dtype_size(c.problem.out_dtype)));
  K3_RETURN_IF_ERROR(k3::cpu::run(plan, packed, c.inputs(), ws, out));
  return out;
}

}  // namespace k3test
