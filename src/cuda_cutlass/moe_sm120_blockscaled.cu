// The sm_120a W4A8 grouped GEMM building block on CUTLASS 4.2's sm120 block-scaled collective:
// MXFP8 (E4M3 + UE8M0 per 32) activations x MXFP4 (E2M1 + UE8M0 per 32) weights -> FP32, one
// group per local expert, ptr-array (grouped) cooperative warp-specialized kernel with TMA.
//
// STATUS: NOT YET RUN ON A GPU. No machine here has an sm_120 GPU; this TU is only compiled.
// Every kernel body exists for sm_120a only (__CUDA_ARCH_FEAT_SM120_ALL); the sm_90a pass
// compiles empty stubs, and create() refuses any device that is not sm_120.
//
// Graph safety: the CUTLASS kernel parameters (TMA descriptor templates, pointers to the
// per-group argument arrays) are built once in create(); setup() derives every per-group
// problem shape, pointer, stride and scale layout on the device from the device-resident row
// counts (host problem shapes = nullptr), so a captured graph replays with new counts. Grids are
// fixed (setup: 1 block; quantize_a: by capacity; GEMM: the persistent grid of sm_count CTAs).
#include "cuda_cutlass/moe_sm120_blockscaled.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <utility>

#include "cuda/common.cuh"
#include "cuda_cutlass/moe_sm120_blockscaled_layout.hpp"
#include "k3/cuda.hpp"
#include "k3/cuda_sm120.hpp"
#include "k3/mx.hpp"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/sm100_blockscaled_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM120_ALL)
#define K3_SM120_BS_DEVICE 1
#else
#define K3_SM120_BS_DEVICE 0
#endif

