// RMSNorm of rows (k3/norm.hpp): one C++ body, FP32 arithmetic in a fixed order.
#include "k3/norm.hpp"

#include <cmath>
#include <string>

#include "k3/formats.hpp"
#include "k3/system.hpp"

namespace k3 {
namespace {

float widen(float v) { return v; }
float widen(uint16_t v) { return bf16_to_f32(v); }
template <typename T>
T narrow(float v);
template <>
float narrow<float>(float v) { return v; }
template <>
uint16_t narrow<uint16_t>(float v) { return bf16_from_f32(v); }

template <typename T>
Status validate(const RmsNormArgs<T>& a, int64_t* rows) {
  if (a.dim < 1) return invalid_argument("rms_norm: dim = " + std::to_string(a.dim) + " must be >= 1");
  if (!(a.eps >= 0.0f) || !std::isfinite(a.eps)) {
    return invalid_argument("rms_norm: eps = " + std::to_string(a.eps) + " must be finite and >= 0");
  }
  const auto n = static_cast<int64_t>(a.x.size());
  if (n % a.dim != 0) {
    return invalid_argument("rms_norm: x has " + std::to_string(n) + " values, not a multiple of dim = " +
                            std::to_string(a.dim));
  }
  if (static_cast<int64_t>(a.weight.size()) != a.dim) {
    return invalid_argument("rms_norm: weight has " + std::to_string(a.weight.size()) + " values, dim = " +
                            std::to_string(a.dim));
  }
  if (static_cast<int64_t>(a.y.size()) != n) {
    return invalid_argument("rms_norm: y has " + std::to_string(a.y.size()) + " values, x has " +
                            std::to_string(n));
  }
  *rows = n / a.dim;
  return Status::ok();
}

constexpr int kLanes = 16;

// 1 / sqrt(S / D + eps), S summed in the 16-lane order of k3/norm.hpp.
template <typename T>
float inv_rms(const T* x, int64_t D, float eps) {
  float part[kLanes] = {};
  const int64_t full = D / kLanes * kLanes;
  for (int64_t j = 0; j < full; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = widen(x[j + l]);
      part[l] = part[l] + v * v;
    }
  }
  for (int64_t j = full; j < D; ++j) {
    const float v = widen(x[j]);
    part[j - full] = part[j - full] + v * v;
  }
  for (int half = kLanes / 2; half >= 1; half /= 2) {
    for (int l = 0; l < half; ++l) part[l] = part[l] + part[l + half];
  }
  return 1.0f / std::sqrt(part[0] / static_cast<float>(D) + eps);
}

template <typename T>
void row(const T* x, const T* w, T* y, int64_t D, float eps) {
  const float r = inv_rms(x, D, eps);
  for (int64_t j = 0; j < D; ++j) {
    const float h = widen(narrow<T>(widen(x[j]) * r));
    y[j] = narrow<T>(widen(w[j]) * h);
  }
}

template <typename T>
void gated_row(const T* x, const T* g, const T* w, T* y, int64_t D, float eps) {
  const float r = inv_rms(x, D, eps);
  for (int64_t j = 0; j < D; ++j) {
    const float s = 1.0f / (1.0f + std::exp(-widen(g[j])));
    y[j] = narrow<T>((widen(w[j]) * (widen(x[j]) * r)) * s);
  }
}

// Rows [0, rows) split between threads (one row: no fork); f(r) does row r.
template <typename F>
Status over_rows(int64_t rows, int threads, F f) {
  K3_RETURN_IF_ERROR(check_thread_count(threads, "rms_norm: threads"));
  const int nt = threads > 0 ? threads : hardware_thread_count();
#pragma omp parallel for schedule(static) num_threads(nt) if (rows > 1 && nt > 1)
  for (int64_t r = 0; r < rows; ++r) f(r);
  return Status::ok();
}

// The oracles' 1 / sqrt(mean(x^2) + eps) of one row, in FP64.
template <typename T>
double inv_rms_fp64(const T* x, int64_t D, float eps) {
  double s = 0.0;
  for (int64_t j = 0; j < D; ++j) s += static_cast<double>(widen(x[j])) * widen(x[j]);
  return 1.0 / std::sqrt(s / static_cast<double>(D) + static_cast<double>(eps));
}

template <typename T>
Status run(const RmsNormArgs<T>& a, int threads) {
  int64_t rows = 0;
  K3_RETURN_IF_ERROR(validate(a, &rows));
  const int64_t D = a.dim;
  return over_rows(rows, threads, [&](int64_t r) {
    row(a.x.data() + r * D, a.weight.data(), a.y.data() + r * D, D, a.eps);
  });
}

template <typename T>
Status oracle(const RmsNormArgs<T>& a) {
  int64_t rows = 0;
  K3_RETURN_IF_ERROR(validate(a, &rows));
  const int64_t D = a.dim;
  for (int64_t r = 0; r < rows; ++r) {
    const double inv = inv_rms_fp64(a.x.data() + r * D, D, a.eps);
    for (int64_t j = 0; j < D; ++j) {
      const float h = widen(narrow<T>(static_cast<float>(widen(a.x[r * D + j]) * inv)));
      a.y[r * D + j] = narrow<T>(static_cast<float>(static_cast<double>(widen(a.weight[j])) * h));
    }
  }
  return Status::ok();
}

template <typename T>
Status validate_gated(const GatedRmsNormRowsArgs<T>& a, int64_t* rows) {
  K3_RETURN_IF_ERROR(validate(RmsNormArgs<T>{a.dim, a.eps, a.x, a.weight, a.y}, rows));
  if (a.gate.size() != a.x.size()) {
    return invalid_argument("rms_norm: gate has " + std::to_string(a.gate.size()) + " values, x has " +
                            std::to_string(a.x.size()));
  }
  return Status::ok();
}

template <typename T>
Status run_gated(const GatedRmsNormRowsArgs<T>& a, int threads) {
  int64_t rows = 0;
  K3_RETURN_IF_ERROR(validate_gated(a, &rows));
  const int64_t D = a.dim;
  return over_rows(rows, threads, [&](int64_t r) {
    gated_row(a.x.data() + r * D, a.gate.data() + r * D, a.weight.data(), a.y.data() + r * D, D, a.eps);
  });
}

template <typename T>
Status oracle_gated(const GatedRmsNormRowsArgs<T>& a) {
  int64_t rows = 0;
  K3_RETURN_IF_ERROR(validate_gated(a, &rows));
  const int64_t D = a.dim;
  for (int64_t r = 0; r < rows; ++r) {
    const double inv = inv_rms_fp64(a.x.data() + r * D, D, a.eps);
    for (int64_t j = 0; j < D; ++j) {
      const double sg = 1.0 / (1.0 + std::exp(-static_cast<double>(widen(a.gate[r * D + j]))));
      a.y[r * D + j] = narrow<T>(static_cast<float>(widen(a.weight[j]) * (widen(a.x[r * D + j]) * inv) * sg));
    }
  }
  return Status::ok();
}

}  // namespace

Status rms_norm_gated(const GatedRmsNormRowsArgs<uint16_t>& a, int threads) { return run_gated(a, threads); }
Status rms_norm_gated(const GatedRmsNormRowsArgs<float>& a, int threads) { return run_gated(a, threads); }
Status rms_norm_gated_oracle(const GatedRmsNormRowsArgs<uint16_t>& a) { return oracle_gated(a); }
Status rms_norm_gated_oracle(const GatedRmsNormRowsArgs<float>& a) { return oracle_gated(a); }
Status rms_norm(const RmsNormArgs<uint16_t>& a, int threads) { return run(a, threads); }
Status rms_norm(const RmsNormArgs<float>& a, int threads) { return run(a, threads); }
Status rms_norm_oracle(const RmsNormArgs<uint16_t>& a) { return oracle(a); }
Status rms_norm_oracle(const RmsNormArgs<float>& a) { return oracle(a); }

}  // namespace k3
