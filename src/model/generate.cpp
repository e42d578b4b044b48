// The sampler and Model::generate (k3/model.hpp).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "k3/model.hpp"

namespace k3 {

Status Sampler::check(const SamplingOptions& o) {
  if (!(o.temperature >= 0.0f) || !std::isfinite(o.temperature)) {
    return invalid_argument("temperature = " + std::to_string(o.temperature) + " must be finite and >= 0 (0: greedy)");
  }
  if (o.top_k < 0) return invalid_argument("top_k = " + std::to_string(o.top_k) + " must be >= 0 (0: no cut)");
  if (!(o.top_p > 0.0f && o.top_p <= 1.0f)) {
    return invalid_argument("top_p = " + std::to_string(o.top_p) + " must be in (0, 1] (1: no cut)");
  }
  return Status::ok();
}

Sampler::Sampler(const SamplingOptions& o) : o_(o), rng_(o.seed) {}

Result<int32_t> Sampler::sample(std::span<const float> logits) {
  K3_RETURN_IF_ERROR(check(o_));
  const int64_t v = static_cast<int64_t>(logits.size());
  int64_t best = -1;
  for (int64_t i = 0; i < v; ++i) {
    if (std::isnan(logits[static_cast<size_t>(i)])) continue;
    if (best < 0 || logits[static_cast<size_t>(i)] > logits[static_cast<size_t>(best)]) best = i;
  }
  if (best < 0) return invalid_argument("logits: all " + std::to_string(v) + " values are NaN; nothing to sample");
  if (o_.temperature == 0.0f || o_.top_k == 1) return static_cast<int32_t>(best);
  // Candidates by logit (descending; equal logits: lower id first), then the cuts, then one draw.
  scratch_.clear();
  for (int64_t i = 0; i < v; ++i) {
    const float l = logits[static_cast<size_t>(i)];
    if (!std::isnan(l)) scratch_.emplace_back(l, static_cast<int32_t>(i));
  }
  const auto order = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  size_t keep = scratch_.size();
  if (o_.top_k > 0 && static_cast<size_t>(o_.top_k) < keep) {
    keep = static_cast<size_t>(o_.top_k);
    std::partial_sort(scratch_.begin(), scratch_.begin() + static_cast<std::ptrdiff_t>(keep), scratch_.end(), order);
  } else {
    std::sort(scratch_.begin(), scratch_.end(), order);
  }
  scratch_.resize(keep);
  const double top = scratch_[0].first, t = o_.temperature;
  std::vector<double> p(keep);
  double sum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    p[i] = std::exp((static_cast<double>(scratch_[i].first) - top) / t);
    sum += p[i];
  }
  if (o_.top_p < 1.0f) {
    double cum = 0.0;
    size_t n = 0;
    while (n < keep) {
      cum += p[n] / sum;
      ++n;
      if (cum >= static_cast<double>(o_.top_p)) break;
    }
    keep = n;
    sum = 0.0;
    for (size_t i = 0; i < keep; ++i) sum += p[i];
  }
  // A uniform draw in [0, 1) from the top 53 bits of one 64-bit output (fixed by the standard).
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53 * sum;
  double cum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    cum += p[i];
    if (u < cum) return scratch_[i].second;
  }
  return scratch_[keep - 1].second;
}

Result<std::vector<int32_t>> Model::generate(int slot, std::span<const int32_t> prompt, int64_t max_new_tokens,
                                             const SamplingOptions& sampling, std::span<const int32_t> stop_ids,
                                             GenerateTimings* timings) {
  K3_RETURN_IF_ERROR(Sampler::check(sampling));
  if (prompt.empty()) return invalid_argument("prompt: at least one token id is needed");
  if (max_new_tokens < 0) {
    return invalid_argument("max_new_tokens = " + std::to_string(max_new_tokens) + " must be >= 0");
  }
  // The last new token is never fed back, so the slot holds prompt + max_new_tokens - 1 tokens.
  const int64_t need = static_cast<int64_t>(prompt.size()) + std::max<int64_t>(max_new_tokens - 1, 0);
  if (need > info().max_context) {
    return out_of_range("prompt (" + std::to_string(prompt.size()) + " tokens) + max_new_tokens (" +
                        std::to_string(max_new_tokens) + ") needs " + std::to_string(need) +
                        " tokens of state; the pool holds max_context = " + std::to_string(info().max_context) +
                        " per sequence (ModelOptions::max_context, --max-context)");
  }
  K3_RETURN_IF_ERROR(reset(slot));
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t v = vocab_size();
  std::vector<float> logits(static_cast<size_t>(v));
  std::vector<int32_t> out;
  Sampler sampler(sampling);
  // Prefill in pieces that fit one call.
  const int64_t piece = std::max<int64_t>(1, info().max_batch_tokens);
  for (size_t at = 0; at < prompt.size(); at += static_cast<size_t>(piece)) {
    const size_t n = std::min(prompt.size() - at, static_cast<size_t>(piece));
    const int32_t s = slot;
    K3_RETURN_IF_ERROR(forward(prompt.subspan(at, n), {}, std::span<const int32_t>(&s, 1), false, logits));
  }
  const auto t1 = std::chrono::steady_clock::now();
  auto t2 = t1;
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    K3_ASSIGN_OR_RETURN(int32_t id, sampler.sample(logits));
    out.push_back(id);
    if (i == 0) t2 = std::chrono::steady_clock::now();
    if (std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end() || i + 1 == max_new_tokens) break;
    const int32_t s = slot;
    K3_RETURN_IF_ERROR(forward(std::span<const int32_t>(&id, 1), {}, std::span<const int32_t>(&s, 1), false, logits));
  }
  const auto t3 = std::chrono::steady_clock::now();
  if (timings != nullptr) {
    timings->prompt_tokens = static_cast<int64_t>(prompt.size());
    timings->new_tokens = static_cast<int64_t>(out.size());
    timings->prefill_seconds = std::chrono::duration<double>(t2 - t0).count();
    timings->decode_seconds = std::chrono::duration<double>(t3 - t2).count();
    (void)t1;
  }
  return out;
}

}  // namespace k3