namespace k3::cuda::sm120_bs {
namespace {

using namespace cute;

// ---- the one CUTLASS configuration -----------------------------------------------------------

using ElementA = cutlass::mx_float8_t<cutlass::float_e4m3_t>;
using ElementB = cutlass::mx_float4_t<cutlass::float_e2m1_t>;
using LayoutA = cutlass::layout::RowMajor;     // [rows, k], K-major
using LayoutB = cutlass::layout::ColumnMajor;  // B^T stored [n_out, k], K-major
using LayoutD = cutlass::layout::RowMajor;
using ElementD = float;
using ElementAcc = float;
constexpr int kAlignA = 16;   // 16 bytes of E4M3
constexpr int kAlignB = 128;  // E2M1 next to an 8-bit operand: CUTLASS's TMA needs 128 elements (64 bytes)
constexpr int kAlignD = 4;    // 16 bytes of FP32
using TileShape = Shape<_128, _128, _128>;  // N 64 is refused (SFB TMA needs 128-row SF atoms)
using ClusterShape = Shape<_1, _1, _1>;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // per group (M, N, K)

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm120, cutlass::arch::OpClassBlockScaledTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementAcc, void, LayoutD*, kAlignD, ElementD,
    LayoutD*, kAlignD, cutlass::epilogue::collective::EpilogueScheduleAuto>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm120, cutlass::arch::OpClassBlockScaledTensorOp, ElementA, LayoutA*, kAlignA, ElementB, LayoutB*,
    kAlignB, ElementAcc, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Params = typename GemmKernel::Params;
using Arguments = typename GemmKernel::Arguments;

using UnderlyingShape = typename ProblemShape::UnderlyingProblemShape;
using StrideA = typename GemmKernel::InternalStrideA;
using StrideB = typename GemmKernel::InternalStrideB;
using StrideD = typename GemmKernel::InternalStrideD;
using LayoutSFA = typename CollectiveMainloop::InternalLayoutSFA;
using LayoutSFB = typename CollectiveMainloop::InternalLayoutSFB;
using SfConfig = typename CollectiveMainloop::Sm1xxBlkScaledConfig;
using ElemA = typename CollectiveMainloop::ElementA;    // float_e4m3_t
using ElemB = typename CollectiveMainloop::ElementB;    // float_e2m1_t
using ElemSF = typename CollectiveMainloop::ElementSF;  // float_ue8m0_t

static_assert(SfConfig::SFVecSize == kMxBlock, "MX blocks are 32 elements");
static_assert(cute::is_same_v<ElemSF, cutlass::float_ue8m0_t>, "scales are UE8M0");
template <class Stride>
CUTE_HOST_DEVICE Stride leading_stride(int64_t ld) {
  Stride s{};
  cute::get<0>(s) = ld;
  return s;
}

// ---- device-side per-group arrays ------------------------------------------------------------

struct GroupArrays {
  UnderlyingShape* shapes;
  const ElemA** ptr_a;
  const ElemB** ptr_b;
  const ElemSF** ptr_sfa;
  const ElemSF** ptr_sfb;
  ElementD** ptr_d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
  int32_t* rows;
  int64_t* padded_start;   // [groups + 1]
  int64_t* compact_start;  // [groups + 1]
  int32_t* status;
};

struct SetupArgs {
  GroupArrays arr;
  GemmShape shape;
  GemmOperands ops;
};

constexpr int kSetupThreads = 256;
constexpr int kQuantThreads = 256;

// One block: counts -> placement (thread 0, groups in order, deterministic) -> per-group arrays.
__global__ void __launch_bounds__(kSetupThreads) setup_kernel(const SetupArgs a) {
#if K3_SM120_BS_DEVICE
  __shared__ int32_t s_counts[kMaxGroups];
  const int groups = a.shape.groups;
  for (int g = threadIdx.x; g < groups; g += blockDim.x) s_counts[g] = a.ops.counts[g];
  __syncthreads();
  if (threadIdx.x == 0) {
    bool overflow = false;
    place_groups(s_counts, groups, a.shape.row_capacity, a.arr.rows, a.arr.padded_start, a.arr.compact_start,
                 &overflow);
    *a.arr.status = overflow ? kStatusRowOverflow : 0;
  }
  __syncthreads();
  const int64_t n = a.shape.n_out, k = a.shape.k;
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    const int m = a.arr.rows[g];
    const int64_t start = a.arr.padded_start[g];
    a.arr.shapes[g] = UnderlyingShape{m, static_cast<int>(n), static_cast<int>(k)};
    a.arr.ptr_a[g] = reinterpret_cast<const ElemA*>(a.ops.a_codes + start * k);
    a.arr.ptr_sfa[g] = reinterpret_cast<const ElemSF*>(a.ops.a_sf + group_sf_offset(start, k));
    a.arr.ptr_b[g] = reinterpret_cast<const ElemB*>(a.ops.b_codes + g * weight_code_bytes(n, k));
    a.arr.ptr_sfb[g] = reinterpret_cast<const ElemSF*>(a.ops.b_sf + g * weight_sf_bytes(n, k));
    a.arr.ptr_d[g] = a.ops.d + start * n;
    a.arr.stride_a[g] = leading_stride<StrideA>(k);
    a.arr.stride_b[g] = leading_stride<StrideB>(k);
    a.arr.stride_d[g] = leading_stride<StrideD>(n);
    a.arr.layout_sfa[g] = SfConfig::tile_atom_to_shape_SFA(cute::make_shape(m, static_cast<int>(n), static_cast<int>(k), 1));
    a.arr.layout_sfb[g] = SfConfig::tile_atom_to_shape_SFB(cute::make_shape(m, static_cast<int>(n), static_cast<int>(k), 1));
  }
#endif
}

// One thread per (padded row, 32-block): MXFP8 (RCEIL, k3/mx.hpp's codec) of the group's
// compact FP32 row, or zero codes and scale 0 on padding rows.
__global__ void __launch_bounds__(kQuantThreads) quantize_a_kernel(const float* x, GroupArrays arr, int groups,
                                                                   int64_t capacity, int64_t k, uint8_t* a_codes,
                                                                   uint8_t* a_sf) {
#if K3_SM120_BS_DEVICE
  const int64_t kb = k / kMxBlock;
  const int64_t total = capacity * kb;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / kb, b = i % kb;
    // Last group whose padded start is <= r (binary search over groups + 1 starts).
    int lo = 0, hi = groups;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (arr.padded_start[mid] <= r) lo = mid;
      else hi = mid - 1;
    }
    const int g = lo;
    const int64_t local = r - arr.padded_start[g];
    uint8_t* codes = a_codes + r * k + b * kMxBlock;  // 32-byte aligned: k % 128 == 0
    uint8_t scale = 0;
    if (g < groups && local < arr.rows[g]) {
      scale = mx_quantize_block(x + (arr.compact_start[g] + local) * k + b * kMxBlock, MxElement::kE4M3,
                                ScaleRule::kRceil, codes);
    } else {
      uint4* dst = reinterpret_cast<uint4*>(codes);
      dst[0] = make_uint4(0, 0, 0, 0);
      dst[1] = make_uint4(0, 0, 0, 0);
    }
    a_sf[sf_offset(r, b, k)] = scale;
  }
#endif
}

// CUTLASS's kernel, entered only in the sm_120a pass.
__global__ void __launch_bounds__(GemmKernel::MaxThreadsPerBlock, GemmKernel::MinBlocksPerMultiprocessor)
    gemm_kernel(const __grid_constant__ Params params) {
#if K3_SM120_BS_DEVICE
  extern __shared__ char smem[];
  GemmKernel op;
  op(params, smem);
#endif
}

