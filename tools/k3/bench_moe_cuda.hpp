// `k3 bench moe --backend cuda`: the CUDA fused MoE over an M sweep against two baselines measured
// in the same run (docs/moe.md): the device-to-device copy bandwidth (decode limit) and
// cuBLAS BF16 GEMMs per expert on pre-dequantized weights (prefill reference). Ran on an H200 (2026-12-04).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "k3/moe.hpp"
#include "k3/harness/moe_workload.hpp"

namespace k3::tool {

// The sweep `k3 bench moe` asks for, checked before anything is measured (both backends).
struct MoeBenchSweep {
  std::vector<int64_t> ms;
  std::vector<Recipe> recipes;
  ActivationKind activation = ActivationKind::kSiTU;
  BenchRouting routing;
  MoeShape shape;
};

struct CudaMoeBenchParams {
  MoeBenchSweep sweep;
  int iters = 0;    // 0: 20 per M
  int warmup = 3;
  uint64_t seed = 0;
  std::string output;
};

// Prints the table and writes the JSON records to `output` when set.
Status run_moe_bench_cuda(const CudaMoeBenchParams& p);

}  // namespace k3::tool
