// The two grouped GEMMs of MoePath::kPrefillSm90 on CUTLASS 4.2's sm90 ptr-array mixed-input
// mainloop (wgmma with the narrow operand converted in registers, TMA-fed shared memory,
// warp-specialized cooperative schedule, persistent grid over all groups' tiles).
//
// RAN ON AN H200 (sm_90, 2026-12-04: its CUDA tests and k3 validate pass; docs/cuda_moe.md, "First GPU run"). Compiled only when CMake found the CUTLASS headers (K3_HAVE_CUTLASS).
//
// Each GEMM computes, per local expert e (one group), D^T = W_e x X_e^T:
//   A = W_e   [M_w, K] E4M3 codes, row-major (K-major), with BF16 scales per 64 columns
//             (ConvertAndScale: converted to BF16 and scaled in registers; moe_grouped.hpp says
//             why the group is 64 columns and why E4M3, not E2M1)
//   B = X_e   the expert's BF16 operand rows [count_e, K] (K-major: "column-major" [K, count_e])
//   D = Y_e   FP32 rows [count_e, M_w] ("column-major" [M_w, count_e]): one output row per token row
// The group arrays are written on the device (build_groups_kernel) from the sort's counts; the
// host passes no problem shapes (nullptr), so the grid is the fixed persistent one and nothing on
// the host depends on M. No split-K / stream-K: every output element is one accumulator, summed
// in a fixed k order (deterministic).
//
// Arch guard: CUTLASS enables the sm90 kernel body for sm_90a and sm_120a; this file's own kernel
// wrapper (gemm_kernel) instantiates it only in the sm_90a device pass, so the sm_120a pass
// compiles empty kernels.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "cuda/common.cuh"
#include "cuda/moe/moe_grouped.cuh"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

