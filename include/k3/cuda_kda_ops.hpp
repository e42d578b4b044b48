// k3/cuda_kda_ops.hpp — the two small ops around the KDA core on the GPU: the causal depthwise
// convolution + SiLU with its rolling state, and the gated per-head RMSNorm (the CPU ops and their
// contracts: k3/kda_ops.hpp; docs/kda.md, "CUDA: conv1d + SiLU and gated RMSNorm").
//
// Ran on an H200 (sm_90, 2026-12-04): tests/cuda/test_cuda_kda_ops.cpp passes there (it skips its
// device tests without a device). Never run on sm_120.
//
// Includes no CUDA header: `stream` is a cudaStream_t passed as void* (nullptr = default stream).
#pragma once

#include "k3/kda_ops.hpp"
#include "k3/status.hpp"

namespace k3::cuda {

// ---- device API: every span of the args points to device memory ------------------------------
// The host reads only the spans' sizes (kda::detail::validate_conv_sizes / validate_rmsnorm), never
// device data: the calls enqueue kernels on `stream`, allocate nothing and never synchronize, so
// they can be captured in a CUDA graph. A launch error (e.g. no device) is kUnavailable.

// kda::causal_conv1d on the device, same contract; y must not overlap x or conv_state.
// cu_seqlens' entries live on the device and are not checked: the kernels clamp each to [0, T], so
// malformed values never lead to an access out of bounds. Each token takes the sequence that a
// binary search over the clamped starts finds (for non-decreasing entries: the one holding it) and
// gets y = NaN when it lies outside that sequence's clamped [cu[n], cu[n + 1]); a sequence whose
// clamped end is below its start is empty (its conv_state rows are kept). FP32 arithmetic in the
// CPU op's order (bias, then + weight[c, i] * input for i = 0..W-1, each product and sum rounded,
// no FMA), so y without SiLU and conv_state equal the CPU op's bits; SiLU z / (1 + e^-z) as the
// CPU op writes it, with the device expf.
Status causal_conv1d(const kda::ConvArgs& a, void* stream);

// kda::gated_rmsnorm on the device, same contract. One warp per row; the sum of squares in a fixed
// order (per-lane partial sums, then a butterfly): deterministic, not the CPU op's order.
Status gated_rmsnorm(const kda::GatedRmsNormArgs& a, void* stream);

// ---- host conveniences: host spans, full checks (cu_seqlens' entries included), device 0 ------
// Copy in, run the device op, synchronize, copy y (and conv_state) back.
Status causal_conv1d_host(const kda::ConvArgs& a);
Status gated_rmsnorm_host(const kda::GatedRmsNormArgs& a);

}  // namespace k3::cuda
