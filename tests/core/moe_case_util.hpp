// The owning, seeded fused-MoE case of the backend and oracle unit tests: random MXFP4 codes
// (every E2M1 code, scale codes jittered by one binade), x ~ N(0, 1) in BF16, distinct random ids
// with about one masked slot in seven. The validation matrix's structured cases (routing patterns,
// SiTU overrides) are k3::make_moe_case (k3/harness/moe_case.hpp); these small ones stay here because unit
// tests poke at their fields (a NaN weight, hand-set ids) before running.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "k3/formats.hpp"
#include "k3/moe.hpp"

namespace k3::test {

struct MoeCase {
  MoeProblem p;
  int64_t m = 0;
  std::vector<uint8_t> f1q, f1s, f2q, f2s;  // [E_local, 2N, K/2], [E_local, 2N, K/32], [E_local, K, N/2], [E_local, K, N/32]
  std::vector<float> betas, lbetas;          // [E_local] or empty
  std::vector<uint16_t> x;                   // [M, K] BF16
  std::vector<int32_t> ids;                  // [M, top_k]
  std::vector<float> wts;                    // [M, top_k]
  MoeWeightsView wv() const { return {f1q, f1s, f2q, f2s, betas, lbetas}; }
  MoeInputsView iv() const { return {m, x, ids, wts}; }
};

// Random MXFP4 codes with scale codes around 2^-5 (about unit-RMS GEMM outputs at these fan-ins;
// scale_base != 0: codes scale_base - 1 .. scale_base + 1 for both matrices instead),
// x ~ N(0, 1) in BF16, distinct ids over all E global experts (some remote on EP ranks), about
// one masked slot in seven.
inline MoeCase random_moe_case(int64_t k, int64_t n, int e, int top_k, int64_t m, int ep_size, int ep_rank,
                               uint64_t seed, int scale_base = 0) {
  MoeCase c;
  c.p.shape = {k, n, e, top_k, ep_size, ep_rank};
  c.m = m;
  std::mt19937_64 rng(seed);
  const int64_t el = c.p.shape.local_experts();
  auto fill_w = [&](std::vector<uint8_t>& q, std::vector<uint8_t>& s, int64_t rows, int64_t cols, int base) {
    q.resize(static_cast<size_t>(el * rows * cols / 2));
    s.resize(static_cast<size_t>(el * rows * cols / 32));
    for (auto& b : q) b = static_cast<uint8_t>(rng());
    for (auto& v : s) v = static_cast<uint8_t>(base + static_cast<int>(rng() % 3) - 1);
  };
  const int base1 = 127 - 1 - static_cast<int>(std::lround(std::log2(std::sqrt(static_cast<double>(k)) * 2.5)));
  const int base2 = 127 - 1 - static_cast<int>(std::lround(std::log2(std::sqrt(static_cast<double>(n)) * 2.5)));
  fill_w(c.f1q, c.f1s, 2 * n, k, scale_base != 0 ? scale_base : base1 + 1);
  fill_w(c.f2q, c.f2s, k, n, scale_base != 0 ? scale_base : base2 + 1);
  std::normal_distribution<float> nd(0.f, 1.f);
  c.x.resize(static_cast<size_t>(m * k));
  for (auto& v : c.x) v = bf16_from_f32(nd(rng));
  c.ids.resize(static_cast<size_t>(m * top_k));
  c.wts.resize(static_cast<size_t>(m * top_k));
  std::vector<int32_t> perm(static_cast<size_t>(e));
  for (int64_t t = 0; t < m; ++t) {
    for (int i = 0; i < e; ++i) perm[static_cast<size_t>(i)] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int s = 0; s < top_k; ++s) {
      c.ids[static_cast<size_t>(t * top_k + s)] = (rng() % 7 == 0) ? -1 : perm[static_cast<size_t>(s)];
      c.wts[static_cast<size_t>(t * top_k + s)] = 0.05f + static_cast<float>(rng() % 1000) / 1000.f;
    }
  }
  return c;
}

}  // namespace k3::test
