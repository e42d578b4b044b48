// k3/harness/comm_bench.hpp — timing of the tensor-parallel all-reduce (k3/allreduce.hpp) against the
// transport's own all-reduce measured in the same run (docs/distributed.md, "Benchmark").
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "k3/comm.hpp"
#include "k3/status.hpp"

namespace k3::comm {

struct AllreduceBenchRecord {
  int64_t bytes = 0;            // BF16 bytes of the tensor: rows * cols * 2
  int64_t rows = 0, cols = 0;
  double k3_us = 0;             // allreduce_bf16
  double k3_rmsnorm_us = 0;     // allreduce_add_rmsnorm_bf16 (with a residual)
  double native_us = 0;         // Communicator::native_allreduce_sum_f32 on bytes / 4 floats
  double k3_busbw_gbs = 0, native_busbw_gbs = 0;  // 2 (W - 1) / W * bytes / time, 1e9 B/s; 0 at W = 1
};

// Collective: every rank passes the same sizes_bytes and iters (checked; a mismatch fails every
// rank). For each size (even, in [2, 2^36]): cols = 3584 and rows = bytes / (2 * 3584) when
// bytes >= 2 * 3584, else one row of bytes / 2 columns (bytes is rounded down to rows * cols * 2
// and reported). Inputs are pseudo-random BF16 in [-1, 1). Each of the three operations runs
// max(2, iters / 5) untimed warm-up calls, then `iters` timed calls, each preceded by a barrier
// (not timed); a rank's time is the median of its calls, and every rank returns the max over
// ranks of each median (one allgather), so all ranks return the same table. iters in [1, 10000];
// threads as AllreduceOptions.threads.
Result<std::vector<AllreduceBenchRecord>> bench_allreduce(Communicator& comm, std::span<const int64_t> sizes_bytes,
                                                          int iters, int threads);

// The same on explicit shapes (for example the seed's T x 7168 and T x 3584 payloads, or 1 x 1030):
// rows in [1, 2^24], cols in [1, kAllreduceMaxCols], rows * cols * 2 <= 2^36 bytes; the same on
// every rank (checked).
struct AllreduceShape {
  int64_t rows = 0, cols = 0;
};
Result<std::vector<AllreduceBenchRecord>> bench_allreduce_shapes(Communicator& comm, std::span<const AllreduceShape> shapes,
                                                                 int iters, int threads);

}  // namespace k3::comm
