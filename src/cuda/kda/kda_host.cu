// Host conveniences of the CUDA KDA backend (k3/cuda_kda.hpp): every value checked on the host
// with the CPU backend's messages, then plan + copies + the device call + copies back, on device 0.
// Ran on an H200 (2026-12-04).
#include <cuda_runtime.h>

#include <algorithm>
#include <span>
#include <string>

#include "cuda/common.cuh"
#include "cuda/kda/kda_device_copy.cuh"
#include "k3/cuda_kda.hpp"

namespace k3::cuda {
namespace {

using kda_detail::DeviceCopy;
using kda_detail::DeviceTokens;

}  // namespace

Status prefill_host(const kda::KdaConfig& cfg, const kda::KdaInputs& in, const kda::KdaOutputs& out,
                    kda::Algorithm algorithm) {
  K3_ASSIGN_OR_RETURN(const auto shape, kda::validate_prefill(cfg, in, out));
  K3_ASSIGN_OR_RETURN(const KdaPlan p, kda_detail::device0_plan(cfg, shape.num_seqs, algorithm));
  DeviceTokens tok;
  K3_RETURN_IF_ERROR(tok.upload(in));
  DeviceCopy<float> o, fs;
  K3_RETURN_IF_ERROR(o.upload(std::span<const float>(out.o.data(), out.o.size()), "copy o"));
  K3_RETURN_IF_ERROR(fs.upload(std::span<const float>(out.final_state.data(), out.final_state.size()), "copy final_state"));
  detail::DeviceBuffer<uint8_t> ws;
  K3_RETURN_IF_ERROR(ws.allocate(static_cast<size_t>(p.workspace_bytes)));
  K3_RETURN_IF_ERROR(prefill(p, tok.view(), {o.span(), fs.span()}, ws.get(), nullptr));
  K3_RETURN_IF_ERROR(kda_status(p, ws.get(), nullptr));
  K3_RETURN_IF_ERROR(o.download(out.o, "copy o back"));
  return fs.download(out.final_state, "copy final_state back");
}

Status decode_host(const kda::KdaConfig& cfg, const kda::DecodeArgs& a) {
  K3_ASSIGN_OR_RETURN(const auto shape, kda::check_decode_args(cfg, a, /*bf16_pool_ok=*/true));
  K3_ASSIGN_OR_RETURN(const KdaPlan p, kda_detail::device0_plan(cfg, shape.num_seqs, kda::Algorithm::kAuto));
  DeviceTokens tok;
  K3_RETURN_IF_ERROR(tok.upload(a.in));
  DeviceCopy<float> pool, o;
  DeviceCopy<uint16_t> pool16;
  DeviceCopy<int32_t> idx;
  K3_RETURN_IF_ERROR(pool.upload(std::span<const float>(a.state_pool.data(), a.state_pool.size()), "copy state_pool"));
  K3_RETURN_IF_ERROR(pool16.upload(std::span<const uint16_t>(a.state_pool_bf16.data(), a.state_pool_bf16.size()),
                                   "copy state_pool_bf16"));
  K3_RETURN_IF_ERROR(o.upload(std::span<const float>(a.o.data(), a.o.size()), "copy o"));
  K3_RETURN_IF_ERROR(idx.upload(a.state_indices, "copy state_indices"));
  detail::DeviceBuffer<uint8_t> ws;
  K3_RETURN_IF_ERROR(ws.allocate(static_cast<size_t>(p.workspace_bytes)));
  kda::DecodeArgs d;
  d.in = tok.view();
  d.state_pool = pool.span();
  d.state_pool_bf16 = pool16.span();
  d.state_indices = idx.cspan();
  d.o = o.span();
  K3_RETURN_IF_ERROR(decode(p, d, ws.get(), nullptr));
  K3_RETURN_IF_ERROR(kda_status(p, ws.get(), nullptr));
  K3_RETURN_IF_ERROR(o.download(a.o, "copy o back"));
  K3_RETURN_IF_ERROR(pool16.download(a.state_pool_bf16, "copy state_pool_bf16 back"));
  return pool.download(a.state_pool, "copy state_pool back");
}

Status verify_host(const kda::KdaConfig& cfg, const kda::VerifyArgs& a) {
  K3_ASSIGN_OR_RETURN(const auto shape, kda::check_verify_args(cfg, a, /*bf16_pool_ok=*/true));
  K3_ASSIGN_OR_RETURN(const KdaPlan p, kda_detail::device0_plan(cfg, shape.num_seqs, kda::Algorithm::kAuto));
  DeviceTokens tok;
  K3_RETURN_IF_ERROR(tok.upload(a.in));
  DeviceCopy<float> pool, o;
  DeviceCopy<uint16_t> pool16;
  DeviceCopy<int32_t> idx, acc;
  K3_RETURN_IF_ERROR(pool.upload(std::span<const float>(a.state_pool.data(), a.state_pool.size()), "copy state_pool"));
  K3_RETURN_IF_ERROR(pool16.upload(std::span<const uint16_t>(a.state_pool_bf16.data(), a.state_pool_bf16.size()),
                                   "copy state_pool_bf16"));
  K3_RETURN_IF_ERROR(o.upload(std::span<const float>(a.o.data(), a.o.size()), "copy o"));
  K3_RETURN_IF_ERROR(idx.upload(a.state_indices, "copy state_indices"));
  K3_RETURN_IF_ERROR(acc.upload(a.num_accepted, "copy num_accepted"));
  detail::DeviceBuffer<uint8_t> ws;
  K3_RETURN_IF_ERROR(ws.allocate(static_cast<size_t>(p.workspace_bytes)));
  kda::VerifyArgs d;
  d.in = tok.view();
  d.draft_tokens = a.draft_tokens;
  d.state_pool = pool.span();
  d.state_pool_bf16 = pool16.span();
  d.state_indices = idx.cspan();
  d.num_accepted = acc.cspan();
  d.o = o.span();
  K3_RETURN_IF_ERROR(verify(p, d, ws.get(), nullptr));
  K3_RETURN_IF_ERROR(kda_status(p, ws.get(), nullptr));
  K3_RETURN_IF_ERROR(o.download(a.o, "copy o back"));
  K3_RETURN_IF_ERROR(pool16.download(a.state_pool_bf16, "copy state_pool_bf16 back"));
  return pool.download(a.state_pool, "copy state_pool back");
}

}  // namespace k3::cuda
