// FP64 references of the small KDA ops and the checks they share with the CPU ops.
#include <cmath>
#include <string>
#include <vector>

#include "k3/kda.hpp"
#include "k3/kda_ops.hpp"

namespace k3::kda {
namespace {
std::string num(int64_t v) { return std::to_string(v); }
int64_t sz(size_t n) { return static_cast<int64_t>(n); }
Status size_error(const char* name, int64_t actual, int64_t expected, const char* shape) {
  return invalid_argument(std::string(name) + " has " + num(actual) + " elements, expected " + num(expected) + " " +
                          shape);
}

// The conv checks in one order; values = false leaves cu_seqlens' entries unread (only its size is
// checked: a device span's entries cannot be read on the host).
template <typename Args>
Status check_conv(const Args& a, bool values, int64_t* num_tokens, int64_t* num_seqs) {
  if (a.channels < 1) return invalid_argument("channels = " + num(a.channels) + " must be >= 1");
  if (a.width < 2 || a.width > kMaxConvWidth) {
    return invalid_argument("width = " + num(a.width) + " must be in [2, " + num(kMaxConvWidth) + "]");
  }
  const int64_t D = a.channels, W = a.width;
  if (a.state_len != 0 && (a.state_len < W - 1 || a.state_len > kMaxConvStateLen)) {
    return invalid_argument("state_len = " + num(a.state_len) + " must be 0 (W - 1) or in [W - 1 = " + num(W - 1) +
                            ", " + num(kMaxConvStateLen) + "]");
  }
  const int64_t S = detail::conv_state_len(W, a.state_len);
  if (sz(a.x.size()) % D != 0) {
    return invalid_argument("x has " + num(sz(a.x.size())) + " elements, not a multiple of D = " + num(D) + " ([T, D])");
  }
  const int64_t T = sz(a.x.size()) / D;
  if (sz(a.weight.size()) != D * W) return size_error("weight", sz(a.weight.size()), D * W, "([D, W])");
  if (!a.bias.empty() && sz(a.bias.size()) != D) return size_error("bias", sz(a.bias.size()), D, "([D])");
  int64_t n = 1;
  if (!a.cu_seqlens.empty()) {
    if (values) {
      K3_RETURN_IF_ERROR(check_cu_seqlens(a.cu_seqlens, T));
    } else if (a.cu_seqlens.size() < 2) {  // check_cu_seqlens' first check, word for word
      return invalid_argument("cu_seqlens has " + num(sz(a.cu_seqlens.size())) +
                              " entries, needs at least 2 ([N + 1], N >= 1)");
    }
    n = sz(a.cu_seqlens.size()) - 1;
  }
  if (!a.conv_state.empty() && sz(a.conv_state.size()) != n * D * S) {
    return size_error("conv_state", sz(a.conv_state.size()), n * D * S,
                      a.state_len == 0 ? "([N, D, W - 1])" : "([N, D, state_len])");
  }
  if (sz(a.y.size()) != T * D) return size_error("y", sz(a.y.size()), T * D, "([T, D])");
  *num_tokens = T;
  *num_seqs = n;
  return Status::ok();
}
}  // namespace

int64_t detail::conv_state_len(int64_t width, int64_t state_len) { return state_len == 0 ? width - 1 : state_len; }

Status detail::validate_conv(const ConvArgs& a, int64_t* num_tokens, int64_t* num_seqs) {
  return check_conv(a, true, num_tokens, num_seqs);
}

Status detail::validate_conv_bf16(const ConvArgsBf16& a, int64_t* num_tokens, int64_t* num_seqs) {
  return check_conv(a, true, num_tokens, num_seqs);
}

Status detail::validate_conv_sizes(const ConvArgs& a, int64_t* num_tokens, int64_t* num_seqs) {
  return check_conv(a, false, num_tokens, num_seqs);
}

Status detail::validate_rmsnorm(const GatedRmsNormArgs& a, int64_t* rows) {
  if (a.dim < 1) return invalid_argument("dim = " + num(a.dim) + " must be >= 1");
  if (!(a.eps > 0.0f) || !std::isfinite(a.eps)) {
    return invalid_argument("eps = " + std::to_string(a.eps) + " must be finite and > 0");
  }
  if (sz(a.x.size()) % a.dim != 0) {
    return invalid_argument("x has " + num(sz(a.x.size())) + " elements, not a multiple of D = " + num(a.dim) +
                            " ([rows, D])");
  }
  const int64_t r = sz(a.x.size()) / a.dim;
  if (sz(a.gate.size()) != r * a.dim) return size_error("gate", sz(a.gate.size()), r * a.dim, "([rows, D])");
  if (sz(a.weight.size()) != a.dim) return size_error("weight", sz(a.weight.size()), a.dim, "([D])");
  if (sz(a.y.size()) != r * a.dim) return size_error("y", sz(a.y.size()), r * a.dim, "([rows, D])");
  *rows = r;
  return Status::ok();
}

Status causal_conv1d_reference(const ConvArgs& a) {
  int64_t T = 0, N = 0;
  K3_RETURN_IF_ERROR(detail::validate_conv(a, &T, &N));
  const int64_t D = a.channels, W = a.width, S = detail::conv_state_len(W, a.state_len);
  std::vector<double> hist(static_cast<size_t>(S));
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t0 = a.cu_seqlens.empty() ? 0 : a.cu_seqlens[n];
    const int64_t t1 = a.cu_seqlens.empty() ? T : a.cu_seqlens[n + 1];
    for (int64_t c = 0; c < D; ++c) {
      float* state = a.conv_state.empty() ? nullptr : a.conv_state.data() + (n * D + c) * S;
      // input at sequence position p (p < 0: from the state, p >= -S)
      auto input = [&](int64_t p) -> double {
        if (p >= 0) return a.x[(t0 + p) * D + c];
        return state != nullptr ? state[p + S] : 0.0;
      };
      for (int64_t t = t0; t < t1; ++t) {
        double z = a.bias.empty() ? 0.0 : a.bias[c];
        for (int64_t i = 0; i < W; ++i) z += static_cast<double>(a.weight[c * W + i]) * input(t - t0 - W + 1 + i);
        a.y[t * D + c] = static_cast<float>(a.silu ? z / (1.0 + std::exp(-z)) : z);
      }
      if (state != nullptr) {
        for (int64_t j = 0; j < S; ++j) hist[j] = input(t1 - t0 - S + j);
        for (int64_t j = 0; j < S; ++j) state[j] = static_cast<float>(hist[j]);
      }
    }
  }
  return Status::ok();
}

Status gated_rmsnorm_reference(const GatedRmsNormArgs& a) {
  int64_t rows = 0;
  K3_RETURN_IF_ERROR(detail::validate_rmsnorm(a, &rows));
  const int64_t D = a.dim;
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < D; ++j) ss += static_cast<double>(a.x[r * D + j]) * a.x[r * D + j];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(D) + static_cast<double>(a.eps));
    for (int64_t j = 0; j < D; ++j) {
      const double g = a.gate[r * D + j];
      a.y[r * D + j] = static_cast<float>(a.x[r * D + j] * inv * a.weight[j] / (1.0 + std::exp(-g)));
    }
  }
  return Status::ok();
}

}  // namespace k3::kda
