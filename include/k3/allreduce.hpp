// k3/allreduce.hpp — tensor-parallel all-reduce of BF16 activations, optionally fused with the
// residual add and RMSNorm that follow it in a transformer block (docs/distributed.md,
// "Tensor-parallel all-reduce").
//
// Bits: the sum over ranks is computed EXACTLY and rounded once to FP32, so every output bit is
// independent of the world size, of which rank holds which partial, of the OpenMP thread count
// and of the transport; all ranks return identical outputs. (A fixed-order FP32 sum — what
// MPI_Allreduce or NCCL give — changes bits when the world size changes.)
//
// Collective: every rank of `comm` calls it with the same rows, cols, eps, gamma and
// max_call_bytes. Before any data moves, the ranks agree on validity with one small allgather
// (each rank's verdict on its own arguments, its rows/cols/eps/max_call_bytes and a digest of
// gamma): when any rank's arguments are bad, or the ranks disagree, EVERY rank returns
// kInvalidArgument (the bad rank names its argument; the others name that rank) and nothing
// is moved, so one bad rank never leaves its peers waiting. Transport failures (a peer gone)
// return kUnavailable as in k3/comm.hpp.
//
// Memory: each call needs (W + 2) * ceil(rows / W) * cols BF16 of scratch (per round) plus
// 20 * cols bytes per thread, allocated before the agreement (a rank that cannot allocate it
// returns kUnavailable and fails the others as a bad argument would); up to 256 MiB of it is
// kept per calling thread between calls.
#pragma once

#include <cstdint>
#include <span>

#include "k3/comm.hpp"
#include "k3/status.hpp"

namespace k3::comm {

struct AllreduceOptions {
  int threads = 1;  // OpenMP threads of the local reduction, in [1, 1024]; bits never depend on it
  // Largest message of one MPI call, in bytes (0: 2^30). Larger tensors are moved in several
  // rounds of whole rows (MPI counts are int). In [0, 2^31 - 1]; must agree across ranks.
  int64_t max_call_bytes = 0;
};

inline constexpr int64_t kAllreduceMaxCols = int64_t{1} << 20;
inline constexpr int64_t kAllreduceMaxElements = int64_t{1} << 36;  // rows * cols

// out[rows, cols] = bf16(fp32(exact sum over ranks of x)), identical on every rank.
// x: this rank's partial [rows, cols] (BF16 bits, row-major). rows, cols >= 0; rows * cols <=
// kAllreduceMaxElements, cols <= kAllreduceMaxCols. `out` must not overlap `x`.
// fp32(exact): round to nearest even; NaN when any contribution is NaN or +Inf meets -Inf,
// else +-Inf when any contribution is +-Inf or the sum overflows FP32; -0 only when every
// contribution is -0. bf16(): k3::bf16_from_f32 (NaN -> 0x7FFF).
Status allreduce_bf16(Communicator& comm, std::span<const uint16_t> x, int64_t rows, int64_t cols,
                      std::span<uint16_t> out, const AllreduceOptions& opt = {});

// All-reduce, residual add and RMSNorm in one pass, per element (i, j) and row i:
//   s = fp32(exact sum over ranks of x)                    (as allreduce_bf16)
//   z = s + bf16_to_f32(residual)   (one FP32 add; z = s when residual is empty)
//   residual_out = bf16(z);   r = bf16_to_f32(residual_out)
//   ms = (sum over j in column order of double(r)^2, accumulated in FP64) / cols   (FP64)
//   rstd = 1.0 / std::sqrt(ms + double(eps))                                         (FP64)
//   out = bf16(float((double(r) * rstd) * double(bf16_to_f32(gamma[j]))))            (FP64 products)
// residual: [rows, cols] or empty; gamma: [cols]; eps > 0 and finite. out must not overlap any
// other argument; residual_out may be exactly the residual span (in-place update) but must not
// otherwise overlap x, residual, gamma or out.
Status allreduce_add_rmsnorm_bf16(Communicator& comm, std::span<const uint16_t> x, std::span<const uint16_t> residual,
                                  std::span<const uint16_t> gamma, int64_t rows, int64_t cols, float eps,
                                  std::span<uint16_t> out, std::span<uint16_t> residual_out,
                                  const AllreduceOptions& opt = {});

}  // namespace k3::comm
