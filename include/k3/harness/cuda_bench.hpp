// k3/harness/cuda_bench.hpp — device-side timing helpers for `k3 bench moe --backend cuda` and
// scripts/device-check.sh: the fused-MoE run, and the two baselines measured in the same run
// (docs/moe.md): a large device-to-device copy (memory bandwidth limit) and cuBLAS BF16
// GEMMs per expert on pre-dequantized weights. Ran on an H200 (2026-12-04).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "k3/kda.hpp"
#include "k3/moe.hpp"
#include "k3/status.hpp"

namespace k3::cuda {

struct DeviceTiming {
  double median_s = 0, min_s = 0, max_s = 0;
  int iterations = 0;
  std::string path;  // time_moe: the kernel path the plan ran (moe_path_name), else empty
};

// Device-to-device copy of `bytes`; returns bytes read + written per second (median of iters).
Result<DeviceTiming> time_device_copy(int64_t bytes, int warmup, int iters);

// Times k3::cuda::run for one problem on device `device` with CUDA events (inputs and weights
// uploaded once; `weight_copies` > 1 rotates among that many weight copies so decode never hits
// L2). path: "" (the plan's choice) or a path name, as run_host.
Result<DeviceTiming> time_moe(const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in, int warmup,
                              int iters, int weight_copies, const std::string& path = "", int device = 0);

// cuBLAS baseline: for each local expert e with rows[e] > 0, FC1 [rows, K] x [K, 2N] and FC2
// [rows, N] x [N, K] as BF16 GEMMs with FP32 accumulation (cublasGemmEx) on weights dequantized
// to BF16 beforehand. Activation, permutation and finalize are not included (it is a lower bound
// of what a BF16 grouped-GEMM pipeline costs).
Result<DeviceTiming> time_cublas_baseline(const MoeProblem& p, std::span<const int64_t> rows_per_expert, int warmup,
                                          int iters);

// KDA (k3/cuda_kda.hpp) on device 0, inputs uploaded once, CUDA events around the device call:
// a prefill of `in` with `algorithm`; a decode of the N tokens of `in` (no cu_seqlens) that
// rotates over pool_slots / N groups of N slots, so that no step finds its states in L2 (the
// state bytes read + written per step are 2 N H K V x 4, or x 2 with bf16_state).
Result<DeviceTiming> time_kda_prefill(const kda::KdaConfig& cfg, const kda::KdaInputs& in, kda::Algorithm algorithm,
                                      int warmup, int iters);
Result<DeviceTiming> time_kda_decode(const kda::KdaConfig& cfg, const kda::KdaInputs& in, int64_t pool_slots,
                                     int warmup, int iters, bool bf16_state = false);

}  // namespace k3::cuda
