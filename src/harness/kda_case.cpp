// Generated KDA problems: normal q, k, v; decays spread over [-5, -0.0025] so that both long and
// short memories occur; optional hard resets (g = -1000).
#include "k3/harness/kda_case.hpp"

#include <cmath>
#include <random>

#include "k3/formats.hpp"

namespace k3::kda {

KdaCase make_case(const CaseSpec& spec) {
  KdaCase c;
  c.spec = spec;
  const KdaConfig& cfg = spec.cfg;
  const int64_t H = cfg.num_heads, K = cfg.head_k, V = cfg.head_v;
  for (int64_t l : spec.seqlens) c.num_tokens += l;
  c.num_seqs = static_cast<int64_t>(spec.seqlens.size());
  const int64_t T = c.num_tokens;
  std::mt19937_64 rng(spec.seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  auto fill_act = [&](std::vector<uint16_t>& b, std::vector<float>& f, int64_t n) {
    if (spec.bf16) {
      b.resize(static_cast<size_t>(n));
      for (auto& x : b) x = bf16_from_f32(nd(rng));
    } else {
      f.resize(static_cast<size_t>(n));
      for (auto& x : f) x = nd(rng);
    }
  };
  fill_act(c.q16, c.q32, T * H * K);
  fill_act(c.k16, c.k32, T * H * K);
  fill_act(c.v16, c.v32, T * H * V);
  c.g.resize(static_cast<size_t>(T * H * K));
  if (cfg.gate == GateMode::kLogDecay) {
    for (auto& x : c.g) x = -std::exp(-6.0f + 7.6f * ud(rng));  // [-5, -0.0025]
  } else {
    for (auto& x : c.g) x = 0.5f * nd(rng);
    c.a_log.resize(static_cast<size_t>(H));
    for (auto& x : c.a_log) x = -2.0f + 3.0f * ud(rng);
    c.dt_bias.resize(static_cast<size_t>(H * K));
    for (auto& x : c.dt_bias) x = 0.5f * nd(rng);
  }
  for (int64_t t : spec.resets) {
    // In the gated modes a huge negative gate input drives the decay to its floor instead.
    const float reset = cfg.gate == GateMode::kLogDecay ? -1000.0f : (cfg.gate == GateMode::kSafe ? 1000.0f : 1.0e6f);
    for (int64_t i = 0; i < H * K; ++i) c.g[static_cast<size_t>(t * H * K + i)] = reset;
  }
  c.beta.resize(static_cast<size_t>(T * H));
  for (auto& x : c.beta) x = nd(rng);
  if (c.num_seqs > 1 || spec.varlen) {
    c.cu_seqlens.push_back(0);
    for (int64_t l : spec.seqlens) c.cu_seqlens.push_back(c.cu_seqlens.back() + l);
  }
  if (spec.initial_state) {
    c.initial_state.resize(static_cast<size_t>(c.state_size()));
    for (auto& x : c.initial_state) x = 0.3f * nd(rng);
  }
  return c;
}

KdaInputs KdaCase::inputs() const {
  KdaInputs in;
  in.q = spec.bf16 ? ActSpan::of(std::span<const uint16_t>(q16)) : ActSpan::of(std::span<const float>(q32));
  in.k = spec.bf16 ? ActSpan::of(std::span<const uint16_t>(k16)) : ActSpan::of(std::span<const float>(k32));
  in.v = spec.bf16 ? ActSpan::of(std::span<const uint16_t>(v16)) : ActSpan::of(std::span<const float>(v32));
  in.g = g;
  in.beta = beta;
  in.a_log = a_log;
  in.dt_bias = dt_bias;
  in.cu_seqlens = cu_seqlens;
  in.initial_state = initial_state;
  return in;
}

namespace {
template <typename R>
ErrorStats compare_impl(std::span<const float> out, std::span<const R> ref) {
  ErrorStats s;
  double e2 = 0, r2 = 0, o2 = 0, dot = 0;
  const size_t n = std::min(out.size(), ref.size());
  for (size_t i = 0; i < n; ++i) {
    const double o = out[i], r = static_cast<double>(ref[i]), e = o - r;
    e2 += e * e;
    r2 += r * r;
    o2 += o * o;
    dot += o * r;
    const double ae = std::fabs(e);
    if (!(ae <= s.max_abs)) s.max_abs = ae;  // NaN sticks
  }
  if (out.size() != ref.size()) s.max_abs = NAN;
  s.err_ratio = r2 > 0 ? std::sqrt(e2 / r2) : std::sqrt(e2);
  s.cosine = (r2 > 0 && o2 > 0) ? dot / std::sqrt(r2 * o2) : (e2 == 0 ? 1.0 : 0.0);
  return s;
}
}  // namespace

ErrorStats compare(std::span<const float> out, std::span<const double> ref) { return compare_impl<double>(out, ref); }
ErrorStats compare(std::span<const float> out, std::span<const float> ref) { return compare_impl<float>(out, ref); }

}  // namespace k3::kda
