// sm_120a W4A8 path on the native block-scaled tensor-core MMA:
//   mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X.f32.e4m3.e2m1.f32.ue8m0
// A = MXFP8 (E4M3 codes + one UE8M0 scale per row and 32-k block), B = MXFP4 weights (E2M1 codes
// + UE8M0 scale per weight row and block): one MMA covers exactly one MX block (k = 32), so the
// hardware applies both scales and no dequantization happens in software.
//
// NEVER RUN ON HARDWARE. Disabled by default: enabled only by cuda::MoeOptions::sm120_native_w4a8
// (CLI: K3_CUDA_SM120_NATIVE=1) on an sm_120 device, until it has passed `k3 validate` on one.
// Assumptions to verify on an sm_120 GPU (they come from reading the PTX ISA, not from a run):
//   * E2M1 operands of kind::mxf8f6f4 sit one per byte, value in bits [5:2];
//   * with scale_vec::1X, {byte-id 0, thread-id 0} means: lane 4g supplies the scale of A row g and
//     lane 4g+1 that of row g+8; lane 4g supplies the scale of B column g.
// The kernel bodies exist only in the sm_120a image (__CUDA_ARCH_FEAT_SM120_ALL); in the sm_90a
// image they trap, and cuda::plan refuses the option on any device that is not sm_120.
#include "cuda/moe/moe_kernels.cuh"
#include "k3/mx.hpp"

namespace k3::cuda::moe_detail {
namespace {

// One thread per (token, 32-block), grid-stride: E4M3 codes and the block's UE8M0 scale (RCEIL).
__global__ void prep_x_mx_kernel(Dims d, const int32_t* __restrict__ m_ptr, const uint16_t* __restrict__ x,
                                 uint8_t* __restrict__ codes,    // [max_m, K]
                                 uint8_t* __restrict__ scales) {  // [max_m, K/32]
  const int64_t nblk = d.k / kMxBlock;
  const int64_t live = clamp_tokens(*m_ptr, d.max_m) * nblk;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < live; i += stride) {
    const uint16_t* src = x + i * kMxBlock;
    MxBlockAmax block;
    for (int j = 0; j < kMxBlock; ++j) block.add(bf16_to_f32(src[j]));
    const uint8_t s = block.scale_code(MxElement::kE4M3, ScaleRule::kRceil);
    scales[i] = s;
    for (int j = 0; j < kMxBlock; ++j) {
      codes[i * kMxBlock + j] = mx_encode_element(bf16_to_f32(src[j]), s, MxElement::kE4M3);
    }
  }
}

// Four E2M1 codes (two packed bytes, low nibble first) in 8-bit containers, value in bits [5:2].
__device__ __forceinline__ uint32_t fp4x4_to_containers(uint32_t two_bytes) {
  return ((two_bytes & 0xFu) << 2) | (((two_bytes >> 4) & 0xFu) << 10) | (((two_bytes >> 8) & 0xFu) << 18) |
         (((two_bytes >> 12) & 0xFu) << 26);
}

__device__ __forceinline__ void mma_mx(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, uint32_t sfa,
                                       uint32_t sfb) {
#if defined(__CUDA_ARCH_FEAT_SM120_ALL)
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X.f32.e4m3.e2m1.f32.ue8m0 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3}, %10, {%12, %12}, %11, {%12, %12};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(sfa), "r"(sfb), "h"(uint16_t{0}));
#else
  (void)c, (void)a, (void)b0, (void)b1, (void)sfa, (void)sfb;
  __trap();  // never launched: cuda::plan allows this path on sm_120 devices only
#endif
}

