// The w4a8-sm120-cutlass path (moe_sm120_path.cuh). NEVER RUN ON ANY GPU.
#include "cuda/moe/moe_sm120_path.cuh"

#include <algorithm>
#include <string>

#include "cuda/common.cuh"
#include "k3/formats.hpp"
#if defined(K3_HAVE_CUTLASS)
#include "cuda_cutlass/moe_sm120_blockscaled.cuh"
#include "cuda_cutlass/moe_sm120_blockscaled_layout.hpp"
#endif

namespace k3::cuda::moe_detail {

#if defined(K3_HAVE_CUTLASS)

struct Sm120PathState {
  detail::DeviceBuffer<int32_t> counts;  // [E_local]: a copy of the sort's counts (the GEMMs' fixed operand)
  detail::DeviceBuffer<uint8_t> w1_codes, w1_sf, w2_codes, w2_sf;
  detail::DeviceBuffer<float> x_compact, act_compact, d1, d2;
  detail::DeviceBuffer<uint8_t> a1_codes, a1_sf, a2_codes, a2_sf;
  sm120_bs::GroupedGemm gemm1, gemm2;
};

void Sm120PathDeleter::operator()(Sm120PathState* s) const { delete s; }

namespace {

constexpr int kThreads = 256;

// Where permuted row r of the sort goes in the GEMMs' compact order: expert e = tile_expert[r /
// block_m], its index in the expert i = r - padded_offset[e]. -1 for padding rows.
__device__ __forceinline__ int64_t compact_index(const Dims& d, int64_t r, const int32_t* row_token,
                                                 const int32_t* tile_expert, const int32_t* padded_offset,
                                                 const int64_t* compact_start, int* expert, int64_t* local) {
  if (row_token[r] < 0) return -1;
  const int e = tile_expert[r / d.block_m];
  if (e < 0) return -1;
  *expert = e;
  *local = r - padded_offset[e];
  return compact_start[e] + *local;
}

__global__ void gather_compact_kernel(Dims d, const int32_t* __restrict__ row_token,
                                      const int32_t* __restrict__ tile_expert, const int32_t* __restrict__ padded_offset,
                                      const int64_t* __restrict__ compact_start, const uint16_t* __restrict__ x,
                                      float* __restrict__ xc) {
  const int64_t total = d.max_tiles * d.block_m * d.k;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / d.k, c = i % d.k;
    int e = 0;
    int64_t local = 0;
    const int64_t dst = compact_index(d, r, row_token, tile_expert, padded_offset, compact_start, &e, &local);
    if (dst < 0) continue;
    xc[dst * d.k + c] = bf16_to_f32(x[static_cast<int64_t>(row_token[r]) * d.k + c]);
  }
}

__global__ void act_compact_kernel(Dims d, ActParams p, const int32_t* __restrict__ row_token,
                                   const int32_t* __restrict__ tile_expert, const int32_t* __restrict__ padded_offset,
                                   const int64_t* __restrict__ compact_start, const int64_t* __restrict__ padded_start,
                                   const float* __restrict__ d1, float* __restrict__ act) {
  const int64_t total = d.max_tiles * d.block_m * d.n;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / d.n, c = i % d.n;
    int e = 0;
    int64_t local = 0;
    const int64_t dst = compact_index(d, r, row_token, tile_expert, padded_offset, compact_start, &e, &local);
    if (dst < 0) continue;
    const float* h = d1 + (padded_start[e] + local) * 2 * d.n;  // [gate | up] of this row
    act[dst * d.n + c] = activation_f32(p, e, h[c], h[d.n + c]);
  }
}

__global__ void scatter_y_kernel(Dims d, const int32_t* __restrict__ row_token, const int32_t* __restrict__ tile_expert,
                                 const int32_t* __restrict__ padded_offset, const int64_t* __restrict__ padded_start,
                                 const float* __restrict__ d2, float* __restrict__ y) {
  const int64_t total = d.max_tiles * d.block_m * d.k;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / d.k, c = i % d.k;
    if (row_token[r] < 0) continue;
    const int e = tile_expert[r / d.block_m];
    if (e < 0) continue;
    y[r * d.k + c] = d2[(padded_start[e] + r - padded_offset[e]) * d.k + c];
  }
}

unsigned blocks_for(int64_t items, int sm_count) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((items + kThreads - 1) / kThreads,
                                                                        int64_t{sm_count} * 16)));
}

template <typename T>
Status upload(detail::DeviceBuffer<T>& dst, const std::vector<T>& src, const char* what) {
  K3_RETURN_IF_ERROR(dst.allocate(src.size()));
  return detail::from_cuda(cudaMemcpy(dst.get(), src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice), what);
}

}  // namespace

