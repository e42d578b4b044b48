// Host side of the CUDA fused-MoE backend: device capabilities, prepack, run, run_host.
// The sm_90 paths ran on an H200 (2026-12-04; docs/cuda_moe.md, "First GPU run"); the sm_120
// path never ran.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/moe/moe_grouped.cuh"
#include "cuda/moe/moe_kernels.cuh"
#include "cuda/moe/moe_sm120_path.cuh"
#include "cuda/moe/moe_pack.hpp"
#include "k3/cuda.hpp"
#include "k3/cuda_moe.hpp"
#include "k3/cuda_sm120.hpp"
#include "k3/mx.hpp"

namespace k3::cuda {

struct DeviceWeights::Impl {
  detail::DeviceBuffer<uint8_t> fc1_q, fc1_scale, fc2_q, fc2_scale;
  detail::DeviceBuffer<float> situ_beta, situ_linear_beta;
  // decode-splitk plans: the fragment-native layout (moe_pack.hpp) instead of the checkpoint one.
  bool splitk = false;
  detail::DeviceBuffer<uint8_t> fc1_pq, fc2_pq;
  detail::DeviceBuffer<uint32_t> fc1_ps, fc2_ps;
  // prefill-sm90: the weights re-encoded as E4M3 codes with BF16 scales per 64 columns
  // (moe_grouped.hpp); sm90_ready false = not made (other paths) or not encodable (run falls back
  // to the prefill kernels when the plan chose prefill-sm90 itself).
  bool sm90_ready = false;
  detail::DeviceBuffer<uint8_t> fc1_e4m3, fc2_e4m3;
  detail::DeviceBuffer<uint16_t> fc1_s90, fc2_s90;
  // w4a8-sm120-cutlass: CUTLASS's layouts, the scratch and both GEMMs (moe_sm120_path.cuh).
  moe_detail::Sm120Path sm120;
};

DeviceWeights::DeviceWeights() = default;
DeviceWeights::DeviceWeights(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DeviceWeights::~DeviceWeights() = default;
DeviceWeights::DeviceWeights(DeviceWeights&&) noexcept = default;
DeviceWeights& DeviceWeights::operator=(DeviceWeights&&) noexcept = default;

namespace {

std::vector<int> compiled_arch_numbers() {
  std::vector<int> out;
  const std::string s = compiled_archs();
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t next = s.find(',', pos);
    out.push_back(std::atoi(s.substr(pos, next - pos).c_str()));
    if (next == std::string::npos) break;
    pos = next + 1;
  }
  return out;
}

template <typename T>
Status upload(detail::DeviceBuffer<T>& dst, std::span<const T> src, const char* what) {
  K3_RETURN_IF_ERROR(dst.allocate(src.size()));
  return detail::from_cuda(cudaMemcpy(dst.get(), src.data(), src.size_bytes(), cudaMemcpyHostToDevice), what);
}

// Every nonzero weight must dequantize to a normal BF16 for the register dequantization to be exact.
Status check_exact(std::span<const uint8_t> q, std::span<const uint8_t> s, int64_t rows, int64_t cols, const char* what) {
  if (auto bad = mx_find_bf16_inexact_block(q, s, rows, cols, MxElement::kE2M1)) {
    return {StatusCode::kInexact, std::string(what) + ": " + bad->to_string() +
                                      " leaves BF16's normal range; the CUDA path dequantizes to BF16 and would round. "
                                      "Use --backend cpu"};
  }
  return Status::ok();
}

// fn(x) for every x in [0, count), on up to hardware_concurrency() host threads. The packing and
// re-encoding of the experts' weights is independent per expert and took seconds per call when
// serial at Kimi shapes (the first H200 window, 2026-12-04, spent its bench time there).
template <class Fn>
void for_each_expert(int64_t count, Fn fn) {
  const int64_t threads = std::clamp<int64_t>(static_cast<int64_t>(std::thread::hardware_concurrency()), 1,
                                              std::max<int64_t>(count, 1));
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    for (int64_t x = next++; x < count; x = next++) fn(x);
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

// prefill-sm90 operands of one weight tensor [E_local, rows, cols]: E4M3 codes [E_local, rows, cols]
// and BF16 group scales [E_local, ceil(cols/64), rows] (MN-major, as the GEMM reads them). Returns
// an error naming the first row and group whose MX block exponents are too far apart.
Status sm90_encode(std::span<const uint8_t> q, std::span<const uint8_t> s, int64_t e, int64_t rows, int64_t cols,
                   std::vector<uint8_t>& codes, std::vector<uint16_t>& scales, const char* what) {
  const int64_t groups = moe_detail::sm90_scale_groups(cols);
  codes.assign(static_cast<size_t>(e * rows * cols), 0);
  scales.assign(static_cast<size_t>(e * groups * rows), 0);
  // Per expert: its first row that does not encode and the group (-1: none). Experts in parallel;
  // the error names the lowest expert's first bad row, as the serial loop did.
  std::vector<std::pair<int64_t, int64_t>> first_bad(static_cast<size_t>(e), {-1, -1});
  for_each_expert(e, [&](int64_t x) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = x * rows + r;
      const int64_t bad = moe_detail::sm90_encode_row(q.data() + row * (cols / 2), s.data() + row * (cols / kMxBlock),
                                                      cols, codes.data() + row * cols,
                                                      scales.data() + x * groups * rows + r, rows);
      if (bad >= 0) {
        first_bad[static_cast<size_t>(x)] = {r, bad};
        return;
      }
    }
  });
  for (int64_t x = 0; x < e; ++x) {
    const auto [r, bad] = first_bad[static_cast<size_t>(x)];
    if (bad >= 0) {
      return unsupported(std::string(what) + ": local expert " + std::to_string(x) + ", row " + std::to_string(r) +
                         ", columns [" + std::to_string(bad * moe_detail::kSm90ScaleGroup) + ", " +
                         std::to_string(std::min(cols, (bad + 1) * moe_detail::kSm90ScaleGroup)) +
                         "): the MX block scales are more than 14 binades apart, which the prefill-sm90 path's "
                         "E4M3 codes under one BF16 scale per 64 columns cannot hold exactly; use path prefill");
    }
  }
  return Status::ok();
}

}  // namespace

