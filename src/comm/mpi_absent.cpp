// Builds without MPI: the MPI transport reports why it is missing.
#include "k3/comm.hpp"

namespace k3::comm {

Status mpi_available() {
  return unsupported("k3 was built without MPI (install libopenmpi-dev and reconfigure with K3_MPI=AUTO or ON)");
}

std::string mpi_library_version() { return {}; }

Result<std::unique_ptr<Communicator>> make_mpi_communicator(const MpiOptions&) { return mpi_available(); }

}  // namespace k3::comm
