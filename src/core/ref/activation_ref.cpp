// FP64 reference activations (k3/moe_ref.hpp) and the situ_and_mul reference.
#include <cmath>
#include <string>

#include "k3/moe_ref.hpp"

namespace k3 {

double sigmoid_ref(double v) { return 1.0 / (1.0 + std::exp(-v)); }

double situ_ref(double gate, double up, double beta, double linear_beta) {
  // tanh bounds both factors (|b tanh(g/b)| < b, |lb tanh(u/lb)| < lb), so |out| < b * lb = 100.
  return (beta * std::tanh(gate / beta) * sigmoid_ref(gate)) * (linear_beta * std::tanh(up / linear_beta));
}

double swiglu_ref(double gate, double up, double alpha, double beta, double limit) {
  // Comparisons written so that NaN falls through unchanged (std::min / fmin would return the limit).
  const double g = gate > limit ? limit : gate;
  const double u = up > limit ? limit : (up < -limit ? -limit : up);
  return g * sigmoid_ref(alpha * g) * (u + beta);
}

double silu_and_mul_ref(double gate, double up) { return gate * sigmoid_ref(gate) * up; }

double activation_ref(const Activation& a, double gate, double up, double situ_beta, double situ_linear_beta) {
  switch (a.kind) {
    case ActivationKind::kSiTU: return situ_ref(gate, up, situ_beta, situ_linear_beta);
    case ActivationKind::kSwiGLU: return swiglu_ref(gate, up, a.swiglu_alpha, a.swiglu_beta, a.swiglu_limit);
    case ActivationKind::kSiLU: return silu_and_mul_ref(gate, up);
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