Result<DeviceCaps> device_caps(int device) {
  auto devs = devices();
  if (!devs.is_ok()) return devs.status();
  if (device < 0 || device >= static_cast<int>(devs.value().size())) {
    return invalid_argument("device = " + std::to_string(device) + " must be in [0, " +
                            std::to_string(devs.value().size()) + ")");
  }
  const auto& info = devs.value()[device];
  DeviceCaps caps;
  caps.name = info.name;
  caps.cc_major = info.cc_major;
  caps.cc_minor = info.cc_minor;
  caps.sm_count = info.sm_count;
  int smem = 0;
  K3_CUDA_TRY(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute");
  caps.smem_per_block_optin = smem;
  caps.compiled_archs = compiled_arch_numbers();
  caps.has_sm90_grouped = moe_detail::sm90_grouped_built();
  caps.has_sm120_blockscaled = has_sm120_blockscaled_gemm();
  return caps;
}

Result<DeviceWeights> prepack(const MoePlan& plan, const MoeWeightsView& w) {
  const auto& sh = plan.problem.shape;
  const int64_t e = sh.local_experts(), k = sh.hidden, n = sh.intermediate;
  MoeInputsView none;
  K3_RETURN_IF_ERROR(validate_moe_buffers(plan.problem, w, none));
  // Every path ends here: the per-expert SiTU betas (the problem's when the weights have none).
  auto with_situ = [&](std::unique_ptr<DeviceWeights::Impl> impl) -> Result<DeviceWeights> {
    std::vector<float> b(e, plan.problem.activation.situ_beta), lb(e, plan.problem.activation.situ_linear_beta);
    if (!w.situ_beta.empty()) b.assign(w.situ_beta.begin(), w.situ_beta.end());
    if (!w.situ_linear_beta.empty()) lb.assign(w.situ_linear_beta.begin(), w.situ_linear_beta.end());
    K3_RETURN_IF_ERROR(upload(impl->situ_beta, std::span<const float>(b), "copy situ_beta"));
    K3_RETURN_IF_ERROR(upload(impl->situ_linear_beta, std::span<const float>(lb), "copy situ_linear_beta"));
    return DeviceWeights(std::move(impl));
  };
  if (plan.path == MoePath::kW4a8Sm120Cutlass) {
    // The block-scaled GEMMs read MX codes and scales directly: no BF16 dequantization to keep
    // exact, and no other layout uploaded. NEVER RUN ON ANY GPU.
    auto impl = std::make_unique<DeviceWeights::Impl>();
    K3_ASSIGN_OR_RETURN(impl->sm120, moe_detail::sm120_path_prepack(plan, w));
    return with_situ(std::move(impl));
  }
  K3_RETURN_IF_ERROR(check_exact(w.fc1_q, w.fc1_scale, e * 2 * n, k, "fc1"));
  K3_RETURN_IF_ERROR(check_exact(w.fc2_q, w.fc2_scale, e * k, n, "fc2"));
  auto impl = std::make_unique<DeviceWeights::Impl>();
  if (plan.path == MoePath::kDecodeSplitK) {
    // The decode-splitk layout only (the checkpoint layout is not uploaded): the same weight
    // bytes, reduction padded to a multiple of 128, scales padded likewise (moe_pack.hpp).
    namespace md = moe_detail;
    impl->splitk = true;
    const md::SkGeom g1 = md::sk_geom_fc1(k, n), g2 = md::sk_geom_fc2(k, n);
    std::vector<uint8_t> pq1(e * g1.bytes), pq2(e * g2.bytes);
    std::vector<uint32_t> ps1(e * g1.scale_words), ps2(e * g2.scale_words);
    for_each_expert(e, [&](int64_t x) {
      md::sk_pack_expert(true, n, g1, w.fc1_q.data() + x * 2 * n * (k / 2), w.fc1_scale.data() + x * 2 * n * (k / kMxBlock),
                         pq1.data() + x * g1.bytes, ps1.data() + x * g1.scale_words);
      md::sk_pack_expert(false, n, g2, w.fc2_q.data() + x * k * (n / 2), w.fc2_scale.data() + x * k * (n / kMxBlock),
                         pq2.data() + x * g2.bytes, ps2.data() + x * g2.scale_words);
    });
    K3_RETURN_IF_ERROR(upload(impl->fc1_pq, std::span<const uint8_t>(pq1), "copy packed fc1"));
    K3_RETURN_IF_ERROR(upload(impl->fc1_ps, std::span<const uint32_t>(ps1), "copy packed fc1 scales"));
    K3_RETURN_IF_ERROR(upload(impl->fc2_pq, std::span<const uint8_t>(pq2), "copy packed fc2"));
    K3_RETURN_IF_ERROR(upload(impl->fc2_ps, std::span<const uint32_t>(ps2), "copy packed fc2 scales"));
  } else {
    if (plan.path == MoePath::kPrefillSm90) {
      // One layout per path: the E4M3 copy alone when the weights encode (the checkpoint layout is
      // not uploaded), the checkpoint layout alone when they do not and the plan chose the path
      // itself (run() then takes the prefill kernels: effective_path).
      std::vector<uint8_t> c1, c2;
      std::vector<uint16_t> s1, s2;
      const Status enc1 = sm90_encode(w.fc1_q, w.fc1_scale, e, 2 * n, k, c1, s1, "fc1");
      const Status enc = enc1.is_ok() ? sm90_encode(w.fc2_q, w.fc2_scale, e, k, n, c2, s2, "fc2") : enc1;
      if (!enc.is_ok() && plan.path_forced) return enc;  // the caller asked for this path: say why it cannot run
      if (enc.is_ok()) {
        K3_RETURN_IF_ERROR(upload(impl->fc1_e4m3, std::span<const uint8_t>(c1), "copy fc1 e4m3"));
        K3_RETURN_IF_ERROR(upload(impl->fc2_e4m3, std::span<const uint8_t>(c2), "copy fc2 e4m3"));
        K3_RETURN_IF_ERROR(upload(impl->fc1_s90, std::span<const uint16_t>(s1), "copy fc1 sm90 scales"));
        K3_RETURN_IF_ERROR(upload(impl->fc2_s90, std::span<const uint16_t>(s2), "copy fc2 sm90 scales"));
        impl->sm90_ready = true;
      }
    }
    if (!impl->sm90_ready) {
      K3_RETURN_IF_ERROR(upload(impl->fc1_q, w.fc1_q, "copy fc1_q"));
      K3_RETURN_IF_ERROR(upload(impl->fc1_scale, w.fc1_scale, "copy fc1_scale"));
      K3_RETURN_IF_ERROR(upload(impl->fc2_q, w.fc2_q, "copy fc2_q"));
      K3_RETURN_IF_ERROR(upload(impl->fc2_scale, w.fc2_scale, "copy fc2_scale"));
    }
  }
  return with_situ(std::move(impl));
}

namespace {

template <typename T>
T* at(void* ws, int64_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(ws) + offset);
}

}  // namespace

