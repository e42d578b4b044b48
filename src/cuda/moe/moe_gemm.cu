// Grouped GEMMs of the fused MoE with MXFP4 weights dequantized in registers to BF16 (exact,
// docs/formats.md) feeding mma.sync.m16n8k16 BF16 -> FP32 (runs on sm_80 and later, so the same
// code serves sm_90a and sm_120a). FC1 fuses the gated activation and, for W4A8, the MXFP8
// re-quantization of its output per 32 columns.
//
// Ran on an H200 (sm_90, 2026-12-04): correct, 4-18x slower than prefill-sm90. A first, correctness-oriented
// design: the A tile is staged through shared memory, B fragments are built straight from global
// memory (16-byte loads of one MX block per weight row). No cp.async pipelining, no wgmma yet.
//
// Tile: BM token rows (BM/16 warps, one 16-row slice each) x BN output columns x 32 (one MX block).
#include "cuda/moe/moe_kernels.cuh"
#include "k3/mx.hpp"

namespace k3::cuda::moe_detail {
namespace {

// B fragments for one n-tile and one 32-wide k block of weight row `w_row` (16 packed bytes):
// lane (g = lane/4, q = lane%4) needs k = 2q, 2q+1 (reg 0) and 8+2q, 9+2q (reg 1) of each 16-wide
// k step s, i.e. bytes 8s + q and 8s + 4 + q.
__device__ __forceinline__ void load_b(const uint8_t* __restrict__ w_row, uint8_t scale, unsigned q,
                                       uint32_t (&b)[2][2]) {
  const uint4 v = *reinterpret_cast<const uint4*>(w_row);
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
  const uint32_t exp_add = fp4_exp_add(scale), nan_mask = fp4_nan_mask(scale);  // NaN block for 0xFF
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const uint32_t lo = (words[2 * s] >> (8 * q)) & 0xFFu;      // byte 8s + q
    const uint32_t hi = (words[2 * s + 1] >> (8 * q)) & 0xFFu;  // byte 8s + 4 + q
    b[s][0] = fp4x2_to_bf16x2(lo, exp_add, nan_mask);  // moe_shared.hpp (host-tested)
    b[s][1] = fp4x2_to_bf16x2(hi, exp_add, nan_mask);
  }
}

// kFc1: A = gathered x rows, B rows = [gate; up], epilogue = activation (+ MXFP8), out = act BF16.
// !kFc1: A = act rows, B rows = FC2, out = y FP32.
template <bool kFc1, int BM, int BN>
__global__ void __launch_bounds__(BM * 2) moe_gemm_kernel(Dims d, Recipe recipe, ActParams act,
                                                         const uint16_t* __restrict__ a_src,
                                                         const int32_t* __restrict__ row_token,
                                                         const int32_t* __restrict__ tile_expert,
                                                         const uint8_t* __restrict__ w_q,
                                                         const uint8_t* __restrict__ w_scale,
                                                         void* __restrict__ out, int* __restrict__ status) {
  static_assert(BM % 16 == 0 && BN % 32 == 0, "tile: BM multiple of 16, BN multiple of 32");
  constexpr int kNT = BN / 8;  // n-tiles of 8 columns per warp
  __shared__ __align__(16) uint16_t a_tile[BM][kMxBlock + 8];  // [BM, 32] BF16, padded rows (banks)

  // Grid-stride over row tiles: a plan may have more tiles than gridDim.y allows (65535).
  for (int64_t tile = blockIdx.y; tile < d.max_tiles; tile += gridDim.y) {
    const int expert = tile_expert[tile];
    if (expert < 0) continue;  // the same for every thread of the block
    const int64_t row0 = tile * BM;
    const int64_t red = kFc1 ? d.k : d.n;         // reduction length
    const int64_t out_cols = kFc1 ? d.n : d.k;    // columns of this GEMM's output (per half for FC1)
    const int64_t col0 = static_cast<int64_t>(blockIdx.x) * BN;
    const int64_t w_rows = kFc1 ? 2 * d.n : d.k;  // weight rows per expert
    const uint8_t* wq = w_q + static_cast<int64_t>(expert) * w_rows * (red / 2);
    const uint8_t* ws = w_scale + static_cast<int64_t>(expert) * w_rows * (red / kMxBlock);

    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned g = lane >> 2, q = lane & 3u;

    float acc[kNT][4] = {};
    float acc_up[kFc1 ? kNT : 1][4] = {};

    for (int64_t kb = 0; kb < red / kMxBlock; ++kb) {
      // Stage A [BM, 32] BF16: BM*4 chunks of 16 bytes over BM*2 threads.
      __syncthreads();
      for (int c = threadIdx.x; c < BM * 4; c += blockDim.x) {
        const int r = c >> 2, part = c & 3;
        uint4 v = make_uint4(0, 0, 0, 0);
        int64_t src_row;
        if constexpr (kFc1) {
          src_row = row_token[row0 + r];  // token of this permuted row, -1 = padding
        } else {
          src_row = row0 + r;
        }
        if (src_row >= 0) {
          v = *reinterpret_cast<const uint4*>(a_src + src_row * red + kb * kMxBlock + part * 8);
        }
        *reinterpret_cast<uint4*>(&a_tile[r][part * 8]) = v;
      }
      __syncthreads();
      uint32_t a[2][4];  // A fragments of the two 16-wide k steps
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const int r = static_cast<int>(warp) * 16 + static_cast<int>(g);
        const int c = s * 16 + static_cast<int>(q) * 2;
        a[s][0] = *reinterpret_cast<const uint32_t*>(&a_tile[r][c]);
        a[s][1] = *reinterpret_cast<const uint32_t*>(&a_tile[r + 8][c]);
        a[s][2] = *reinterpret_cast<const uint32_t*>(&a_tile[r][c + 8]);
        a[s][3] = *reinterpret_cast<const uint32_t*>(&a_tile[r + 8][c + 8]);
      }
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const int64_t n_col = col0 + j * 8 + g;  // weight row of this lane's B column
        uint32_t b[2][2];
        load_b(wq + n_col * (red / 2) + kb * 16, ws[n_col * (red / kMxBlock) + kb], q, b);
        mma_bf16(acc[j], a[0], b[0][0], b[0][1]);
        mma_bf16(acc[j], a[1], b[1][0], b[1][1]);
        if constexpr (kFc1) {
          const int64_t u_col = d.n + n_col;  // the matching "up" row of [gate; up]
          load_b(wq + u_col * (red / 2) + kb * 16, ws[u_col * (red / kMxBlock) + kb], q, b);
          mma_bf16(acc_up[j], a[0], b[0][0], b[0][1]);
          mma_bf16(acc_up[j], a[1], b[1][0], b[1][1]);
        }
      }
    }

