// CUDA-event timing of an enqueued operation (k3/harness/cuda_bench.hpp's helpers). Internal.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "cuda/common.cuh"
#include "k3/harness/cuda_bench.hpp"

namespace k3::cuda::detail {

// RAII CUDA events / stream for timing.
struct Events {
  cudaEvent_t start = nullptr, stop = nullptr;
  ~Events() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  }
};

// fn(i) enqueues iteration i on the default stream; warm-up iterations first, then the median,
// min and max of `iters` timed ones.
template <typename Fn>
Result<DeviceTiming> time_events(Fn&& fn, int warmup, int iters) {
  Events ev;
  K3_CUDA_TRY(cudaEventCreate(&ev.start), "cudaEventCreate");
  K3_CUDA_TRY(cudaEventCreate(&ev.stop), "cudaEventCreate");
  for (int i = 0; i < warmup; ++i) K3_RETURN_IF_ERROR(fn(i));
  K3_CUDA_TRY(cudaDeviceSynchronize(), "warm-up");
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    K3_CUDA_TRY(cudaEventRecord(ev.start), "cudaEventRecord");
    K3_RETURN_IF_ERROR(fn(warmup + i));
    K3_CUDA_TRY(cudaEventRecord(ev.stop), "cudaEventRecord");
    K3_CUDA_TRY(cudaEventSynchronize(ev.stop), "cudaEventSynchronize");
    float ms = 0;
    K3_CUDA_TRY(cudaEventElapsedTime(&ms, ev.start, ev.stop), "cudaEventElapsedTime");
    t.push_back(ms * 1e-3);
  }
  std::sort(t.begin(), t.end());
  return DeviceTiming{t[t.size() / 2], t.front(), t.back(), iters};
}

}  // namespace k3::cuda::detail