bool has_sm90_grouped_gemm() { return moe_detail::sm90_grouped_built(); }

MoePath effective_path(const MoePlan& plan, const DeviceWeights& w) {
  if (plan.path == MoePath::kPrefillSm90 && (w.impl() == nullptr || !w.impl()->sm90_ready)) return MoePath::kPrefill;
  return plan.path;
}

namespace moe_detail {

Status apply_path_option(const std::string& name, MoeOptions& options) {
  if (name.empty()) return Status::ok();
  auto path = moe_path_from_name(name);
  if (!path.is_ok()) return {path.status().code(), "path: " + path.status().message()};
  options.path = path.value();
  return Status::ok();
}

}  // namespace moe_detail

ExpertRows expert_rows(const MoePlan& plan, void* workspace) {
  if (workspace == nullptr) return {};
  return {at<float>(workspace, plan.ws_y), at<int32_t>(workspace, plan.ws_slot_row)};
}

Result<ExpertRows> run_experts(const MoePlan& plan, const DeviceWeights& w, const DeviceInputs& in, void* workspace,
                               void* stream) {
  if (w.impl() == nullptr) return invalid_argument("run_experts: weights were not prepacked");
  if (workspace == nullptr || in.m_device == nullptr || in.x == nullptr || in.topk_ids == nullptr) {
    return invalid_argument("run_experts: workspace, m_device, x and topk_ids must all be device pointers (null given)");
  }
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0) {
    return invalid_argument("run_experts: workspace = " + std::to_string(reinterpret_cast<uintptr_t>(workspace)) +
                            " must be 256-byte aligned (cudaMalloc gives that; the plan lays out its buffers from it)");
  }
  auto s = static_cast<cudaStream_t>(stream);
  const auto d = moe_detail::dims_of(plan);
  const auto& p = plan.problem;
  auto* x_bf16 = at<uint16_t>(workspace, plan.ws_x_bf16);
  auto* slot_row = at<int32_t>(workspace, plan.ws_slot_row);
  auto* row_token = at<int32_t>(workspace, plan.ws_row_token);
  auto* tile_expert = at<int32_t>(workspace, plan.ws_tile_expert);
  auto* counts = at<int32_t>(workspace, plan.ws_counts);
  auto* chunk_hist = at<int32_t>(workspace, plan.ws_chunk_hist);
  auto* act = at<uint16_t>(workspace, plan.ws_act);
  auto* y = at<float>(workspace, plan.ws_y);
  int* status = at<int>(workspace, plan.ws_status);
  const auto* wi = w.impl();
  const bool splitk = plan.path == MoePath::kDecodeSplitK;
  if (wi->splitk != splitk) {
    return invalid_argument(std::string("run_experts: the weights were prepacked for ") +
                            (wi->splitk ? "the decode-splitk layout" : "the checkpoint layout") + ", the plan's path " +
                            moe_path_name(plan.path) + " needs " +
                            (splitk ? "the decode-splitk layout" : "the checkpoint layout") +
                            "; prepack with the plan that runs");
  }
  if (plan.path == MoePath::kPrefillSm90 && plan.path_forced && !wi->sm90_ready) {
    return invalid_argument("run_experts: the plan forces prefill-sm90, but the weights were prepacked without its "
                            "E4M3 copy; prepack with the plan that runs");
  }
  if ((plan.path == MoePath::kW4a8Sm120Cutlass) != (wi->sm120 != nullptr)) {
    return invalid_argument(std::string("run_experts: the weights were prepacked ") +
                            (wi->sm120 ? "for" : "without") + " the w4a8-sm120-cutlass path, the plan's path is " +
                            moe_path_name(plan.path) + "; prepack with the plan that runs");
  }
  K3_CUDA_TRY(cudaMemsetAsync(status, 0, sizeof(int), s), "clear status");
  const moe_detail::ActParams act_params{p.activation.kind,        p.activation.swiglu_alpha,
                                         p.activation.swiglu_beta, p.activation.swiglu_limit,
                                         wi->situ_beta.get(),      wi->situ_linear_beta.get()};
  if (splitk) {
    // decode-splitk: prep_x first, then the sort, so that FC1's programmatic dependency is the
    // sort's last kernel and everything FC1 reads before griddepcontrol.wait (tile_expert) was
    // written by launches that completed before it (moe_gemm_splitk.cu).
    moe_detail::launch_prep_x(d, p.recipe, in.m_device, in.x, x_bf16, status, s);
    moe_detail::launch_sort(d, in.m_device, in.topk_ids, chunk_hist, counts, tile_expert, row_token, slot_row, s);
    K3_RETURN_IF_ERROR(detail::from_cuda(cudaGetLastError(), "moe kernel launch (prep, sort)"));
    K3_RETURN_IF_ERROR(detail::from_cuda(
        moe_detail::launch_fc1_splitk(d, p.recipe, act_params, x_bf16, row_token, tile_expert, wi->fc1_pq.get(),
                                      wi->fc1_ps.get(), act, status, s),
        "moe fc1 launch (decode-splitk)"));
    K3_RETURN_IF_ERROR(detail::from_cuda(moe_detail::launch_fc2_splitk(d, act, row_token, tile_expert,
                                                                       wi->fc2_pq.get(), wi->fc2_ps.get(), y, s),
                                         "moe fc2 launch (decode-splitk)"));
    return expert_rows(plan, workspace);
  }
  moe_detail::launch_sort(d, in.m_device, in.topk_ids, chunk_hist, counts, tile_expert, row_token, slot_row, s);
  if (plan.path == MoePath::kW4a8Sm120Cutlass) {  // NEVER RUN ON ANY GPU
    K3_RETURN_IF_ERROR(moe_detail::sm120_path_run(plan, *wi->sm120, act_params, in.x, counts, row_token, tile_expert,
                                                  y, s));
    return expert_rows(plan, workspace);
  }
  moe_detail::launch_prep_x(d, p.recipe, in.m_device, in.x, x_bf16, status, s);
  if (effective_path(plan, w) == MoePath::kPrefillSm90) {
    // NEVER RUN ON ANY GPU: gather, CUTLASS GEMM1 -> FP32 h, activation -> act, CUTLASS GEMM2 -> y.
    moe_detail::Sm90GroupedIo io;
    io.d = d;
    io.sm_count = plan.sm_count;
    io.counts = counts;
    io.fc1_w = wi->fc1_e4m3.get();
    io.fc1_s = wi->fc1_s90.get();
    io.fc2_w = wi->fc2_e4m3.get();
    io.fc2_s = wi->fc2_s90.get();
    io.xg = at<uint16_t>(workspace, plan.ws_xg);
    io.h = at<float>(workspace, plan.ws_h);
    io.act = act;
    io.y = y;
    io.arrays = at<void>(workspace, plan.ws_sm90_arrays);
    io.arrays_bytes = static_cast<size_t>(plan.sm90_arrays_bytes);
    io.cutlass_ws = at<void>(workspace, plan.ws_cutlass);
    io.cutlass_ws_bytes = static_cast<size_t>(plan.cutlass_bytes);
    moe_detail::launch_gather_rows(d, row_token, x_bf16, at<uint16_t>(workspace, plan.ws_xg), s);
    K3_RETURN_IF_ERROR(moe_detail::launch_sm90_gemm1(io, s));
    moe_detail::launch_grouped_act(d, p.recipe, act_params, row_token, tile_expert, io.h, act, status, s);
    K3_RETURN_IF_ERROR(moe_detail::launch_sm90_gemm2(io, s));
    K3_RETURN_IF_ERROR(detail::from_cuda(cudaGetLastError(), "moe kernel launch (prefill-sm90)"));
    return expert_rows(plan, workspace);
  }
  moe_detail::launch_fc1(d, plan.block_n, p.recipe, act_params, x_bf16, row_token, tile_expert, wi->fc1_q.get(),
                         wi->fc1_scale.get(), act, status, s);
  moe_detail::launch_fc2(d, plan.block_n, act, tile_expert, wi->fc2_q.get(), wi->fc2_scale.get(), y, s);
  K3_RETURN_IF_ERROR(detail::from_cuda(cudaGetLastError(), "moe kernel launch"));
  return expert_rows(plan, workspace);
}

