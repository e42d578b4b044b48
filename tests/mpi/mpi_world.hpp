// The multi-rank tests' communicator (MPI_COMM_WORLD of the mpirun that started the test).
#pragma once

#include "k3/comm.hpp"

namespace k3test {
k3::comm::Communicator& world();
}  // namespace k3test