// kFc1: A = gathered x codes/scales, out = activation codes [rows, N] + scales [rows, N/32].
// !kFc1: A = activation codes/scales, out = y FP32 [rows, K].
template <bool kFc1, int BM, int BN>
__global__ void __launch_bounds__(BM * 2) moe_gemm_mx_kernel(Dims d, ActParams act,
                                                            const uint8_t* __restrict__ a_codes,
                                                            const uint8_t* __restrict__ a_scales,
                                                            const int32_t* __restrict__ row_token,
                                                            const int32_t* __restrict__ tile_expert,
                                                            const uint8_t* __restrict__ w_q,
                                                            const uint8_t* __restrict__ w_scale,
                                                            uint8_t* __restrict__ out_codes,
                                                            uint8_t* __restrict__ out_scales, float* __restrict__ y) {
  constexpr int kNT = BN / 8;
  __shared__ __align__(16) uint8_t a_tile[BM][kMxBlock + 16];  // [BM, 32] E4M3 codes, padded rows
  __shared__ uint8_t a_sc[BM];                                  // [BM] UE8M0
  // Grid-stride over row tiles: a plan may have more tiles than gridDim.y allows (65535).
  for (int64_t tile = blockIdx.y; tile < d.max_tiles; tile += gridDim.y) {
    const int expert = tile_expert[tile];
    if (expert < 0) continue;  // the same for every thread of the block
    const int64_t row0 = tile * BM, red = kFc1 ? d.k : d.n, out_cols = kFc1 ? d.n : d.k;
    const int64_t col0 = static_cast<int64_t>(blockIdx.x) * BN, w_rows = kFc1 ? 2 * d.n : d.k;
    const uint8_t* wq = w_q + static_cast<int64_t>(expert) * w_rows * (red / 2);
    const uint8_t* ws = w_scale + static_cast<int64_t>(expert) * w_rows * (red / kMxBlock);
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3u;
    float acc[kNT][4] = {};
    float acc_up[kFc1 ? kNT : 1][4] = {};
    for (int64_t kb = 0; kb < red / kMxBlock; ++kb) {
      __syncthreads();
      for (int c = threadIdx.x; c < BM * 2; c += blockDim.x) {  // BM rows x 2 chunks of 16 bytes
        const int r = c >> 1, part = c & 1;
        const int64_t src = kFc1 ? row_token[row0 + r] : row0 + r;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (src >= 0) v = *reinterpret_cast<const uint4*>(a_codes + src * red + kb * kMxBlock + part * 16);
        *reinterpret_cast<uint4*>(&a_tile[r][part * 16]) = v;
        if (part == 0) a_sc[r] = src >= 0 ? a_scales[src * (red / kMxBlock) + kb] : uint8_t{127};
      }
      __syncthreads();
      const int r = static_cast<int>(warp * 16 + g);
      const uint32_t a[4] = {*reinterpret_cast<const uint32_t*>(&a_tile[r][4 * q]),
                             *reinterpret_cast<const uint32_t*>(&a_tile[r + 8][4 * q]),
                             *reinterpret_cast<const uint32_t*>(&a_tile[r][16 + 4 * q]),
                             *reinterpret_cast<const uint32_t*>(&a_tile[r + 8][16 + 4 * q])};
      const uint32_t sfa = q == 0 ? a_sc[r] : (q == 1 ? a_sc[r + 8] : 127u);
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
#pragma unroll
        for (int half = 0; half < (kFc1 ? 2 : 1); ++half) {
          const int64_t wrow = col0 + j * 8 + g + (half ? d.n : 0);
          const uint8_t* p = wq + wrow * (red / 2) + kb * 16;
          const uint32_t lo = *reinterpret_cast<const uint16_t*>(p + 2 * q);      // k = 4q .. 4q+3
          const uint32_t hi = *reinterpret_cast<const uint16_t*>(p + 8 + 2 * q);  // k = 16+4q .. 16+4q+3
          const uint32_t sfb = q == 0 ? ws[wrow * (red / kMxBlock) + kb] : 127u;
          mma_mx(half ? acc_up[kFc1 ? j : 0] : acc[j], a, fp4x4_to_containers(lo), fp4x4_to_containers(hi), sfa, sfb);
        }
      }
    }
    const int64_t r_lo = row0 + warp * 16 + g;
    if constexpr (kFc1) {
#pragma unroll
      for (int j0 = 0; j0 < kNT; j0 += 4) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float v[8];
          MxBlockAmax block;
#pragma unroll
          for (int t = 0; t < 8; ++t) {
            v[t] = activation_f32(act, expert, acc[j0 + t / 2][2 * half + t % 2], acc_up[j0 + t / 2][2 * half + t % 2]);
            block.add(v[t]);
          }
          quad_merge(block);  // the 32 columns of this row live in the 4 lanes of the quad
          const uint8_t sc = block.scale_code(MxElement::kE4M3, ScaleRule::kRceil);
          const int64_t row = r_lo + 8 * half;
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            const int64_t col = col0 + (j0 + jj) * 8 + 2 * q;
            const uint32_t pair = mx_encode_element(v[2 * jj], sc, MxElement::kE4M3) |
                                  (uint32_t{mx_encode_element(v[2 * jj + 1], sc, MxElement::kE4M3)} << 8);
            *reinterpret_cast<uint16_t*>(out_codes + row * out_cols + col) = static_cast<uint16_t>(pair);
          }
          if (q == 0) out_scales[row * (out_cols / kMxBlock) + (col0 + j0 * 8) / kMxBlock] = sc;
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const int64_t col = col0 + j * 8 + 2 * q;
        *reinterpret_cast<float2*>(y + r_lo * out_cols + col) = make_float2(acc[j][0], acc[j][1]);
        *reinterpret_cast<float2*>(y + (r_lo + 8) * out_cols + col) = make_float2(acc[j][2], acc[j][3]);
      }
    }
  }  // row tiles
}