    // Epilogue. Lane holds rows r0 = 16*warp + g and r0 + 8, columns 8j + 2q, 8j + 2q + 1.
    const int64_t r_lo = row0 + warp * 16 + g;
    if constexpr (kFc1) {
      uint16_t* act_out = static_cast<uint16_t*>(out);  // [rows, N] BF16
#pragma unroll
      for (int j0 = 0; j0 < kNT; j0 += 4) {  // one MX block of 32 columns = 4 n-tiles
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // row r_lo (c0, c1) or r_lo + 8 (c2, c3)
          float v[8];
          MxBlockAmax block;
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float x = activation_f32(act, expert, acc[j0 + jj][2 * half + e], acc_up[j0 + jj][2 * half + e]);
              v[2 * jj + e] = x;
              block.add(x);
            }
          }
          uint8_t sc = 0;
          if (recipe == Recipe::kW4A8) {
            quad_merge(block);  // the 32 columns of this row live in the 4 lanes of the quad
            sc = block.scale_code(MxElement::kE4M3, ScaleRule::kRceil);
          }
          uint16_t h[8];
          if (recipe == Recipe::kW4A8) {
            // MXFP8 code and its exact dequantization, as the FC2 operand; a value BF16 does not
            // hold as a normal number (subnormal range) is flagged instead of rounded silently.
            if (!mxfp8_bf16_operands(v, sc, h)) atomicOr(status, kStatusInexactAct);
          } else {
#pragma unroll
            for (int t = 0; t < 8; ++t) h[t] = bf16_from_f32(v[t]);  // W4A16: the contract's BF16 rounding
          }
          const int64_t row = r_lo + 8 * half;
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            const int64_t col = col0 + (j0 + jj) * 8 + 2 * q;
            const uint32_t packed = static_cast<uint32_t>(h[2 * jj]) | (static_cast<uint32_t>(h[2 * jj + 1]) << 16);
            *reinterpret_cast<uint32_t*>(act_out + row * out_cols + col) = packed;
          }
        }
      }
    } else {
      float* y = static_cast<float*>(out);  // [rows, K] FP32
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
void launch_gemm(const Dims& d, Recipe recipe, const ActParams& act, const uint16_t* a, const int32_t* row_token,
                 const int32_t* tile_expert, const uint8_t* q, const uint8_t* s, void* out, int* status,
                 cudaStream_t st) {
  const Grid g = gemm_grid(d, kFc1, BN);
  const dim3 grid(g.x, g.y, g.z);
  // Tiles of 64 rows only: every plan that runs these kernels (prefill, and prefill-sm90's
  // fallback) has block_m 64; decode-splitk (block_m 16) runs its own kernels.
  moe_gemm_kernel<kFc1, 64, BN><<<grid, 128, 0, st>>>(d, recipe, act, a, row_token, tile_expert, q, s, out, status);
}

}  // namespace

void launch_fc1(const Dims& d, int block_n, Recipe recipe, const ActParams& act, const uint16_t* x_bf16,
                const int32_t* row_token, const int32_t* tile_expert, const uint8_t* fc1_q, const uint8_t* fc1_scale,
                uint16_t* act_out, int* status, cudaStream_t s) {
  if (block_n == 64) {
    launch_gemm<true, 64>(d, recipe, act, x_bf16, row_token, tile_expert, fc1_q, fc1_scale, act_out, status, s);
  } else {
    launch_gemm<true, 32>(d, recipe, act, x_bf16, row_token, tile_expert, fc1_q, fc1_scale, act_out, status, s);
  }
}

void launch_fc2(const Dims& d, int block_n, const uint16_t* act_in, const int32_t* tile_expert, const uint8_t* fc2_q,
                const uint8_t* fc2_scale, float* y, cudaStream_t s) {
  const ActParams none{ActivationKind::kSiLU, 0, 0, 0, nullptr, nullptr};
  if (block_n == 64) {
    launch_gemm<false, 64>(d, Recipe::kW4A16, none, act_in, nullptr, tile_expert, fc2_q, fc2_scale, y, nullptr, s);
  } else {
    launch_gemm<false, 32>(d, Recipe::kW4A16, none, act_in, nullptr, tile_expert, fc2_q, fc2_scale, y, nullptr, s);
  }
}

}  // namespace k3::cuda::moe_detail
