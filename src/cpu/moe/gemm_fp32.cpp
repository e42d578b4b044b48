// Tile GEMM with FP32 FMAs, portable C++: the scalar level's kernel, and the definition of the
// FP32 levels' arithmetic that the AVX2 kernel (gemm_avx2.cpp, also used on the AVX-512 FP32
// level) reproduces bit for bit. The arithmetic is the same as the BF16 kernel's:
// per block, an unscaled partial sum over the k-pairs (odd element first, like VDPBF16PS) with
// one rounding per product-add (FMA), then totals += partial * 2^(s-127). Operands are FP32, so
// no range condition applies (MXCSR must keep IEEE subnormals, the default).
#include <cmath>
#include <cstring>

#include "cpu/moe/layout.hpp"

namespace k3::cpu::detail {
namespace {

constexpr float kE2M1Values[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                   -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

template <int G>
inline __attribute__((always_inline)) void tile_gemm_body(const TileGemm& a) {
  constexpr int kWidth = G * kLanes;
  alignas(64) float w[kBlock][kWidth];  // [32 k, G*16 lanes] unscaled E2M1 values of one block
  alignas(64) float scale[kWidth];
  alignas(64) float partial[kWidth];
  std::memset(a.totals, 0, static_cast<size_t>(a.num_rows * kWidth) * sizeof(float));
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* r = a.records + b * record_bytes(G);
    for (int g = 0; g < G; ++g) {
      for (int lane = 0; lane < kLanes; ++lane) {
        for (int e = 0; e < kBlock; ++e) {
          const uint8_t byte = r[record_code_offset(G, g, lane, e)];
          w[e][g * kLanes + lane] = kE2M1Values[record_code_high(g) ? byte >> 4 : byte & 15];
        }
        const uint32_t bits = static_cast<uint32_t>(r[record_code_bytes(G) + g * kLanes + lane]) << 23;
        std::memcpy(&scale[g * kLanes + lane], &bits, sizeof(float));
      }
    }
    for (int64_t m = 0; m < a.num_rows; ++m) {
      const float* x = static_cast<const float*>(a.rows[m]) + b * kBlock;
      for (int l = 0; l < kWidth; ++l) partial[l] = 0.f;
      for (int kp = 0; kp < kPairs; ++kp) {
        const float x_odd = x[2 * kp + 1], x_even = x[2 * kp];
        for (int l = 0; l < kWidth; ++l) partial[l] = std::fma(w[2 * kp + 1][l], x_odd, partial[l]);
        for (int l = 0; l < kWidth; ++l) partial[l] = std::fma(w[2 * kp][l], x_even, partial[l]);
      }
      float* t = a.totals + m * kWidth;
      for (int l = 0; l < kWidth; ++l) t[l] = std::fma(partial[l], scale[l], t[l]);
    }
  }
}

void tile_gemm_scalar(const TileGemm& a) {
  if (a.groups == kFc1Groups) {
    tile_gemm_body<kFc1Groups>(a);
  } else {
    tile_gemm_body<kFc2Groups>(a);
  }
}

}  // namespace

TileGemmFn tile_gemm_fp32(IsaLevel level, bool avx_vnni) {
  return level == IsaLevel::kScalar ? tile_gemm_scalar : tile_gemm_avx2(int_mac_form(level, avx_vnni));
}

}  // namespace k3::cpu::detail