template <typename T>
Status alloc(detail::DeviceBuffer<T>& b, size_t n) {
  return b.allocate(n);
}

}  // namespace

struct GroupedGemm::Impl {
  GemmShape shape;
  GemmOperands ops;
  detail::DeviceBuffer<UnderlyingShape> shapes;
  detail::DeviceBuffer<const ElemA*> ptr_a;
  detail::DeviceBuffer<const ElemB*> ptr_b;
  detail::DeviceBuffer<const ElemSF*> ptr_sfa, ptr_sfb;
  detail::DeviceBuffer<ElementD*> ptr_d;
  detail::DeviceBuffer<StrideA> stride_a;
  detail::DeviceBuffer<StrideB> stride_b;
  detail::DeviceBuffer<StrideD> stride_d;
  detail::DeviceBuffer<LayoutSFA> layout_sfa;
  detail::DeviceBuffer<LayoutSFB> layout_sfb;
  detail::DeviceBuffer<int32_t> rows, status;
  detail::DeviceBuffer<int64_t> padded_start, compact_start;
  detail::DeviceBuffer<uint8_t> cutlass_workspace;
  GroupArrays arr{};
  Params params{};
  dim3 grid, block;
  int smem_bytes = 0;
  unsigned quant_blocks = 0;
};

GroupedGemm::GroupedGemm() = default;
GroupedGemm::GroupedGemm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GroupedGemm::GroupedGemm(GroupedGemm&&) noexcept = default;
GroupedGemm& GroupedGemm::operator=(GroupedGemm&&) noexcept = default;
GroupedGemm::~GroupedGemm() = default;

const int64_t* GroupedGemm::padded_start() const { return impl_->padded_start.get(); }
const int64_t* GroupedGemm::compact_start() const { return impl_->compact_start.get(); }
const int32_t* GroupedGemm::status() const { return impl_->status.get(); }