Status finalize(const MoePlan& plan, const int32_t* m_device, const ExpertRows& rows, const float* topk_weights,
                void* out, void* stream) {
  if (m_device == nullptr || rows.y == nullptr || rows.slot_row == nullptr || topk_weights == nullptr ||
      out == nullptr) {
    return invalid_argument("finalize: m_device, rows.y, rows.slot_row, topk_weights and out must all be device "
                            "pointers (null given)");
  }
  const auto d = moe_detail::dims_of(plan);
  moe_detail::launch_finalize(d, plan.problem.out_dtype, m_device, rows.slot_row, topk_weights, rows.y, out,
                              static_cast<cudaStream_t>(stream));
  return detail::from_cuda(cudaGetLastError(), "moe finalize launch");
}

// run() is exactly run_experts() + finalize(): the same launches, in the same order, on the same
// buffers as before the seam existed (sort, prep, FC1, FC2, finalize).
Status run(const MoePlan& plan, const DeviceWeights& w, const DeviceInputs& in, void* workspace, void* stream) {
  if (w.impl() == nullptr) return invalid_argument("run: weights were not prepacked");
  if (workspace == nullptr || in.m_device == nullptr || in.x == nullptr || in.topk_ids == nullptr ||
      in.topk_weights == nullptr || in.out == nullptr) {
    return invalid_argument("run: workspace, m_device, x, topk_ids, topk_weights and out must all be device pointers");
  }
  K3_ASSIGN_OR_RETURN(ExpertRows rows, run_experts(plan, w, in, workspace, stream));
  return finalize(plan, in.m_device, rows, in.topk_weights, in.out, stream);
}

