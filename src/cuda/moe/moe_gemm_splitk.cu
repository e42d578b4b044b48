// The decode-splitk path (MoePath::kDecodeSplitK): grouped FC1 / FC2 for few rows per expert.
// Ran on an H200 (sm_90, 2026-12-04): correct; 23-34 % of the copy bandwidth at M = 1 and 8.
//
// Swap AB (moe_pack.hpp): MXFP4 weights, in the fragment-native prepacked layout, are the M
// operand of mma.sync.m16n8k16 BF16 -> FP32 (16 weight rows x 16 k), token rows the N operand
// (n-tiles of 8 tokens). A CTA is one row tile of 16 token rows (the stable sort's block_m = 16:
// two n-tiles, so an expert with up to 16 rows streams its weights exactly once; the second
// n-tile's MMAs are skipped when its rows are all padding, and MMAs on padding rows cost nothing
// in this bandwidth-bound regime) x 64 weight rows (4 m-tiles; for FC1 the gate and up rows of 32
// intermediate columns, one MX block of the W4A8 re-quantization). Its 8 warps split the
// reduction into contiguous runs of 128-wide pairs of chunks (sk_split); the partial sums are
// reduced in shared memory in warp order 0..7 (deterministic, independent of timing).
//
// Bytes in flight (Little's law): H200 HBM3e ~4.8 TB/s x ~0.7 us latency = ~3.4 MB in flight,
// / 132 SMs = ~25 KB per SM. Per pair a lane issues 8 independent 16-byte weight loads (4 m-tiles
// x 2 chunks: 4 KB per warp) and its 4 scale words before the first use, so a CTA of 8 warps has
// up to 32 KB of weights in flight; __launch_bounds__(256, 2) lets 2 CTAs share an SM (<= 128
// registers, 32 KB of static shared memory each): up to 64 KB per SM, >= 32 KB on average while
// warps alternate between loading and converting. The operand rows (x, act) are small and read
// from L2.
//
// Programmatic dependent launch: FC1 and FC2 are launched with
// cudaLaunchAttributeProgrammaticStreamSerialization. Before griddepcontrol.wait a CTA reads only
// what earlier, already completed launches wrote (tile_expert: slot_scan, two launches before FC1)
// and the weights, and issues its first pair of weight loads; it reads the operand rows (FC1:
// row_token from slot_scatter and x_bf16; FC2: act from FC1) only after the wait. Each GEMM
// signals griddepcontrol.launch_dependents after its main loop.
#include "cuda/moe/moe_kernels.cuh"
#include "cuda/moe/moe_pack.hpp"
#include "k3/mx.hpp"

