// Per-head products of one row (k3/cpu_linear.hpp, head_gemv_bf16): MLA's absorbed decode. One
// body, compiled for each ISA level through target attributes (the library is built with
// -ffp-contract=off, so every level does the same rounded multiply and add per k, vectorized
// over n): the bits of head_gemv_reference on every level and thread count.
#include <algorithm>
#include <cstring>
#include <string>

#include "k3/cpu_linear.hpp"
#include "k3/formats.hpp"

namespace k3::cpu {
namespace {

int resolve(int threads) { return threads > 0 ? threads : hardware_thread_count(); }

// One head: y[0, N) = sum_k x[k] * w[k, 0, N). The running sums live in y (L1 for N up to a few
// thousand); the weights are read once, in order.
__attribute__((always_inline)) inline void head_body(const uint16_t* w, const float* x, float* y, int64_t K,
                                                     int64_t N) {
  {
    const float x0 = x[0];
    for (int64_t j = 0; j < N; ++j) y[j] = x0 * bf16_to_f32(w[j]);
  }
  for (int64_t k = 1; k < K; ++k) {
    const float xk = x[k];
    const uint16_t* row = w + k * N;
    for (int64_t j = 0; j < N; ++j) y[j] = y[j] + xk * bf16_to_f32(row[j]);
  }
}

template <typename Body>
void over_heads(const HeadGemvArgs& a, int threads, Body body) {
  const int64_t H = a.heads, K = a.k, N = a.n;
  const uint16_t* w = a.w.data();
  const float* x = a.x.data();
  float* y = a.y.data();
#pragma omp parallel for schedule(static) num_threads(resolve(threads)) if (H > 1)
  for (int64_t h = 0; h < H; ++h) body(w + h * K * N, x + h * K, y + h * N, K, N);
}

void heads_scalar(const uint16_t* w, const float* x, float* y, int64_t K, int64_t N) { head_body(w, x, y, K, N); }
__attribute__((target("avx2,fma"))) void heads_avx2(const uint16_t* w, const float* x, float* y, int64_t K,
                                                    int64_t N) {
  head_body(w, x, y, K, N);
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"))) void heads_avx512(const uint16_t* w, const float* x,
                                                                                float* y, int64_t K, int64_t N) {
  head_body(w, x, y, K, N);
}

Status validate(const HeadGemvArgs& a) {
  auto pos = [](const char* name, int64_t v) -> Status {
    if (v < 1 || v > kLinearMaxDim) {
      return invalid_argument(std::string("head_gemv: ") + name + " = " + std::to_string(v) + " must be in [1, " +
                              std::to_string(kLinearMaxDim) + "]");
    }
    return Status::ok();
  };
  K3_RETURN_IF_ERROR(pos("heads", a.heads));
  K3_RETURN_IF_ERROR(pos("k", a.k));
  K3_RETURN_IF_ERROR(pos("n", a.n));
  auto size = [](const char* name, size_t got, int64_t want, const char* shape) -> Status {
    if (static_cast<int64_t>(got) != want) {
      return invalid_argument(std::string("head_gemv: ") + name + " has " + std::to_string(got) + " values, " +
                              shape + " = " + std::to_string(want));
    }
    return Status::ok();
  };
  K3_RETURN_IF_ERROR(size("w", a.w.size(), a.heads * a.k * a.n, "heads * k * n"));
  K3_RETURN_IF_ERROR(size("x", a.x.size(), a.heads * a.k, "heads * k"));
  K3_RETURN_IF_ERROR(size("y", a.y.size(), a.heads * a.n, "heads * n"));
  return Status::ok();
}

}  // namespace

Status head_gemv_reference(const HeadGemvArgs& a) {
  K3_RETURN_IF_ERROR(validate(a));
  for (int64_t h = 0; h < a.heads; ++h) {
    for (int64_t j = 0; j < a.n; ++j) {
      float s = 0.0f;
      for (int64_t k = 0; k < a.k; ++k) {
        const float p = a.x[h * a.k + k] * bf16_to_f32(a.w[(h * a.k + k) * a.n + j]);
        s = k == 0 ? p : s + p;
      }
      a.y[h * a.n + j] = s;
    }
  }
  return Status::ok();
}

Status head_gemv_bf16(const HeadGemvArgs& a, int threads, std::optional<IsaLevel> isa) {
  K3_RETURN_IF_ERROR(validate(a));
  if (threads < 0 || threads > 256) {
    return invalid_argument("head_gemv: threads = " + std::to_string(threads) +
                            " must be in [0, 256] (0: all logical CPUs)");
  }
  const IsaLevel best = best_isa_level();
  const IsaLevel level = isa.value_or(best);
  if (static_cast<int>(level) > static_cast<int>(best)) {
    return invalid_argument(std::string("head_gemv: isa = ") + isa_level_name(level) + " is above this CPU's " +
                            isa_level_name(best));
  }
  switch (level) {
    case IsaLevel::kScalar: over_heads(a, threads, heads_scalar); break;
    case IsaLevel::kAvx2: over_heads(a, threads, heads_avx2); break;
    default: over_heads(a, threads, heads_avx512); break;
  }
  return Status::ok();
}

}  // namespace k3::cpu