namespace k3::cuda::moe_detail {
namespace {

Status internal(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }

using ElementW = cutlass::float_e4m3_t;
using ElementScale = cutlass::bfloat16_t;
using ElementX = cutlass::bfloat16_t;
using LayoutW = cutlass::layout::RowMajor;     // [M_w, K], K contiguous
using LayoutX = cutlass::layout::ColumnMajor;  // [K, rows], K contiguous (= operand rows)
using LayoutD = cutlass::layout::ColumnMajor;  // [M_w, rows], M_w contiguous (= FP32 output rows)
constexpr int kAlignW = 16;  // elements per 16-byte TMA access
constexpr int kAlignX = 8;
constexpr int kAlignD = 4;
// TileShapeK = kSm90ScaleGroup: the scale group must be a multiple of it (can_implement) and the
// BF16 main loop needs >= 4 MMA k-blocks of 16 (static_assert K_BLOCK_MAX >= 4).
using TileShape = cute::Shape<cute::_128, cute::_128, cute::Int<kSm90ScaleGroup>>;
using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD, float, LayoutD*, kAlignD,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cute::tuple<ElementW, ElementScale>, LayoutW*, kAlignW,
    ElementX, LayoutX*, kAlignX, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;

using StrideW = typename GemmKernel::InternalStrideA;
using StrideX = typename GemmKernel::InternalStrideB;
using StrideD = typename GemmKernel::InternalStrideD;
using StrideS = typename Mainloop::StrideScale;
using Shape3 = typename ProblemShape::UnderlyingProblemShape;

// The per-group arrays of one GEMM, carved from the workspace (each 16-byte aligned).
struct GroupArrays {
  Shape3* shapes;
  const ElementW** w;
  const ElementX** x;
  const ElementScale** s;
  float** d;
  StrideW* dw;
  StrideX* dx;
  StrideS* ds;
  StrideD* dd;
};

constexpr size_t align16(size_t v) { return (v + 15) / 16 * 16; }

size_t arrays_bytes_one(int e) {
  const size_t n = static_cast<size_t>(e);
  return align16(n * sizeof(Shape3)) + 4 * align16(n * sizeof(void*)) + align16(n * sizeof(StrideW)) +
         align16(n * sizeof(StrideX)) + align16(n * sizeof(StrideS)) + align16(n * sizeof(StrideD));
}

GroupArrays carve(char* p, int e) {
  const size_t n = static_cast<size_t>(e);
  GroupArrays a{};
  auto take = [&p](size_t bytes) {
    char* at = p;
    p += align16(bytes);
    return at;
  };
  a.shapes = reinterpret_cast<Shape3*>(take(n * sizeof(Shape3)));
  a.w = reinterpret_cast<const ElementW**>(take(n * sizeof(void*)));
  a.x = reinterpret_cast<const ElementX**>(take(n * sizeof(void*)));
  a.s = reinterpret_cast<const ElementScale**>(take(n * sizeof(void*)));
  a.d = reinterpret_cast<float**>(take(n * sizeof(void*)));
  a.dw = reinterpret_cast<StrideW*>(take(n * sizeof(StrideW)));
  a.dx = reinterpret_cast<StrideX*>(take(n * sizeof(StrideX)));
  a.ds = reinterpret_cast<StrideS*>(take(n * sizeof(StrideS)));
  a.dd = reinterpret_cast<StrideD*>(take(n * sizeof(StrideD)));
  return a;
}

struct GemmOperands {
  const uint8_t* w;
  const uint16_t* s;
  const uint16_t* x;
  float* d;
  int64_t m_w, k_red;
};

// Writes a stride's dynamic mode; a static one (the ptr-array batch stride _0) stays as it is.
template <class T, class V>
__device__ void set_dynamic(T&& mode, V v) {
  using M = cute::remove_cvref_t<T>;
  if constexpr (!cute::is_static_v<M>) mode = static_cast<M>(v);
}

// One thread per local expert: its group of GEMM1 and GEMM2 (grouped_entry, host-tested).
__global__ void build_groups_kernel(int e_local, const int32_t* __restrict__ counts, GemmOperands g1, GroupArrays a1,
                                    GemmOperands g2, GroupArrays a2) {
  const int e = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (e >= e_local) return;
  const int32_t count = counts[e], start = counts[e_local + e];
  for (int which = 0; which < 2; ++which) {
    const GemmOperands& g = which == 0 ? g1 : g2;
    const GroupArrays& a = which == 0 ? a1 : a2;
    const GroupedEntry q = grouped_entry(e, count, start, g.m_w, g.k_red);
    a.shapes[e] = Shape3{q.m, q.n, q.k};
    a.w[e] = reinterpret_cast<const ElementW*>(g.w + q.a_off);
    a.s[e] = reinterpret_cast<const ElementScale*>(g.s + q.s_off);
    a.x[e] = reinterpret_cast<const ElementX*>(g.x + q.b_off);
    a.d[e] = g.d + q.d_off;
    StrideW dw{};
    set_dynamic(cute::get<0>(dw), q.k);
    set_dynamic(cute::get<2>(dw), static_cast<int64_t>(q.m) * q.k);
    StrideX dx{};
    set_dynamic(cute::get<0>(dx), q.k);
    set_dynamic(cute::get<2>(dx), static_cast<int64_t>(q.n) * q.k);
    StrideS ds{};
    set_dynamic(cute::get<1>(ds), q.m);
    set_dynamic(cute::get<2>(ds), static_cast<int64_t>(q.m) * sm90_scale_groups(q.k));
    StrideD dd{};
    set_dynamic(cute::get<1>(dd), q.m);
    set_dynamic(cute::get<2>(dd), static_cast<int64_t>(q.m) * q.n);
    a.dw[e] = dw;
    a.dx[e] = dx;
    a.ds[e] = ds;
    a.dd[e] = dd;
  }
}

// The kernel entry: CUTLASS's sm90 body only in the sm_90a device pass (its own guard would also
// compile it for sm_120a, where this path never runs).
__global__ void __launch_bounds__(GemmKernel::MaxThreadsPerBlock, GemmKernel::MinBlocksPerMultiprocessor)
    gemm_kernel(CUTLASS_GRID_CONSTANT typename GemmKernel::Params const params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem[];
  GemmKernel op;
  op(params, smem);
#endif
}

typename GemmKernel::Arguments arguments(const Sm90GroupedIo& io, const GroupArrays& a) {
  typename GemmKernel::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = ProblemShape{io.d.e_local, a.shapes, nullptr};  // no host shapes: nothing depends on M
  args.mainloop.ptr_A = a.w;
  args.mainloop.dA = a.dw;
  args.mainloop.ptr_B = a.x;
  args.mainloop.dB = a.dx;
  args.mainloop.ptr_S = a.s;
  args.mainloop.dS = a.ds;
  args.mainloop.chunk_size = kSm90ScaleGroup;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = a.d;
  args.epilogue.dD = a.dd;
  args.hw_info.device_id = 0;  // unused: sm_count is given
  args.hw_info.sm_count = io.sm_count;
  return args;
}

Status run_gemm(const Sm90GroupedIo& io, const GroupArrays& a, void* ws, cudaStream_t s, const char* what) {
  const typename GemmKernel::Arguments args = arguments(io, a);
  const size_t need = GemmKernel::get_workspace_size(args);
  if (need > io.cutlass_ws_bytes / 2) {
    return internal(std::string("prefill-sm90 ") + what + ": CUTLASS asks for " + std::to_string(need) +
                          " B of workspace, the plan reserved " + std::to_string(io.cutlass_ws_bytes / 2) +
                          " B (sm_count " + std::to_string(io.sm_count) + "); raise kSm90CutlassWorkspacePerSm");
  }
  if (GemmKernel::initialize_workspace(args, ws, s) != cutlass::Status::kSuccess) {
    return internal(std::string("prefill-sm90 ") + what + ": CUTLASS initialize_workspace failed");
  }
  const typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, ws);
  const dim3 grid = GemmKernel::get_grid_shape(params), block = GemmKernel::get_block_shape();
  constexpr int kSmem = GemmKernel::SharedStorageSize;
  // A function attribute, not a stream operation: legal during graph capture.
  K3_CUDA_TRY(cudaFuncSetAttribute(gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
              "prefill-sm90 cudaFuncSetAttribute");
  gemm_kernel<<<grid, block, kSmem, s>>>(params);
  return detail::from_cuda(cudaGetLastError(), (std::string("prefill-sm90 ") + what + " launch").c_str());
}

GemmOperands gemm1_operands(const Sm90GroupedIo& io) {
  return {io.fc1_w, io.fc1_s, io.xg, io.h, 2 * io.d.n, io.d.k};
}
GemmOperands gemm2_operands(const Sm90GroupedIo& io) {
  return {io.fc2_w, io.fc2_s, io.act, io.y, io.d.k, io.d.n};
}

}  // namespace

size_t sm90_group_arrays_bytes(int e_local) { return 2 * arrays_bytes_one(e_local); }

size_t sm90_cutlass_workspace_bytes(int sm_count) {
  typename GemmKernel::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = ProblemShape{1, nullptr, nullptr};
  args.mainloop.chunk_size = kSm90ScaleGroup;
  args.hw_info.sm_count = sm_count;
  return 2 * GemmKernel::get_workspace_size(args);
}

Status launch_sm90_gemm1(const Sm90GroupedIo& io, cudaStream_t s) {
  if (io.arrays_bytes < sm90_group_arrays_bytes(io.d.e_local)) {
    return internal("prefill-sm90: the plan reserved " + std::to_string(io.arrays_bytes) +
                          " B for the group arrays, they need " + std::to_string(sm90_group_arrays_bytes(io.d.e_local)));
  }
  char* base = static_cast<char*>(io.arrays);
  const GroupArrays a1 = carve(base, io.d.e_local), a2 = carve(base + arrays_bytes_one(io.d.e_local), io.d.e_local);
  const int threads = 128, blocks = (io.d.e_local + threads - 1) / threads;
  build_groups_kernel<<<blocks, threads, 0, s>>>(io.d.e_local, io.counts, gemm1_operands(io), a1, gemm2_operands(io), a2);
  K3_RETURN_IF_ERROR(detail::from_cuda(cudaGetLastError(), "prefill-sm90 group arrays launch"));
  return run_gemm(io, a1, io.cutlass_ws, s, "GEMM1");
}

Status launch_sm90_gemm2(const Sm90GroupedIo& io, cudaStream_t s) {
  char* base = static_cast<char*>(io.arrays);
  const GroupArrays a2 = carve(base + arrays_bytes_one(io.d.e_local), io.d.e_local);
  return run_gemm(io, a2, static_cast<char*>(io.cutlass_ws) + io.cutlass_ws_bytes / 2, s, "GEMM2");
}

}  // namespace k3::cuda::moe_detail
