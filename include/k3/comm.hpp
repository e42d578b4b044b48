// k3/comm.hpp — the communicator that k3's multi-rank ops run on (docs/distributed.md).
//
// k3 never moves bytes between processes itself: a Communicator wraps an existing engine
// (MPI for host buffers; NCCL for device buffers, see k3/comm_nccl.hpp) and offers the few
// collectives the multi-rank ops need. Every collective is called by every rank of the
// communicator in the same order (the MPI rule).
//
// Faults: a collective that does not complete within `timeout_s` seconds (a peer rank exited,
// crashed or hangs) returns kUnavailable naming this rank, the collective and the timeout; it
// never hangs forever. The caller then aborts the job (abort()), since a communicator whose
// peers are gone cannot be reused.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "k3/status.hpp"

namespace k3::comm {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* transport() const = 0;  // "self" or "mpi"

  // All-to-all with per-peer byte counts (host memory). send_bytes[q] bytes go to rank q from
  // `send` at offset sum(send_bytes[0..q)); recv_bytes[q] bytes arrive from rank q at offset
  // sum(recv_bytes[0..q)) of `recv`. Both count arrays have size() entries; recv_bytes must be
  // what the peers send (exchange the counts first with alltoall_counts).
  virtual Status alltoallv(const void* send, std::span<const int64_t> send_bytes, void* recv,
                           std::span<const int64_t> recv_bytes) = 0;
  // recv[q] = what rank q passed as send[rank()]; both spans have size() entries.
  virtual Status alltoall_counts(std::span<const int64_t> send, std::span<int64_t> recv) = 0;
  // recv (size() * bytes) = every rank's `bytes` bytes of `send`, in rank order.
  virtual Status allgather(const void* send, int64_t bytes, void* recv) = 0;
  // recv = every rank's recv_bytes[q] bytes, in rank order (recv_bytes[rank()] == send_bytes).
  virtual Status allgatherv(const void* send, int64_t send_bytes, void* recv, std::span<const int64_t> recv_bytes) = 0;
  virtual Status barrier() = 0;
  // The transport's own all-reduce: data[0..count) = the sum over ranks, in place (MPI:
  // MPI_Iallreduce(MPI_IN_PLACE, MPI_FLOAT, MPI_SUM) polled with the same deadline as the other
  // collectives; self: nothing to do). A baseline for benchmarks ("the engine's own all-reduce
  // measured in the same run", k3/harness/comm_bench.hpp): its bits depend on MPI's reduction order,
  // hence on the world size and the MPI library. k3's ops use k3/allreduce.hpp instead.
  // count in [0, 2^31 - 1].
  virtual Status native_allreduce_sum_f32(float* data, int64_t count) = 0;
  // Ends every process of the job (MPI_Abort); for a failed collective. Does not return for MPI.
  virtual void abort(int exit_code) = 0;
};

struct MpiOptions {
  double timeout_s = 120;  // per collective; a peer that is gone for longer fails it (kUnavailable)
};

// One process (size 1, rank 0): the multi-rank ops then reduce to the single-process ones.
std::unique_ptr<Communicator> make_self_communicator();

// MPI_COMM_WORLD. Initializes MPI (MPI_THREAD_FUNNELED) on first use and finalizes it at exit.
// kUnsupported when k3 was built without MPI (K3_MPI=OFF or no MPI found), with the reason.
Result<std::unique_ptr<Communicator>> make_mpi_communicator(const MpiOptions& options = {});
// ok when this build has the MPI transport; otherwise why not.
Status mpi_available();
// The MPI library's version line ("Open MPI v4.1.4, ..."), without initializing MPI; empty
// when built without MPI.
std::string mpi_library_version();
// True when this process was started by an MPI launcher (mpirun / mpiexec / srun), judged from
// the launcher's environment variables, without initializing MPI.
bool launched_by_mpi();

// Checks that every rank passed the same `value` (e.g. a checkpoint digest, a shape, the
// expected world size): kInvalidArgument naming the first rank that differs from rank 0, the
// `what`, both values. Every rank gets the same Status.
Status check_same_on_all_ranks(Communicator& comm, const std::string& what, const std::string& value);

// Every rank passes its own check of its arguments; every rank gets the same result: ok when all
// are ok, else the first failing rank's status, its message prefixed with "rank q of W: ". Used
// before moving data so that a bad argument on one rank fails all of them instead of hanging them.
Status agree_on_status(Communicator& comm, const Status& local);

}  // namespace k3::comm