struct HostMoe::Impl {
  int device = 0;
  MoePlan plan;
  DeviceWeights weights;
  MoePath path = MoePath::kDecodeSplitK;
  // Sized for plan.max_tokens once; run() copies into them.
  detail::DeviceBuffer<uint8_t> ws, out;
  detail::DeviceBuffer<uint16_t> x;
  detail::DeviceBuffer<int32_t> ids, m;
  detail::DeviceBuffer<float> weights_topk;
  std::mutex lock;  // one call at a time: the buffers above are shared
};

HostMoe::HostMoe(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HostMoe::~HostMoe() = default;
const MoePlan& HostMoe::plan() const { return impl_->plan; }
MoePath HostMoe::path() const { return impl_->path; }

Result<std::unique_ptr<HostMoe>> HostMoe::create(const MoeProblem& p, const MoeWeightsView& w, int64_t max_tokens,
                                                 const std::string& path, int device) {
  K3_RETURN_IF_ERROR(validate_moe_weights(p, w));
  MoeOptions options;
  K3_RETURN_IF_ERROR(moe_detail::apply_path_option(path, options));  // a bad name is an error even without a device
  auto caps = device_caps(device);
  if (!caps.is_ok()) return caps.status();
  // The current device is per host thread: every entry point selects it (allocations, copies, launches).
  K3_CUDA_TRY(cudaSetDevice(device), "cudaSetDevice");
  options.max_tokens = max_tokens;
  options.device = caps.value();
  auto impl = std::make_unique<Impl>();
  impl->device = device;
  K3_ASSIGN_OR_RETURN(impl->plan, cuda::plan(p, options));
  K3_ASSIGN_OR_RETURN(impl->weights, prepack(impl->plan, w));
  impl->path = effective_path(impl->plan, impl->weights);
  const MoePlan& pl = impl->plan;
  const int64_t k = p.shape.hidden, topk = p.shape.top_k;
  K3_RETURN_IF_ERROR(impl->ws.allocate(static_cast<size_t>(pl.workspace_bytes)));
  K3_CUDA_TRY(cudaMemset(impl->ws.get(), 0, static_cast<size_t>(pl.workspace_bytes)), "clear workspace");
  K3_RETURN_IF_ERROR(impl->x.allocate(static_cast<size_t>(pl.max_tokens * k)));
  K3_RETURN_IF_ERROR(impl->ids.allocate(static_cast<size_t>(pl.max_tokens * topk)));
  K3_RETURN_IF_ERROR(impl->weights_topk.allocate(static_cast<size_t>(pl.max_tokens * topk)));
  K3_RETURN_IF_ERROR(impl->m.allocate(1));
  K3_RETURN_IF_ERROR(impl->out.allocate(static_cast<size_t>(pl.max_tokens * k * out_dtype_size(p.out_dtype))));
  return std::make_unique<HostMoe>(std::move(impl));
}

Status HostMoe::run(const MoeInputsView& in, std::span<uint8_t> out) const {
  Impl& im = *impl_;
  const MoeProblem& p = im.plan.problem;
  K3_RETURN_IF_ERROR(validate_moe_inputs(p, in));
  if (in.m > im.plan.max_tokens) {
    return invalid_argument("m = " + std::to_string(in.m) + " exceeds the layer's max_tokens = " +
                            std::to_string(im.plan.max_tokens));
  }
  const int64_t want = in.m * p.shape.hidden * out_dtype_size(p.out_dtype);
  if (static_cast<int64_t>(out.size()) != want) {
    return invalid_argument("out has " + std::to_string(out.size()) + " bytes, expected M * K * " +
                            std::to_string(out_dtype_size(p.out_dtype)) + " = " + std::to_string(want));
  }
  if (in.m == 0) return Status::ok();
  std::lock_guard<std::mutex> hold(im.lock);
  K3_CUDA_TRY(cudaSetDevice(im.device), "cudaSetDevice");
  K3_CUDA_TRY(cudaMemcpy(im.x.get(), in.x.data(), in.x.size_bytes(), cudaMemcpyHostToDevice), "copy x");
  K3_CUDA_TRY(cudaMemcpy(im.ids.get(), in.topk_ids.data(), in.topk_ids.size_bytes(), cudaMemcpyHostToDevice),
              "copy topk_ids");
  K3_CUDA_TRY(cudaMemcpy(im.weights_topk.get(), in.topk_weights.data(), in.topk_weights.size_bytes(),
                         cudaMemcpyHostToDevice),
              "copy topk_weights");
  const int32_t m32 = static_cast<int32_t>(in.m);
  K3_CUDA_TRY(cudaMemcpy(im.m.get(), &m32, sizeof m32, cudaMemcpyHostToDevice), "copy m");
  const DeviceInputs din{im.m.get(), im.x.get(), im.ids.get(), im.weights_topk.get(), im.out.get()};
  K3_RETURN_IF_ERROR(cuda::run(im.plan, im.weights, din, im.ws.get(), nullptr));
  K3_CUDA_TRY(cudaDeviceSynchronize(), "moe run");
  int status = 0;
  K3_CUDA_TRY(cudaMemcpy(&status, at<int>(im.ws.get(), im.plan.ws_status), sizeof(int), cudaMemcpyDeviceToHost),
              "status");
  if (status != 0) {  // sticky bits: clear them so that the next call reports its own
    K3_CUDA_TRY(cudaMemset(at<int>(im.ws.get(), im.plan.ws_status), 0, sizeof(int)), "clear status");
  }
  if (status & moe_detail::kStatusInexactX) {
    return {StatusCode::kInexact, "x holds an MXFP8 block with values in or below BF16's subnormal range "
                                  "(|value| < 2^-126 ~ 1.2e-38); the CUDA path would round them. Use --backend cpu"};
  }
  if (status & moe_detail::kStatusInexactAct) {
    return {StatusCode::kInexact, "the W4A8 activation output holds an MXFP8 block with values in or below BF16's "
                                  "subnormal range (|value| < 2^-126 ~ 1.2e-38); the CUDA path would round them. "
                                  "Use --backend cpu"};
  }
  K3_CUDA_TRY(cudaMemcpy(out.data(), im.out.get(), out.size(), cudaMemcpyDeviceToHost), "copy out");
  return Status::ok();
}

Status run_host(const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in, std::span<uint8_t> out,
                const std::string& path, int device) {
  K3_RETURN_IF_ERROR(validate_moe_buffers(p, w, in));
  const int64_t k = p.shape.hidden;
  if (static_cast<int64_t>(out.size()) != in.m * k * out_dtype_size(p.out_dtype)) {
    return invalid_argument("out has " + std::to_string(out.size()) + " bytes, expected M * K * " +
                            std::to_string(out_dtype_size(p.out_dtype)));
  }
  MoeOptions options;
  K3_RETURN_IF_ERROR(moe_detail::apply_path_option(path, options));  // a bad name is an error even without a device
  if (in.m == 0) return Status::ok();
  K3_ASSIGN_OR_RETURN(const std::unique_ptr<HostMoe> layer, HostMoe::create(p, w, in.m, path, device));
  return layer->run(in, out);
}

}  // namespace k3::cuda