Result<Sm120Path> sm120_path_prepack(const MoePlan& plan, const MoeWeightsView& w) {
  const auto& sh = plan.problem.shape;
  const int64_t e = sh.local_experts(), k = sh.hidden, n = sh.intermediate;
  K3_ASSIGN_OR_RETURN(auto p1, sm120_bs::prepack_weights(w.fc1_q, w.fc1_scale, e, 2 * n, k));
  K3_ASSIGN_OR_RETURN(auto p2, sm120_bs::prepack_weights(w.fc2_q, w.fc2_scale, e, k, n));
  Sm120Path st(new Sm120PathState);
  K3_RETURN_IF_ERROR(upload(st->w1_codes, p1.codes, "copy fc1 codes (sm120)"));
  K3_RETURN_IF_ERROR(upload(st->w1_sf, p1.sf, "copy fc1 scales (sm120)"));
  K3_RETURN_IF_ERROR(upload(st->w2_codes, p2.codes, "copy fc2 codes (sm120)"));
  K3_RETURN_IF_ERROR(upload(st->w2_sf, p2.sf, "copy fc2 scales (sm120)"));
  const int64_t rows = plan.max_slots;  // every slot may be local
  const int64_t cap = sm120_bs::row_capacity(rows, e);
  K3_RETURN_IF_ERROR(st->counts.allocate(static_cast<size_t>(e)));
  K3_RETURN_IF_ERROR(st->x_compact.allocate(static_cast<size_t>(rows * k)));
  K3_RETURN_IF_ERROR(st->act_compact.allocate(static_cast<size_t>(rows * n)));
  K3_RETURN_IF_ERROR(st->d1.allocate(static_cast<size_t>(cap * 2 * n)));
  K3_RETURN_IF_ERROR(st->d2.allocate(static_cast<size_t>(cap * k)));
  K3_RETURN_IF_ERROR(st->a1_codes.allocate(static_cast<size_t>(cap * k)));
  K3_RETURN_IF_ERROR(st->a1_sf.allocate(static_cast<size_t>(sm120_bs::sf_bytes(cap, k))));
  K3_RETURN_IF_ERROR(st->a2_codes.allocate(static_cast<size_t>(cap * n)));
  K3_RETURN_IF_ERROR(st->a2_sf.allocate(static_cast<size_t>(sm120_bs::sf_bytes(cap, n))));
  const sm120_bs::GemmShape g1{static_cast<int>(e), 2 * n, k, cap, plan.sm_count};
  const sm120_bs::GemmShape g2{static_cast<int>(e), k, n, cap, plan.sm_count};
  const sm120_bs::GemmOperands o1{st->counts.get(), st->a1_codes.get(), st->a1_sf.get(),
                                  st->w1_codes.get(), st->w1_sf.get(),  st->d1.get()};
  const sm120_bs::GemmOperands o2{st->counts.get(), st->a2_codes.get(), st->a2_sf.get(),
                                  st->w2_codes.get(), st->w2_sf.get(),  st->d2.get()};
  K3_ASSIGN_OR_RETURN(st->gemm1, sm120_bs::GroupedGemm::create(g1, o1));
  K3_ASSIGN_OR_RETURN(st->gemm2, sm120_bs::GroupedGemm::create(g2, o2));
  return std::move(st);
}

Status sm120_path_run(const MoePlan& plan, const Sm120PathState& st, const ActParams& act, const uint16_t* x,
                      const int32_t* counts, const int32_t* row_token, const int32_t* tile_expert, float* y,
                      cudaStream_t s) {
  const Dims d = dims_of(plan);
  const int32_t* padded_offset = counts + d.e_local;
  K3_CUDA_TRY(cudaMemcpyAsync(st.counts.get(), counts, sizeof(int32_t) * static_cast<size_t>(d.e_local),
                              cudaMemcpyDeviceToDevice, s),
              "w4a8-sm120-cutlass counts");
  K3_RETURN_IF_ERROR(st.gemm1.setup(s));
  K3_RETURN_IF_ERROR(st.gemm2.setup(s));
  const int64_t rows = d.max_tiles * d.block_m;
  gather_compact_kernel<<<blocks_for(rows * d.k, plan.sm_count), kThreads, 0, s>>>(
      d, row_token, tile_expert, padded_offset, st.gemm1.compact_start(), x, st.x_compact.get());
  K3_RETURN_IF_ERROR(st.gemm1.quantize_a(st.x_compact.get(), s));
  K3_RETURN_IF_ERROR(st.gemm1.gemm(s));
  act_compact_kernel<<<blocks_for(rows * d.n, plan.sm_count), kThreads, 0, s>>>(
      d, act, row_token, tile_expert, padded_offset, st.gemm1.compact_start(), st.gemm1.padded_start(), st.d1.get(),
      st.act_compact.get());
  K3_RETURN_IF_ERROR(st.gemm2.quantize_a(st.act_compact.get(), s));
  K3_RETURN_IF_ERROR(st.gemm2.gemm(s));
  scatter_y_kernel<<<blocks_for(rows * d.k, plan.sm_count), kThreads, 0, s>>>(
      d, row_token, tile_expert, padded_offset, st.gemm2.padded_start(), st.d2.get(), y);
  return detail::from_cuda(cudaGetLastError(), "w4a8-sm120-cutlass launch");
}

#else  // no CUTLASS headers at build time

struct Sm120PathState {};
void Sm120PathDeleter::operator()(Sm120PathState* s) const { delete s; }

Result<Sm120Path> sm120_path_prepack(const MoePlan&, const MoeWeightsView&) {
  return unsupported("the w4a8-sm120-cutlass path is not in this build (the CUTLASS headers were missing)");
}

Status sm120_path_run(const MoePlan&, const Sm120PathState&, const ActParams&, const uint16_t*, const int32_t*,
                      const int32_t*, const int32_t*, float*, cudaStream_t) {
  return unsupported("the w4a8-sm120-cutlass path is not in this build (the CUTLASS headers were missing)");
}

#endif

}  // namespace k3::cuda::moe_detail
