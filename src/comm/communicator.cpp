// The communicator's transport-independent parts: the one-process communicator and the
// agreement check. (The MPI transport: mpi.cpp, or mpi_absent.cpp in builds without MPI.)
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "k3/comm.hpp"

namespace k3::comm {
namespace {

class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* transport() const override { return "self"; }

  Status alltoallv(const void* send, std::span<const int64_t> send_bytes, void* recv,
                   std::span<const int64_t> recv_bytes) override {
    K3_RETURN_IF_ERROR(check_counts("alltoallv send_bytes", send_bytes));
    K3_RETURN_IF_ERROR(check_counts("alltoallv recv_bytes", recv_bytes));
    if (send_bytes[0] != recv_bytes[0]) {
      return invalid_argument("alltoallv: rank 0 sends " + std::to_string(send_bytes[0]) + " bytes to itself but expects " +
                              std::to_string(recv_bytes[0]));
    }
    if (send_bytes[0] > 0) std::memmove(recv, send, static_cast<size_t>(send_bytes[0]));
    return Status::ok();
  }
  Status alltoall_counts(std::span<const int64_t> send, std::span<int64_t> recv) override {
    if (send.size() != 1 || recv.size() != 1) return invalid_argument("alltoall_counts: spans must have size() = 1 entries");
    recv[0] = send[0];
    return Status::ok();
  }
  Status allgather(const void* send, int64_t bytes, void* recv) override {
    if (bytes < 0) return invalid_argument("allgather: bytes = " + std::to_string(bytes) + " must be >= 0");
    if (bytes > 0) std::memmove(recv, send, static_cast<size_t>(bytes));
    return Status::ok();
  }
  Status allgatherv(const void* send, int64_t send_bytes, void* recv, std::span<const int64_t> recv_bytes) override {
    K3_RETURN_IF_ERROR(check_counts("allgatherv recv_bytes", recv_bytes));
    if (recv_bytes[0] != send_bytes) {
      return invalid_argument("allgatherv: recv_bytes[0] = " + std::to_string(recv_bytes[0]) +
                              " differs from send_bytes = " + std::to_string(send_bytes));
    }
    return allgather(send, send_bytes, recv);
  }
  Status barrier() override { return Status::ok(); }
  Status native_allreduce_sum_f32(float* data, int64_t count) override {
    if (count < 0) return invalid_argument("native_allreduce_sum_f32: count = " + std::to_string(count) + " must be >= 0");
    if (count > 0 && data == nullptr) return invalid_argument("native_allreduce_sum_f32: data is null with count = " + std::to_string(count));
    return Status::ok();  // the sum over one rank is the data itself
  }
  void abort(int exit_code) override { std::_Exit(exit_code); }

 private:
  static Status check_counts(const char* what, std::span<const int64_t> c) {
    if (c.size() != 1) return invalid_argument(std::string(what) + " has " + std::to_string(c.size()) + " entries, expected size() = 1");
    if (c[0] < 0) return invalid_argument(std::string(what) + "[0] = " + std::to_string(c[0]) + " must be >= 0");
    return Status::ok();
  }
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator() { return std::make_unique<SelfCommunicator>(); }

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

Status check_same_on_all_ranks(Communicator& comm, const std::string& what, const std::string& value) {
  const int n = comm.size();
  const int64_t mine = static_cast<int64_t>(value.size());
  std::vector<int64_t> lens(static_cast<size_t>(n));
  K3_RETURN_IF_ERROR(comm.allgather(&mine, sizeof mine, lens.data()));
  std::vector<int64_t> offsets(static_cast<size_t>(n) + 1, 0);
  for (int q = 0; q < n; ++q) {
    if (lens[static_cast<size_t>(q)] < 0 || lens[static_cast<size_t>(q)] > (int64_t{1} << 20)) {
      return invalid_argument("rank " + std::to_string(q) + " sent a " + what + " of " +
                              std::to_string(lens[static_cast<size_t>(q)]) + " bytes (limit 1 MiB)");
    }
    offsets[static_cast<size_t>(q) + 1] = offsets[static_cast<size_t>(q)] + lens[static_cast<size_t>(q)];
  }
  std::string all(static_cast<size_t>(offsets.back()), '\0');
  K3_RETURN_IF_ERROR(comm.allgatherv(value.data(), mine, all.data(), lens));
  const std::string first = all.substr(0, static_cast<size_t>(lens[0]));
  for (int q = 1; q < n; ++q) {
    std::string v = all.substr(static_cast<size_t>(offsets[static_cast<size_t>(q)]), static_cast<size_t>(lens[static_cast<size_t>(q)]));
    if (v != first) {
      return invalid_argument(what + " differs between ranks: rank " + std::to_string(q) + " has '" + v +
                              "', rank 0 has '" + first + "' (every rank must be started with the same " + what + ")");
    }
  }
  return Status::ok();
}

Status agree_on_status(Communicator& comm, const Status& local) {
  const int n = comm.size();
  const int32_t mine = static_cast<int32_t>(local.code());
  std::vector<int32_t> codes(static_cast<size_t>(n));
  K3_RETURN_IF_ERROR(comm.allgather(&mine, sizeof mine, codes.data()));
  int first = -1;
  for (int q = 0; q < n && first < 0; ++q) first = codes[static_cast<size_t>(q)] != 0 ? q : -1;
  if (first < 0) return Status::ok();
  // The failing rank's message, to everyone (a second, small collective only on failure).
  const std::string msg = comm.rank() == first ? local.message() : std::string();
  const int64_t len = static_cast<int64_t>(msg.size());
  std::vector<int64_t> lens(static_cast<size_t>(n));
  K3_RETURN_IF_ERROR(comm.allgather(&len, sizeof len, lens.data()));
  int64_t total = 0;
  for (const int64_t l : lens) total += l;
  std::string all(static_cast<size_t>(total), '\0');
  K3_RETURN_IF_ERROR(comm.allgatherv(msg.data(), len, all.data(), lens));
  const auto code = static_cast<StatusCode>(codes[static_cast<size_t>(first)]);
  return Status(code, "rank " + std::to_string(first) + " of " + std::to_string(n) + ": " + all);
}

}  // namespace k3::comm
