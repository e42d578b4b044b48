// k3/harness/ep_bench.hpp — the expert-parallel dispatch / combine benchmark behind `k3 bench comm`
// (docs/distributed.md, "Benchmarks"). Every rank of the communicator calls it with the same
// arguments and gets the same table.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "k3/comm.hpp"
#include "k3/ep.hpp"
#include "k3/status.hpp"

namespace k3::comm {

struct EpBenchRecord {
  int64_t m = 0;                  // tokens per rank
  bool mxfp8_wire = false;        // W4A8 rows as MXFP8 codes + scales, else BF16
  int64_t dispatch_bytes = 0;     // bytes one rank sends in dispatch (max over ranks)
  int64_t combine_bytes = 0;      // ... in combine (FP32 y rows of the slots it computed)
  double dispatch_us = 0;         // k3 ep_dispatch: median over iterations, max over ranks
  double combine_us = 0;          // k3 ep_combine (including the finalize of the source's tokens)
  double native_dispatch_us = 0;  // the transport's own all-to-all-v of the same byte counts
  double native_combine_us = 0;
};

// Uniform top-k routing (distinct experts per token, seeded per rank), random BF16 x; the
// experts are not run (combine gets zero y rows of the right count): this measures the data
// movement and k3's packing / unpacking / finalize, not the GEMMs. Each timed call is preceded
// by a barrier. problem: this rank's layer (its shape's ep_size = comm.size(), ep_rank = rank);
// threads: the host threads of the quantizer and the finalize (0: all logical CPUs).
Result<std::vector<EpBenchRecord>> bench_ep(Communicator& comm, const MoeProblem& problem, std::span<const int64_t> ms,
                                            int iters, bool mxfp8_wire, int threads = 0);

}  // namespace k3::comm