namespace k3::cuda::moe_detail {
namespace {

__device__ __forceinline__ void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Weights of one pair: 2 chunks x kSkMTiles 16-byte loads and kSkMTiles scale words per lane.
struct PairA {
  uint4 q[kSkMTiles][2];
  uint32_t s[kSkMTiles];
};

__device__ __forceinline__ void load_pair(PairA& a, const SkGeom& g, const uint8_t* __restrict__ wq,
                                          const uint32_t* __restrict__ ws, int64_t mt0, int mt_live, int64_t p,
                                          int lane) {
  // One base address per pair; the other loads sit at fixed strides from it (sk_a_offset is linear).
  const uint8_t* base = wq + sk_a_offset(g, mt0, 2 * p, lane);
  const int64_t mt_stride = sk_a_offset(g, mt0 + 1, 2 * p, lane) - sk_a_offset(g, mt0, 2 * p, lane);
  const int64_t kc_stride = sk_a_offset(g, mt0, 2 * p + 1, lane) - sk_a_offset(g, mt0, 2 * p, lane);
  const uint32_t* sbase = ws + sk_scale_word(g, mt0, p, lane);
  const int64_t s_stride = sk_scale_word(g, mt0 + 1, p, lane) - sk_scale_word(g, mt0, p, lane);
#pragma unroll
  for (int mt = 0; mt < kSkMTiles; ++mt) {
    if (mt < mt_live) {
#pragma unroll
      for (int c = 0; c < 2; ++c) a.q[mt][c] = __ldg(reinterpret_cast<const uint4*>(base + mt * mt_stride + c * kc_stride));
      a.s[mt] = __ldg(sbase + mt * s_stride);
    } else {
      a.q[mt][0] = a.q[mt][1] = make_uint4(0, 0, 0, 0);
      a.s[mt] = 0;
    }
  }
}

// kFc1: B = x_bf16 rows of the tile's tokens (row_token), M = [gate; up] rows interleaved,
// epilogue = activation (+ MXFP8), out = act [rows, N] BF16. !kFc1: B = act rows, M = FC2 rows,
// out = y [rows, K] FP32.
template <bool kFc1>
__global__ void __launch_bounds__(kSkThreads, 2)
    moe_splitk_kernel(Dims d, Recipe recipe, ActParams act, const uint16_t* __restrict__ b_src,
                      const int32_t* __restrict__ row_token, const int32_t* __restrict__ tile_expert,
                      const uint8_t* __restrict__ w_q, const uint32_t* __restrict__ w_scale, void* __restrict__ out,
                      int* __restrict__ status) {
  __shared__ __align__(16) float part[kSkWarps * kSkElems * 32];  // 32 KB

  const int64_t tile = blockIdx.x;
  const int expert = tile_expert[tile];  // slot_scan's output: complete before the primary launched
  if (expert < 0) return;                // exit counts as the launch_dependents trigger
  const SkGeom g = kFc1 ? sk_geom_fc1(d.k, d.n) : sk_geom_fc2(d.k, d.n);
  const int64_t mt0 = static_cast<int64_t>(blockIdx.y) * kSkMTiles;
  const int mt_live = static_cast<int>(g.mtiles - mt0 < kSkMTiles ? g.mtiles - mt0 : kSkMTiles);
  const uint8_t* wq = w_q + static_cast<int64_t>(expert) * g.bytes;
  const uint32_t* ws = w_scale + static_cast<int64_t>(expert) * g.scale_words;
  const int lane = static_cast<int>(threadIdx.x & 31u), warp = static_cast<int>(threadIdx.x >> 5);
  const SkRange range = sk_split(g.pairs, warp);

  PairA a;
  if (range.begin < range.end) load_pair(a, g, wq, ws, mt0, mt_live, range.begin, lane);  // before the wait
  grid_dep_wait();

  const int64_t row0 = tile * kSkTokens;
  const int nt_live = row_token[row0 + 8] >= 0 ? 2 : 1;  // rows fill a tile in order: padding last
  int32_t b_row[kSkNTiles];  // operand row of this lane's token g in each n-tile, -1: padding (FC1)
#pragma unroll
  for (int nt = 0; nt < kSkNTiles; ++nt) {
    const int64_t r = row0 + 8 * nt + (lane >> 2);
    b_row[nt] = kFc1 ? row_token[r] : static_cast<int32_t>(r);
  }
  const int64_t b_ld = kFc1 ? d.k : d.n;

  float acc[kSkMTiles][kSkNTiles][4] = {};
  for (int64_t p = range.begin; p < range.end; ++p) {
    if (p != range.begin) load_pair(a, g, wq, ws, mt0, mt_live, p, lane);
#pragma unroll 1
    for (int c = 0; c < 2; ++c) {  // not unrolled: keeps the conversions of one chunk live at a time
      // The operand values of this chunk (L2-resident rows; the weight loads are already in flight).
      uint32_t bw[kSkNTiles][8];
      const int64_t k0 = sk_b_k0(2 * p + c, lane);
#pragma unroll
      for (int nt = 0; nt < kSkNTiles; ++nt) {
        uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
        if (nt < nt_live && b_row[nt] >= 0 && k0 < g.red) {
          const uint16_t* src = b_src + b_row[nt] * b_ld + k0;
          lo = *reinterpret_cast<const uint4*>(src);
          hi = *reinterpret_cast<const uint4*>(src + 8);
        }
        bw[nt][0] = lo.x, bw[nt][1] = lo.y, bw[nt][2] = lo.z, bw[nt][3] = lo.w;
        bw[nt][4] = hi.x, bw[nt][5] = hi.y, bw[nt][6] = hi.z, bw[nt][7] = hi.w;
      }
#pragma unroll
      for (int mt = 0; mt < kSkMTiles; ++mt) {
        if (mt >= mt_live) continue;
        const uint4 v = c == 0 ? a.q[mt][0] : a.q[mt][1];  // a select, not a dynamic index
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
        // E2M1 -> BF16 tables of rows g and g + 8 for this chunk (moe_pack.hpp, host-tested).
        const SkFp4Table t_lo = sk_fp4_table(sk_scale_of(a.s[mt], c, 0));
        const SkFp4Table t_hi = sk_fp4_table(sk_scale_of(a.s[mt], c, 1));
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          uint32_t ar[4];
          sk_a_regs(w[s], t_lo, t_hi, ar);
#pragma unroll
          for (int nt = 0; nt < kSkNTiles; ++nt) {
            if (nt < nt_live) mma_bf16(acc[mt][nt], ar, bw[nt][sk_b_word(s, 0)], bw[nt][sk_b_word(s, 1)]);
          }
        }
      }
    }
  }
  grid_dep_launch_dependents();