template <bool kFc1, int BN>
void launch_mx(const Dims& d, const ActParams& act, const uint8_t* ac, const uint8_t* as, const int32_t* row_token,
               const int32_t* tile_expert, const uint8_t* q, const uint8_t* s, uint8_t* oc, uint8_t* os, float* y,
               cudaStream_t st) {
  const Grid g = gemm_grid(d, kFc1, BN);
  const dim3 grid(g.x, g.y, g.z);
  if (d.block_m == 16) {
    moe_gemm_mx_kernel<kFc1, 16, BN><<<grid, 32, 0, st>>>(d, act, ac, as, row_token, tile_expert, q, s, oc, os, y);
  } else {
    moe_gemm_mx_kernel<kFc1, 64, BN><<<grid, 128, 0, st>>>(d, act, ac, as, row_token, tile_expert, q, s, oc, os, y);
  }
}

}  // namespace

void launch_prep_x_mx(const Dims& d, const int32_t* m, const uint16_t* x, uint8_t* codes, uint8_t* scales,
                      cudaStream_t s) {
  const Grid g = prep_grid(d);
  prep_x_mx_kernel<<<g.x, kPrepThreads, 0, s>>>(d, m, x, codes, scales);
}

void launch_fc1_sm120(const Dims& d, int block_n, const ActParams& act, const uint8_t* x_codes,
                      const uint8_t* x_scales, const int32_t* row_token, const int32_t* tile_expert,
                      const uint8_t* fc1_q, const uint8_t* fc1_scale, uint8_t* act_codes, uint8_t* act_scales,
                      cudaStream_t s) {
  if (block_n == 64) {
    launch_mx<true, 64>(d, act, x_codes, x_scales, row_token, tile_expert, fc1_q, fc1_scale, act_codes, act_scales,
                        nullptr, s);
  } else {
    launch_mx<true, 32>(d, act, x_codes, x_scales, row_token, tile_expert, fc1_q, fc1_scale, act_codes, act_scales,
                        nullptr, s);
  }
}

void launch_fc2_sm120(const Dims& d, int block_n, const uint8_t* act_codes, const uint8_t* act_scales,
                      const int32_t* tile_expert, const uint8_t* fc2_q, const uint8_t* fc2_scale, float* y,
                      cudaStream_t s) {
  const ActParams none{ActivationKind::kSiLU, 0, 0, 0, nullptr, nullptr};
  if (block_n == 64) {
    launch_mx<false, 64>(d, none, act_codes, act_scales, nullptr, tile_expert, fc2_q, fc2_scale, nullptr, nullptr, y, s);
  } else {
    launch_mx<false, 32>(d, none, act_codes, act_scales, nullptr, tile_expert, fc2_q, fc2_scale, nullptr, nullptr, y, s);
  }
}

}  // namespace k3::cuda::moe_detail