Result<GroupedGemm> GroupedGemm::create(const GemmShape& shape, const GemmOperands& ops) {
  K3_RETURN_IF_ERROR(check_shape(shape.groups, shape.n_out, shape.k));
  if (shape.row_capacity < kRowAlign || shape.row_capacity % kRowAlign != 0) {
    return invalid_argument("sm120 block-scaled GEMM: row_capacity = " + std::to_string(shape.row_capacity) +
                            " must be a positive multiple of " + std::to_string(kRowAlign) + " (see row_capacity())");
  }
  if (shape.row_capacity > (int64_t{1} << 31) / shape.k) {
    return invalid_argument("sm120 block-scaled GEMM: row_capacity x k = " +
                            std::to_string(shape.row_capacity * shape.k) + " must stay below 2^31");
  }
  if (shape.sm_count < 1) {
    return invalid_argument("sm120 block-scaled GEMM: sm_count = " + std::to_string(shape.sm_count) + " must be >= 1");
  }
  if (!ops.counts || !ops.a_codes || !ops.a_sf || !ops.b_codes || !ops.b_sf || !ops.d) {
    return invalid_argument("sm120 block-scaled GEMM: every operand pointer (counts, a_codes, a_sf, b_codes, b_sf, d) is required");
  }
  if (!has_sm120_blockscaled_gemm()) {
    return unavailable("sm120 block-scaled GEMM: this build does not contain sm_120a kernels (K3_CUDA_ARCHS = " +
                       compiled_archs() + "); rebuild with 120a");
  }
  int dev = 0, major = 0, minor = 0;
  K3_CUDA_TRY(cudaGetDevice(&dev), "cudaGetDevice");
  K3_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute");
  K3_CUDA_TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "cudaDeviceGetAttribute");
  if (major != 12 || minor != 0) {
    return unavailable("sm120 block-scaled GEMM: device " + std::to_string(dev) + " is sm_" + std::to_string(major) +
                       std::to_string(minor) + ", but the kernel is built for sm_120a only");
  }

  auto im = std::make_unique<Impl>();
  im->shape = shape;
  im->ops = ops;
  const size_t g = static_cast<size_t>(shape.groups);
  K3_RETURN_IF_ERROR(alloc(im->shapes, g));
  K3_RETURN_IF_ERROR(alloc(im->ptr_a, g));
  K3_RETURN_IF_ERROR(alloc(im->ptr_b, g));
  K3_RETURN_IF_ERROR(alloc(im->ptr_sfa, g));
  K3_RETURN_IF_ERROR(alloc(im->ptr_sfb, g));
  K3_RETURN_IF_ERROR(alloc(im->ptr_d, g));
  K3_RETURN_IF_ERROR(alloc(im->stride_a, g));
  K3_RETURN_IF_ERROR(alloc(im->stride_b, g));
  K3_RETURN_IF_ERROR(alloc(im->stride_d, g));
  K3_RETURN_IF_ERROR(alloc(im->layout_sfa, g));
  K3_RETURN_IF_ERROR(alloc(im->layout_sfb, g));
  K3_RETURN_IF_ERROR(alloc(im->rows, g));
  K3_RETURN_IF_ERROR(alloc(im->status, 1));
  K3_RETURN_IF_ERROR(alloc(im->padded_start, g + 1));
  K3_RETURN_IF_ERROR(alloc(im->compact_start, g + 1));
  im->arr = GroupArrays{im->shapes.get(),     im->ptr_a.get(),      im->ptr_b.get(),    im->ptr_sfa.get(),
                        im->ptr_sfb.get(),    im->ptr_d.get(),      im->stride_a.get(), im->stride_b.get(),
                        im->stride_d.get(),   im->layout_sfa.get(), im->layout_sfb.get(), im->rows.get(),
                        im->padded_start.get(), im->compact_start.get(), im->status.get()};

  cutlass::KernelHardwareInfo hw;
  hw.device_id = dev;
  hw.sm_count = shape.sm_count;
  Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = ProblemShape{shape.groups, im->shapes.get(), nullptr};  // no host shapes: read on device
  args.mainloop.ptr_A = im->ptr_a.get();
  args.mainloop.dA = im->stride_a.get();
  args.mainloop.ptr_B = im->ptr_b.get();
  args.mainloop.dB = im->stride_b.get();
  args.mainloop.ptr_SFA = im->ptr_sfa.get();
  args.mainloop.layout_SFA = im->layout_sfa.get();
  args.mainloop.ptr_SFB = im->ptr_sfb.get();
  args.mainloop.layout_SFB = im->layout_sfb.get();
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = im->ptr_d.get();
  args.epilogue.dD = im->stride_d.get();
  args.hw_info = hw;
  if (GemmKernel::can_implement(args) != true) {
    return invalid_argument("sm120 block-scaled GEMM: CUTLASS's can_implement refused the configuration");
  }
  const size_t ws = GemmKernel::get_workspace_size(args);
  K3_RETURN_IF_ERROR(alloc(im->cutlass_workspace, ws));
  if (GemmKernel::initialize_workspace(args, im->cutlass_workspace.get(), nullptr) != cutlass::Status::kSuccess) {
    return unavailable("sm120 block-scaled GEMM: CUTLASS's initialize_workspace failed");
  }
  im->params = GemmKernel::to_underlying_arguments(args, im->cutlass_workspace.get());
  im->grid = GemmKernel::get_grid_shape(im->params);
  im->block = GemmKernel::get_block_shape();
  im->smem_bytes = GemmKernel::SharedStorageSize;
  K3_CUDA_TRY(cudaFuncSetAttribute(gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, im->smem_bytes),
              "cudaFuncSetAttribute(sm120 block-scaled GEMM)");
  const int64_t items = shape.row_capacity * (shape.k / kMxBlock);
  im->quant_blocks = static_cast<unsigned>(std::min<int64_t>((items + kQuantThreads - 1) / kQuantThreads,
                                                             int64_t{shape.sm_count} * 8));
  return GroupedGemm(std::move(im));
}

Status GroupedGemm::setup(void* stream) const {
  const SetupArgs a{impl_->arr, impl_->shape, impl_->ops};
  setup_kernel<<<1, kSetupThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  return detail::from_cuda(cudaGetLastError(), "sm120 block-scaled GEMM setup launch");
}

Status GroupedGemm::quantize_a(const float* x_compact, void* stream) const {
  if (!x_compact) return invalid_argument("sm120 block-scaled GEMM: x_compact is null");
  quantize_a_kernel<<<impl_->quant_blocks, kQuantThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      x_compact, impl_->arr, impl_->shape.groups, impl_->shape.row_capacity, impl_->shape.k, impl_->ops.a_codes,
      impl_->ops.a_sf);
  return detail::from_cuda(cudaGetLastError(), "sm120 block-scaled GEMM quantize_a launch");
}

Status GroupedGemm::gemm(void* stream) const {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = impl_->grid;
  cfg.blockDim = impl_->block;
  cfg.dynamicSmemBytes = static_cast<size_t>(impl_->smem_bytes);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return detail::from_cuda(cudaLaunchKernelEx(&cfg, gemm_kernel, impl_->params), "sm120 block-scaled GEMM launch");
}

}  // namespace k3::cuda::sm120_bs
