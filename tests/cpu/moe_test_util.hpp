// Shared helpers of the CPU MoE tests: seeded owning cases, the backend run, metrics.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "k3/cpu_moe.hpp"
#include "k3/formats.hpp"
#include "k3/moe_ref.hpp"

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

// Random MXFP4 codes with scale codes around 2^-5 (about unit-RMS GEMM outputs at these fan-ins),
// x ~ N(0, 1) in BF16, distinct ids over all E global experts (some remote on EP ranks), about
// one masked slot in seven.
inline MoeCase random_moe_case(int64_t k, int64_t n, int e, int top_k, int64_t m, int ep_size, int ep_rank,
                               uint64_t seed) {
  MoeCase c;
  c.p.shape = {k, n, e, top_k, ep_size, ep_rank};
  c.m = m;
  std::mt19937_64 rng(seed);
  const int64_t el = e / ep_size;
  auto fill_w = [&](std::vector<uint8_t>& q, std::vector<uint8_t>& s, int64_t rows, int64_t cols, int base) {
    q.resize(static_cast<size_t>(el * rows * cols / 2));
    s.resize(static_cast<size_t>(el * rows * cols / 32));
    for (auto& b : q) b = static_cast<uint8_t>(rng());
    for (auto& v : s) v = static_cast<uint8_t>(base + static_cast<int>(rng() % 3) - 1);
  };
  const int base1 = 127 - 1 - static_cast<int>(std::lround(std::log2(std::sqrt(static_cast<double>(k)) * 2.5)));
  const int base2 = 127 - 1 - static_cast<int>(std::lround(std::log2(std::sqrt(static_cast<double>(n)) * 2.5)));
  fill_w(c.f1q, c.f1s, 2 * n, k, base1 + 1);
  fill_w(c.f2q, c.f2s, k, n, base2 + 1);
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

// Runs the CPU backend; the output as bytes of the problem's out dtype.
inline Result<std::vector<uint8_t>> run_cpu(const MoeCase& c, cpu::MoeOptions opt = {}) {
  auto plan = cpu::plan(c.p, opt);
  if (!plan.is_ok()) return plan.status();
  auto packed = cpu::prepack(plan.value(), c.wv());
  if (!packed.is_ok()) return packed.status();
  std::vector<uint8_t> ws(static_cast<size_t>(plan->workspace_bytes));
  std::vector<uint8_t> out(static_cast<size_t>(c.m * c.p.shape.hidden * out_dtype_size(c.p.out_dtype)), 0xAB);
  const Status st = cpu::run(plan.value(), packed.value(), c.iv(), ws, out);
  if (!st.is_ok()) return st;
  return out;
}

inline std::vector<double> decode_output(const std::vector<uint8_t>& bytes, OutDType d) {
  const size_t es = static_cast<size_t>(out_dtype_size(d));
  std::vector<double> v(bytes.size() / es);
  for (size_t i = 0; i < v.size(); ++i) {
    if (d == OutDType::kFP32) {
      float f;
      std::memcpy(&f, &bytes[i * 4], 4);
      v[i] = f;
    } else {
      uint16_t h;
      std::memcpy(&h, &bytes[i * 2], 2);
      v[i] = d == OutDType::kBF16 ? bf16_to_f32(h) : fp16_to_f32(h);
    }
  }
  return v;
}

inline std::vector<double> contract_oracle(const MoeCase& c, OracleKind kind = OracleKind::kContract) {
  std::vector<double> out(static_cast<size_t>(c.m * c.p.shape.hidden), 0.0);
  const Status st = moe_oracle(c.p, c.wv(), c.iv(), kind, out);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return out;
}

struct Diff {
  double nrmse = 0, max_abs = 0, rms_ref = 0;
  int64_t nonfinite = 0;
};
inline Diff diff(const std::vector<double>& got, const std::vector<double>& ref) {
  Diff d;
  double se = 0, sr = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ++d.nonfinite;
      continue;
    }
    const double e = got[i] - ref[i];
    se += e * e;
    sr += ref[i] * ref[i];
    d.max_abs = std::max(d.max_abs, std::fabs(e));
  }
  d.rms_ref = std::sqrt(sr / static_cast<double>(got.size()));
  d.nrmse = sr > 0 ? std::sqrt(se / sr) : std::sqrt(se);
  return d;
}

}  // namespace k3::test
