// KDA kernels without SIMD intrinsics (K3_ISA=scalar; any x86-64 or other CPU).
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/kda/kda_math.hpp"
#include "cpu/kda/kernels.hpp"
#include "cpu/prefetch.hpp"

namespace k3::cpu::kda_detail {
namespace scalar_impl {

struct VF {
  using V = float;
  static constexpr int W = 1;
  static constexpr int MR = 4, NR = 4;
  static V zero() { return 0.0f; }
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static V load_bf16(const uint16_t* p) { return k3::bf16_to_f32(*p); }
  static void store(float* p, V v) { *p = v; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V fmadd(V a, V b, V c) { return a * b + c; }
  static V max(V a, V b) { return a > b || a != a ? a : b; }  // NaN in a propagates, as in the SIMD levels
  static float reduce_add(V a) { return a; }
  static V exp(V a) { return std::exp(a); }
};

#include "cpu/kda/kernels_impl.hpp"

}  // namespace scalar_impl

const KernelTable& kernels_scalar() { return scalar_impl::table(); }

}  // namespace k3::cpu::kda_detail