  // Split-K reduction in a fixed order: warp 0's partial + warp 1's + ... + warp 7's.
#pragma unroll
  for (int mt = 0; mt < kSkMTiles; ++mt) {
#pragma unroll
    for (int nt = 0; nt < kSkNTiles; ++nt) {
#pragma unroll
      for (int r = 0; r < 4; ++r) part[sk_part_index(warp, mt, nt, r, lane)] = acc[mt][nt][r];
    }
  }
  __syncthreads();
  for (int i = static_cast<int>(threadIdx.x); i < kSkElems * 32; i += kSkThreads) {
    float v = part[i];
#pragma unroll
    for (int w = 1; w < kSkWarps; ++w) v += part[w * kSkElems * 32 + i];
    part[i] = v;
  }
  __syncthreads();

  if constexpr (kFc1) {
    // Warp w: tokens w and w + 8 (when their n-tile is live); lane c: intermediate column 32 x + c.
    uint16_t* act_out = static_cast<uint16_t*>(out);  // [rows, N] BF16
    const int64_t col = static_cast<int64_t>(blockIdx.y) * kMxBlock + lane;
    bool exact = true;
    for (int t = warp; t < 8 * nt_live; t += kSkWarps) {
      const int gr = sk_fc1_gate_row(lane);
      const float gate = part[sk_reduced_index(t, gr)], up = part[sk_reduced_index(t, gr + 8)];
      const float v[1] = {activation_f32(act, expert, gate, up)};
      uint16_t h[1];
      if (recipe == Recipe::kW4A8) {
        MxBlockAmax block;  // the 32 columns of this token's MX block are the 32 lanes
        block.add(v[0]);
#pragma unroll
        for (int m = 1; m < 32; m <<= 1) {
          const float other_amax = __shfl_xor_sync(0xFFFFFFFFu, block.amax, m);
          const int other_nan = __shfl_xor_sync(0xFFFFFFFFu, static_cast<int>(block.nan), m);
          block.merge(other_amax, other_nan != 0);
        }
        const uint8_t sc = block.scale_code(MxElement::kE4M3, ScaleRule::kRceil);
        exact = mxfp8_bf16_operands(v, sc, h) && exact;  // the present path's values and status
      } else {
        h[0] = bf16_from_f32(v[0]);  // W4A16: the contract's BF16 rounding
      }
      act_out[(row0 + t) * d.n + col] = h[0];
    }
    if (!exact) atomicOr(status, kStatusInexactAct);
  } else {
    float* y = static_cast<float*>(out);  // [rows, K] FP32
    const int64_t col0 = mt0 * 16;
    const int cols = mt_live * 16;
    for (int i = static_cast<int>(threadIdx.x); i < 8 * nt_live * kSplitKRows; i += kSkThreads) {
      const int t = i / kSplitKRows, c = i % kSplitKRows;
      if (c < cols) y[(row0 + t) * d.k + col0 + c] = part[sk_reduced_index(t, c)];
    }
  }
}

template <typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), const Grid& g, cudaStream_t s, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(g.x, g.y, g.z);
  cfg.blockDim = dim3(kSkThreads, 1, 1);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
}

}  // namespace

cudaError_t launch_fc1_splitk(const Dims& d, Recipe recipe, const ActParams& act, const uint16_t* x_bf16,
                              const int32_t* row_token, const int32_t* tile_expert, const uint8_t* fc1_pq,
                              const uint32_t* fc1_ps, uint16_t* act_out, int* status, cudaStream_t s) {
  return launch_pdl(moe_splitk_kernel<true>, sk_grid(d, true), s, d, recipe, act, x_bf16, row_token, tile_expert,
                    fc1_pq, fc1_ps, static_cast<void*>(act_out), status);
}

cudaError_t launch_fc2_splitk(const Dims& d, const uint16_t* act_in, const int32_t* row_token,
                              const int32_t* tile_expert, const uint8_t* fc2_pq, const uint32_t* fc2_ps, float* y,
                              cudaStream_t s) {
  const ActParams none{ActivationKind::kSiLU, 0, 0, 0, nullptr, nullptr};
  return launch_pdl(moe_splitk_kernel<false>, sk_grid(d, false), s, d, Recipe::kW4A16, none, act_in, row_token,
                    tile_expert, fc2_pq, fc2_ps, static_cast<void*>(y), static_cast<int*>(nullptr));
}

}  // namespace k3::cuda::moe_detail
