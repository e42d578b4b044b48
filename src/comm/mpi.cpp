// The MPI transport (Open MPI, MPICH, ...): MPI_COMM_WORLD, nonblocking collectives polled
// against a deadline so that a vanished peer fails the call instead of hanging it.
#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "k3/comm.hpp"

namespace k3::comm {
namespace {

std::string mpi_error(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf, static_cast<size_t>(len));
}

// Finalizes MPI at process exit when k3 initialized it. After a collective failed (a peer that
// exited, crashed, stopped or hangs) MPI_Finalize would wait for that peer forever: the job is
// aborted instead (exit code 2, the tools' code for an error), so that every rank ends.
struct MpiLifetime {
  bool we_initialized = false;
  bool peer_failed = false;
  ~MpiLifetime() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!we_initialized || finalized) return;
    if (peer_failed) {
      MPI_Abort(MPI_COMM_WORLD, 2);
      std::_Exit(2);
    }
    MPI_Finalize();
  }
};
MpiLifetime g_lifetime;

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(int rank, int size, double timeout_s) : rank_(rank), size_(size), timeout_s_(timeout_s) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* transport() const override { return "mpi"; }

  Status alltoallv(const void* send, std::span<const int64_t> send_bytes, void* recv,
                   std::span<const int64_t> recv_bytes) override {
    std::vector<int> sc, sd, rc, rd;
    K3_RETURN_IF_ERROR(to_int_counts("alltoallv send_bytes", send_bytes, sc, sd));
    K3_RETURN_IF_ERROR(to_int_counts("alltoallv recv_bytes", recv_bytes, rc, rd));
    MPI_Request req;
    const int rc0 = MPI_Ialltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rc.data(), rd.data(), MPI_BYTE,
                                   MPI_COMM_WORLD, &req);
    return wait("MPI_Ialltoallv", rc0, req);
  }
  Status alltoall_counts(std::span<const int64_t> send, std::span<int64_t> recv) override {
    if (send.size() != static_cast<size_t>(size_) || recv.size() != static_cast<size_t>(size_)) {
      return invalid_argument("alltoall_counts: spans have " + std::to_string(send.size()) + " and " +
                              std::to_string(recv.size()) + " entries, expected size() = " + std::to_string(size_));
    }
    MPI_Request req;
    const int rc0 = MPI_Ialltoall(send.data(), 1, MPI_INT64_T, recv.data(), 1, MPI_INT64_T, MPI_COMM_WORLD, &req);
    return wait("MPI_Ialltoall", rc0, req);
  }
  Status allgather(const void* send, int64_t bytes, void* recv) override {
    if (bytes < 0 || bytes > INT_MAX) {
      return invalid_argument("allgather: bytes = " + std::to_string(bytes) + " must be in [0, 2^31 - 1]");
    }
    MPI_Request req;
    const int rc0 = MPI_Iallgather(send, static_cast<int>(bytes), MPI_BYTE, recv, static_cast<int>(bytes), MPI_BYTE,
                                   MPI_COMM_WORLD, &req);
    return wait("MPI_Iallgather", rc0, req);
  }
  Status allgatherv(const void* send, int64_t send_bytes, void* recv, std::span<const int64_t> recv_bytes) override {
    std::vector<int> rc, rd;
    K3_RETURN_IF_ERROR(to_int_counts("allgatherv recv_bytes", recv_bytes, rc, rd));
    if (recv_bytes[static_cast<size_t>(rank_)] != send_bytes) {
      return invalid_argument("allgatherv: recv_bytes[" + std::to_string(rank_) + "] = " +
                              std::to_string(recv_bytes[static_cast<size_t>(rank_)]) + " differs from send_bytes = " +
                              std::to_string(send_bytes));
    }
    MPI_Request req;
    const int rc0 = MPI_Iallgatherv(send, static_cast<int>(send_bytes), MPI_BYTE, recv, rc.data(), rd.data(), MPI_BYTE,
                                    MPI_COMM_WORLD, &req);
    return wait("MPI_Iallgatherv", rc0, req);
  }
  Status barrier() override {
    MPI_Request req;
    const int rc0 = MPI_Ibarrier(MPI_COMM_WORLD, &req);
    return wait("MPI_Ibarrier", rc0, req);
  }
  Status native_allreduce_sum_f32(float* data, int64_t count) override {
    if (count < 0 || count > INT_MAX) {
      return invalid_argument("native_allreduce_sum_f32: count = " + std::to_string(count) + " must be in [0, 2^31 - 1]");
    }
    if (count > 0 && data == nullptr) {
      return invalid_argument("native_allreduce_sum_f32: data is null with count = " + std::to_string(count));
    }
    MPI_Request req;
    const int rc0 = MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req);
    return wait("MPI_Iallreduce", rc0, req);
  }
  void abort(int exit_code) override {
    MPI_Abort(MPI_COMM_WORLD, exit_code);
    std::_Exit(exit_code);
  }

 private:
  // Byte counts -> MPI's int counts and displacements (the whole buffer must stay below 2^31).
  Status to_int_counts(const char* what, std::span<const int64_t> bytes, std::vector<int>& counts,
                       std::vector<int>& displs) const {
    if (bytes.size() != static_cast<size_t>(size_)) {
      return invalid_argument(std::string(what) + " has " + std::to_string(bytes.size()) + " entries, expected size() = " +
                              std::to_string(size_));
    }
    counts.resize(bytes.size());
    displs.resize(bytes.size());
    int64_t off = 0;
    for (size_t q = 0; q < bytes.size(); ++q) {
      if (bytes[q] < 0) return invalid_argument(std::string(what) + "[" + std::to_string(q) + "] = " + std::to_string(bytes[q]) + " must be >= 0");
      if (off + bytes[q] > INT_MAX) {
        return unsupported(std::string(what) + ": " + std::to_string(off + bytes[q]) +
                           " bytes in one call exceed MPI's int displacement limit 2^31 - 1; split the batch");
      }
      counts[q] = static_cast<int>(bytes[q]);
      displs[q] = static_cast<int>(off);
      off += bytes[q];
    }
    return Status::ok();
  }

  // Polls `req` until it completes or the deadline passes: spins briefly (latency), then yields
  // and sleeps (oversubscribed ranks must let their peers run).
  Status wait(const char* what, int start_code, MPI_Request& req) const {
    if (start_code != MPI_SUCCESS) {
      g_lifetime.peer_failed = true;
      return unavailable("rank " + std::to_string(rank_) + ": " + what + " failed: " + mpi_error(start_code));
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0;; ++i) {
      int done = 0;
      const int rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        g_lifetime.peer_failed = true;
        return unavailable("rank " + std::to_string(rank_) + ": " + what + " failed: " + mpi_error(rc));
      }
      if (done) return Status::ok();
      if (i < 2000) continue;
      if (i < 4000) {
        std::this_thread::yield();
        continue;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      if ((i & 63) == 0) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (s > timeout_s_) {
          g_lifetime.peer_failed = true;
          return unavailable("rank " + std::to_string(rank_) + " of " + std::to_string(size_) + ": " + what +
                             " did not complete within the timeout of " + std::to_string(static_cast<int>(timeout_s_)) +
                             " s: a peer rank has exited, crashed or hangs");
        }
      }
    }
  }

  int rank_, size_;
  double timeout_s_;
};

}  // namespace

Status mpi_available() { return Status::ok(); }

std::string mpi_library_version() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  if (MPI_Get_library_version(buf, &len) != MPI_SUCCESS) return "MPI (version unknown)";
  std::string v(buf, static_cast<size_t>(len));
  const auto cut = v.find_first_of(",\n");  // "Open MPI v4.1.4, package: ..." -> "Open MPI v4.1.4"
  return cut == std::string::npos ? v : v.substr(0, cut);
}

Result<std::unique_ptr<Communicator>> make_mpi_communicator(const MpiOptions& options) {
  if (!(options.timeout_s > 0) || options.timeout_s > 86400) {
    return invalid_argument("MpiOptions.timeout_s = " + std::to_string(options.timeout_s) + " must be in (0, 86400]");
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) return unavailable("MPI has already been finalized in this process");
  if (!initialized) {
    int provided = 0;
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    if (rc != MPI_SUCCESS) return unavailable("MPI_Init_thread failed: " + mpi_error(rc));
    g_lifetime.we_initialized = true;
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return std::unique_ptr<Communicator>(std::make_unique<MpiCommunicator>(rank, size, options.timeout_s));
}

}  // namespace k3::comm
