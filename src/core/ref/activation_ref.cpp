// FP64 reference activations (k3/moe_ref.hpp) and the situ_and_mul reference.
#include <cmath>
#include <string>

#include "k3/activation.hpp"
#include "k3/moe_ref.hpp"

namespace k3 {

namespace {
// The oracle's math: the C++ library in FP64.
struct StdMath {
  static double exp(double x) { return std::exp(x); }
  static double tanh(double x) { return std::tanh(x); }
};
}  // namespace

double sigmoid_ref(double v) { return act::sigmoid<StdMath>(v); }

// tanh bounds both SiTU factors (|b tanh(g/b)| < b, |lb tanh(u/lb)| < lb), so |out| < b * lb = 100.
double situ_ref(double gate, double up, double beta, double linear_beta) {
  return act::situ<StdMath>(gate, up, beta, linear_beta);
}

double swiglu_ref(double gate, double up, double alpha, double beta, double limit) {
  return act::swiglu<StdMath>(gate, up, alpha, beta, limit);
}

double silu_and_mul_ref(double gate, double up) { return act::silu_mul<StdMath>(gate, up); }

double activation_ref(const Activation& a, double gate, double up, double situ_beta, double situ_linear_beta) {
  switch (a.kind) {
    case ActivationKind::kSiTU:
    case ActivationKind::kSwiGLU:
    case ActivationKind::kSiLU:
      return act::gated<StdMath>(a.kind, gate, up, situ_beta, situ_linear_beta, static_cast<double>(a.swiglu_alpha),
                                 static_cast<double>(a.swiglu_beta), static_cast<double>(a.swiglu_limit));
  }
  return std::nan("");
}

namespace {
Status check_situ_betas(double b, double lb, const std::string& where) {
  if (!std::isfinite(b) || b <= 0) {
    return invalid_argument(where + "situ beta = " + std::to_string(b) + " must be finite and > 0");
  }
  if (!std::isfinite(lb) || lb <= 0) {
    return invalid_argument(where + "situ linear beta = " + std::to_string(lb) + " must be finite and > 0");
  }
  return Status::ok();
}
}  // namespace

Status validate_activation(const Activation& a) {
  K3_RETURN_IF_ERROR(check_situ_betas(a.situ_beta, a.situ_linear_beta, "activation: "));
  if (!std::isfinite(a.swiglu_alpha) || !std::isfinite(a.swiglu_beta)) {
    return invalid_argument("activation: swiglu alpha = " + std::to_string(a.swiglu_alpha) +
                            " and beta = " + std::to_string(a.swiglu_beta) + " must be finite");
  }
  if (!std::isfinite(a.swiglu_limit) || a.swiglu_limit < 0) {
    return invalid_argument("activation: swiglu limit = " + std::to_string(a.swiglu_limit) +
                            " must be finite and >= 0");
  }
  return Status::ok();
}

Status situ_and_mul_ref(std::span<const float> in, int64_t rows, int64_t d, int64_t ld, float beta,
                        float linear_beta, std::span<float> out) {
  K3_RETURN_IF_ERROR(check_situ_betas(beta, linear_beta, "situ_and_mul_ref: "));
  if (rows < 0) return invalid_argument("situ_and_mul_ref: rows = " + std::to_string(rows) + " must be >= 0");
  if (d <= 0) return invalid_argument("situ_and_mul_ref: d = " + std::to_string(d) + " must be > 0");
  if (ld < 2 * d) {
    return invalid_argument("situ_and_mul_ref: ld = " + std::to_string(ld) + " must be >= 2*d = " +
                            std::to_string(2 * d));
  }
  const int64_t need_in = rows == 0 ? 0 : (rows - 1) * ld + 2 * d;
  if (static_cast<int64_t>(in.size()) < need_in) {
    return invalid_argument("situ_and_mul_ref: in holds " + std::to_string(in.size()) + " elements, needs " +
                            std::to_string(need_in) + " ((rows-1)*ld + 2*d)");
  }
  if (static_cast<int64_t>(out.size()) != rows * d) {
    return invalid_argument("situ_and_mul_ref: out holds " + std::to_string(out.size()) +
                            " elements, expected rows*d = " + std::to_string(rows * d));
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < d; ++j) {
      out[r * d + j] = round_to_f32(situ_ref(in[r * ld + j], in[r * ld + d + j], beta, linear_beta));
    }
  }
  return Status::ok();
}

}  // namespace k3
