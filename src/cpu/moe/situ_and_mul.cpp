// situ_and_mul: the standalone SiTU gated activation (docs/moe.md), row-strided input.
#include <string>

#include "cpu/moe/elementwise.hpp"
#include "k3/cpu_moe.hpp"

namespace k3::cpu {

Status situ_and_mul(std::span<const float> in, int64_t rows, int64_t d, int64_t ld, float beta, float linear_beta,
                    std::span<float> out) {
  if (rows < 0) return invalid_argument("rows = " + std::to_string(rows) + " must be >= 0");
  if (d < 1) return invalid_argument("d = " + std::to_string(d) + " must be >= 1");
  if (ld < 2 * d) {
    return invalid_argument("ld = " + std::to_string(ld) + " must be >= 2*d = " + std::to_string(2 * d));
  }
  if (!(beta > 0.f) || !(linear_beta > 0.f)) {
    return invalid_argument("beta = " + std::to_string(beta) + " and linear_beta = " + std::to_string(linear_beta) +
                            " must be > 0");
  }
  const int64_t need_in = rows == 0 ? 0 : (rows - 1) * ld + 2 * d;
  if (static_cast<int64_t>(in.size()) < need_in) {
    return invalid_argument("in has " + std::to_string(in.size()) + " elements, needs (rows-1)*ld + 2*d = " +
                            std::to_string(need_in));
  }
  if (static_cast<int64_t>(out.size()) != rows * d) {
    return invalid_argument("out has " + std::to_string(out.size()) + " elements, expected rows*d = " +
                            std::to_string(rows * d));
  }
  // Every level gives the same bits; the best one the CPU has (the library reads no K3_ISA).
  const detail::Elementwise& ew = detail::elementwise(best_isa_level());
  detail::ActParams ap;
  ap.kind = ActivationKind::kSiTU;
  ap.beta = beta;
  ap.linear_beta = linear_beta;
  for (int64_t r = 0; r < rows; ++r) ew.activate(ap, in.data() + r * ld, in.data() + r * ld + d, out.data() + r * d, d);
  return Status::ok();
}

}  // namespace k3::cpu
