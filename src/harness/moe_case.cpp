// Seeded fused-MoE problems (k3/harness/moe_case.hpp). Every row of every tensor and every token has its
// own counter-based random stream (splitmix64 keyed by seed, tensor, global expert, row), so the
// OpenMP split cannot change a bit and a rank's expert e equals global expert first_local + e of
// the EP1 problem with the same seed.
#include "k3/harness/moe_case.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <new>
#include <string>

#include "k3/formats.hpp"
#include "k3/mx.hpp"

namespace k3 {

const char* routing_pattern_name(RoutingPattern r) {
  switch (r) {
    case RoutingPattern::kUniform: return "uniform";
    case RoutingPattern::kSkewed: return "skewed";
    case RoutingPattern::kEpMixed: return "ep_mixed";
    case RoutingPattern::kEmptyExpert: return "empty_expert";
    case RoutingPattern::kMasked: return "masked";
  }
  return "?";
}

MoeWeightsView MoeCase::weights() const { return {fc1_q, fc1_scale, fc2_q, fc2_scale, situ_beta, situ_linear_beta}; }
MoeInputsView MoeCase::inputs() const { return {m, x, topk_ids, topk_weights}; }

namespace {

struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  uint64_t below(uint64_t n) { return next() % n; }  // n is tiny next to 2^64: bias negligible
  double normal() {  // Box-Muller
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

uint64_t stream(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0) {
  Rng r{seed ^ 0x6B33u};
  r.s ^= r.next() + a;
  r.s ^= r.next() + b;
  r.s ^= r.next() + c;
  return r.next();
}

// byte -> E2M1 code: the 256 mid-quantiles of N(0, 2.5), rounded to E2M1 (RNE, saturating at 6).
std::array<uint8_t, 256> code_table() {
  std::array<uint8_t, 256> t{};
  for (int i = 0; i < 256; ++i) {
    const double p = (i + 0.5) / 256.0;
    double lo = -10, hi = 10;  // invert the normal CDF by bisection
    for (int it = 0; it < 60; ++it) {
      const double mid = 0.5 * (lo + hi);
      (0.5 * std::erfc(-mid / std::sqrt(2.0)) < p ? lo : hi) = mid;
    }
    t[i] = e2m1_from_f32(static_cast<float>(2.5 * 0.5 * (lo + hi)));
  }
  return t;
}

// Scale code whose power of two turns element-unit std 2.5 into the target std.
int base_scale_code(double target_std) { return 127 + static_cast<int>(std::lround(std::log2(target_std / 2.5))); }

// One MXFP4 tensor [E_local, rows, cols] of the rank; tensor_id separates FC1 / FC2 streams.
void fill_mxfp4(const MoeCaseSpec& spec, int tensor_id, int64_t rows, int64_t cols, int base, std::vector<uint8_t>& q,
                std::vector<uint8_t>& s) {
  static const std::array<uint8_t, 256> kCodes = code_table();
  const int64_t el = spec.problem.shape.local_experts(), first = spec.problem.shape.first_local_expert();
  q.assign(el * rows * cols / 2, 0);
  s.assign(el * rows * cols / kMxBlock, 0);
  const int64_t nblk = cols / kMxBlock;
#pragma omp parallel for schedule(static) if (el * rows * cols >= (1 << 20))
  for (int64_t er = 0; er < el * rows; ++er) {
    const int64_t e = er / rows, r = er % rows;
    Rng rng{stream(spec.seed, static_cast<uint64_t>(tensor_id), static_cast<uint64_t>(first + e), static_cast<uint64_t>(r))};
    uint8_t* qrow = q.data() + er * (cols / 2);
    for (int64_t i = 0; i < cols / 2; i += 4) {  // 8 random bytes -> 8 element codes
      const uint64_t bits = rng.next();
      for (int j = 0; j < 4; ++j) {
        qrow[i + j] = fp4_pack(kCodes[(bits >> (16 * j)) & 0xFF], kCodes[(bits >> (16 * j + 8)) & 0xFF]);
      }
    }
    for (int64_t b = 0; b < nblk; ++b) s[er * nblk + b] = static_cast<uint8_t>(base + static_cast<int>(rng.below(3)) - 1);
  }
}

// Picks `count` distinct values of `pool` (partial Fisher-Yates), appending to out.
void pick_distinct(Rng& rng, std::vector<int32_t>& pool, int count, std::vector<int32_t>& out) {
  for (int i = 0; i < count; ++i) {
    const size_t j = i + rng.below(pool.size() - i);
    std::swap(pool[i], pool[j]);
    out.push_back(pool[i]);
  }
}

Status check_spec(const MoeCaseSpec& spec) {
  K3_RETURN_IF_ERROR(validate_moe_shape(spec.problem.shape));
  const auto& sh = spec.problem.shape;
  if (spec.m < 0) return invalid_argument("moe case: m = " + std::to_string(spec.m) + " must be >= 0");
  if (spec.routing == RoutingPattern::kEpMixed) {
    const int el = sh.local_experts();
    if (spec.local_slots < 0 || spec.local_slots > sh.top_k || spec.local_slots > el ||
        sh.top_k - spec.local_slots > sh.num_experts - el) {
      return invalid_argument("moe case: local_slots = " + std::to_string(spec.local_slots) +
                              " must be in [0, top_k = " + std::to_string(sh.top_k) + "], at most E_local = " +
                              std::to_string(el) + ", with top_k - local_slots <= " +
                              std::to_string(sh.num_experts - el) + " remote experts");
    }
  }
  if (spec.routing == RoutingPattern::kEmptyExpert && sh.num_experts - 1 < sh.top_k) {
    return invalid_argument("moe case: empty_expert routing needs num_experts - 1 >= top_k = " +
                            std::to_string(sh.top_k));
  }
  if (spec.routing == RoutingPattern::kSkewed && !(spec.zipf_s > 0 && std::isfinite(spec.zipf_s))) {
    return invalid_argument("moe case: zipf_s = " + std::to_string(spec.zipf_s) + " must be finite and > 0");
  }
  return Status::ok();
}

void make_inputs(const MoeCaseSpec& spec, MoeCase& c) {
  const auto& sh = spec.problem.shape;
  const int64_t m = spec.m, k = sh.hidden;
  const int top_k = sh.top_k, e_n = sh.num_experts, el = sh.local_experts(), first = sh.first_local_expert();
  c.problem = spec.problem;
  c.m = m;
  c.x.assign(m * k, 0);
  c.topk_ids.assign(m * top_k, -1);
  c.topk_weights.assign(m * top_k, 0.f);
  std::vector<double> zipf_cdf;
  if (spec.routing == RoutingPattern::kSkewed) {
    double acc = 0;
    for (int r = 0; r < e_n; ++r) zipf_cdf.push_back(acc += std::pow(r + 1.0, -spec.zipf_s));
    for (double& v : zipf_cdf) v /= acc;
  }
  for (int64_t t = 0; t < m; ++t) {
    Rng xr{stream(spec.seed, 100, static_cast<uint64_t>(t))};
    for (int64_t i = 0; i < k; ++i) c.x[t * k + i] = bf16_from_f32(static_cast<float>(xr.normal()));
    Rng rr{stream(spec.seed, 200, static_cast<uint64_t>(t))};
    std::vector<int32_t> ids;
    std::vector<int32_t> pool;
    switch (spec.routing) {
      case RoutingPattern::kUniform:
      case RoutingPattern::kMasked:
      case RoutingPattern::kEmptyExpert: {
        const int32_t skip = spec.routing == RoutingPattern::kEmptyExpert ? first + el / 2 : -1;
        for (int32_t e = 0; e < e_n; ++e) {
          if (e != skip) pool.push_back(e);
        }
        pick_distinct(rr, pool, top_k, ids);
        break;
      }
      case RoutingPattern::kEpMixed: {
        for (int32_t e = first; e < first + el; ++e) pool.push_back(e);
        pick_distinct(rr, pool, spec.local_slots, ids);
        pool.clear();
        for (int32_t e = 0; e < e_n; ++e) {
          if (e < first || e >= first + el) pool.push_back(e);
        }
        pick_distinct(rr, pool, top_k - spec.local_slots, ids);
        for (int i = top_k - 1; i > 0; --i) std::swap(ids[i], ids[rr.below(i + 1)]);  // mix slot positions
        break;
      }
      case RoutingPattern::kSkewed: {
        std::vector<bool> used(e_n, false);
        while (static_cast<int>(ids.size()) < top_k) {
          int rank = static_cast<int>(std::lower_bound(zipf_cdf.begin(), zipf_cdf.end(), rr.uniform()) - zipf_cdf.begin());
          rank = std::min(rank, e_n - 1);
          for (int tries = 0; used[rank] && tries < e_n; ++tries) rank = (rank + 1) % e_n;  // next free rank
          used[rank] = true;
          ids.push_back((first + rank) % e_n);
        }
        break;
      }
    }
    double sum = 0;
    std::vector<double> w(top_k);
    for (int s = 0; s < top_k; ++s) sum += (w[s] = 0.1 + 0.9 * rr.uniform());
    for (int s = 0; s < top_k; ++s) {
      c.topk_ids[t * top_k + s] = ids[s];
      c.topk_weights[t * top_k + s] = static_cast<float>(w[s] / sum);
      // Masked slots keep a nonzero weight: a correct kernel ignores it.
      if (spec.routing == RoutingPattern::kMasked && (t == 0 || rr.below(4) == 0)) c.topk_ids[t * top_k + s] = -1;
    }
  }
}

}  // namespace

Status regenerate_inputs(const MoeCaseSpec& spec, MoeCase& c) {
  K3_RETURN_IF_ERROR(check_spec(spec));
  const auto &a = spec.problem.shape, &b = c.problem.shape;
  if (a.hidden != b.hidden || a.intermediate != b.intermediate || a.num_experts != b.num_experts ||
      a.top_k != b.top_k || a.ep_size != b.ep_size || a.ep_rank != b.ep_rank) {
    return invalid_argument("regenerate_inputs: the spec's shape differs from the case's shape");
  }
  try {
    make_inputs(spec, c);
  } catch (const std::bad_alloc&) {
    return unavailable("moe case: out of memory for M = " + std::to_string(spec.m));
  }
  return Status::ok();
}

Result<MoeCase> make_moe_case(const MoeCaseSpec& spec) {
  K3_RETURN_IF_ERROR(check_spec(spec));
  const auto& sh = spec.problem.shape;
  MoeCase c;
  try {
    fill_mxfp4(spec, 1, 2 * sh.intermediate, sh.hidden, base_scale_code(3.0 / std::sqrt(double(sh.hidden))), c.fc1_q,
               c.fc1_scale);
    fill_mxfp4(spec, 2, sh.hidden, sh.intermediate, base_scale_code(1.0 / std::sqrt(double(sh.intermediate))),
               c.fc2_q, c.fc2_scale);
    if (spec.situ_overrides) {
      for (int e = 0; e < sh.local_experts(); ++e) {
        Rng r{stream(spec.seed, 300, static_cast<uint64_t>(sh.first_local_expert() + e))};
        c.situ_beta.push_back(static_cast<float>(2.0 + 4.0 * r.uniform()));
        c.situ_linear_beta.push_back(static_cast<float>(15.0 + 20.0 * r.uniform()));
      }
    }
    make_inputs(spec, c);
  } catch (const std::bad_alloc&) {
    return unavailable("moe case: out of memory for E_local = " + std::to_string(sh.local_experts()) +
                       ", K = " + std::to_string(sh.hidden) + ", N = " + std::to_string(sh.intermediate));
  }
  return c;
}

}  // namespace k3
