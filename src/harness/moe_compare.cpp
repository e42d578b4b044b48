#include "k3/harness/moe_compare.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "k3/formats.hpp"
#include "k3/moe_ref.hpp"

namespace k3 {

namespace {

double load(std::span<const uint8_t> out, OutDType d, size_t i) {
  if (d == OutDType::kFP32) {
    uint32_t u = 0;
    for (int b = 0; b < 4; ++b) u |= static_cast<uint32_t>(out[4 * i + b]) << (8 * b);
    return bits_to_f32(u);
  }
  const auto h = static_cast<uint16_t>(out[2 * i] | (out[2 * i + 1] << 8));
  return d == OutDType::kBF16 ? bf16_to_f32(h) : fp16_to_f32(h);
}

int klass(double v) { return std::isnan(v) ? 1 : (std::isinf(v) ? (v > 0 ? 2 : 3) : 0); }

}  // namespace

std::string MoeMetrics::summary() const {
  char buf[160];
  std::snprintf(buf, sizeof buf, "exact %.1f%%, nonfinite %lld", total ? 100.0 * static_cast<double>(exact) / static_cast<double>(total) : 100.0,
                static_cast<long long>(nonfinite));
  std::string s = buf;
  if (rows_beyond_fp32 > 0) {
    s += ", " + std::to_string(rows_beyond_fp32) + (rows_beyond_fp32 == 1 ? " row" : " rows") +
         " beyond FP32 range not compared";
  }
  return s;
}

Result<MoeMetrics> compare_moe_output(std::span<const uint8_t> out, OutDType dtype, std::span<const double> ref,
                                      const std::vector<bool>& zero_rows, const std::vector<bool>& rows_beyond_fp32) {
  MoeMetrics m;
  const int size = out_dtype_size(dtype);
  if (out.size() != ref.size() * static_cast<size_t>(size)) {
    return invalid_argument("compare_moe_output: out has " + std::to_string(out.size()) + " bytes, expected " +
                            std::to_string(ref.size()) + " values x " + std::to_string(size) + " bytes");
  }
  if (!zero_rows.empty() && ref.size() % zero_rows.size() != 0) {
    return invalid_argument("compare_moe_output: " + std::to_string(ref.size()) + " values do not split into " +
                            std::to_string(zero_rows.size()) + " rows");
  }
  if (!rows_beyond_fp32.empty() && ref.size() % rows_beyond_fp32.size() != 0) {
    return invalid_argument("compare_moe_output: " + std::to_string(ref.size()) + " values do not split into " +
                            std::to_string(rows_beyond_fp32.size()) + " rows (rows_beyond_fp32)");
  }
  std::vector<uint8_t> rounded(ref.size() * size);
  round_output(ref, dtype, rounded);
  const size_t k = zero_rows.empty() ? 0 : ref.size() / zero_rows.size();
  const size_t kb = rows_beyond_fp32.empty() ? 0 : ref.size() / rows_beyond_fp32.size();
  for (bool b : rows_beyond_fp32) m.rows_beyond_fp32 += b;
  double dot = 0, oo = 0, rr = 0, ee = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (kb != 0 && rows_beyond_fp32[i / kb]) continue;
    ++m.total;
    const double o = load(out, dtype, i), r = ref[i], rq = load(rounded, dtype, i);
    bool same = true;
    for (int b = 0; b < size; ++b) same = same && out[i * size + b] == rounded[i * size + b];
    m.exact += same;
    m.nonfinite += !std::isfinite(o);
    if (klass(o) != klass(rq)) ++m.nonfinite_mismatch;
    if (k != 0 && zero_rows[i / k]) {
      bool zero = true;
      for (int b = 0; b < size; ++b) zero = zero && out[i * size + b] == 0;
      m.zero_row_violations += !zero;
    }
    if (!std::isfinite(o) || !std::isfinite(r)) continue;
    dot += o * r;
    oo += o * o;
    rr += r * r;
    ee += (o - r) * (o - r);
    m.max_abs = std::max(m.max_abs, std::fabs(o - r));
    m.ref_max = std::max(m.ref_max, std::fabs(r));
  }
  m.cosine = (oo == 0 && rr == 0) ? 1.0 : (oo == 0 || rr == 0 ? 0.0 : dot / std::sqrt(oo * rr));
  m.nrmse = rr == 0 ? (ee == 0 ? 0.0 : INFINITY) : std::sqrt(ee / rr);
  return m;
}

MoeTolerance contract_tolerance(OutDType d) {
  switch (d) {
    case OutDType::kBF16: return {"contract-bf16", 5e-3, 0x1p-6, 0.99999};
    case OutDType::kFP16: return {"contract-fp16", 2e-3, 0x1p-8, 0.99999};
    case OutDType::kFP32: return {"contract-fp32", 2e-3, 0x1p-8, 0.99999};
  }
  return {"?", 0, 0, 1};
}

MoeTolerance seed_tolerance(Recipe r) {
  return r == Recipe::kW4A8 ? MoeTolerance{"seed-w4a8", 0.10, 1.0, 0.99} : MoeTolerance{"seed-w4a16", 0.02, 1.0, 0.999};
}

bool within(const MoeMetrics& m, const MoeTolerance& t, std::string* why) {
  char buf[200] = "";
  bool ok = false;
  if (m.nonfinite_mismatch) {
    std::snprintf(buf, sizeof buf, "%lld outputs differ from the oracle in NaN/Inf class",
                  static_cast<long long>(m.nonfinite_mismatch));
  } else if (m.zero_row_violations) {
    std::snprintf(buf, sizeof buf, "%lld outputs of rows without a local slot are not +0.0",
                  static_cast<long long>(m.zero_row_violations));
  } else if (!(m.nrmse <= t.max_nrmse)) {
    std::snprintf(buf, sizeof buf, "nrmse %.3e > %.1e", m.nrmse, t.max_nrmse);
  } else if (!(m.max_abs <= t.max_abs_rel * m.ref_max)) {
    std::snprintf(buf, sizeof buf, "max abs %.3e > %.3e (%g x max|ref|)", m.max_abs, t.max_abs_rel * m.ref_max,
                  t.max_abs_rel);
  } else if (!(m.cosine >= t.min_cosine)) {
    std::snprintf(buf, sizeof buf, "cosine %.6f < %.6f", m.cosine, t.min_cosine);
  } else {
    ok = true;
  }
  if (why) *why = ok ? std::string(t.name) : std::string(t.name) + ": " + buf;
  return ok;
}

std::vector<bool> rows_without_local_slot(const MoeShape& shape, const MoeInputsView& in) {
  std::vector<bool> zero(std::max<int64_t>(in.m, 0), true);
  if (!validate_moe_shape(shape).is_ok()) return zero;  // no valid rank layout: nothing is local
  const int first = shape.first_local_expert(), el = shape.local_experts();
  // Bounded by the ids actually present (validate_moe_buffers checks their count elsewhere).
  const int64_t n = std::min<int64_t>(in.m * shape.top_k, static_cast<int64_t>(in.topk_ids.size()));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = in.topk_ids[i];
    if (id >= first && id < first + el) zero[i / shape.top_k] = false;
  }
  return zero;
}

}  // namespace k3
