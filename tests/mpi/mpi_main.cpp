// GoogleTest main of the multi-rank tests: every rank runs every test (the collectives inside a
// test are called by all ranks in the same order); rank 0 prints, the others stay quiet, and the
// process exit code is non-zero on every rank when any rank failed a test.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "mpi/mpi_world.hpp"

namespace k3test {

k3::comm::Communicator& world() {
  static std::unique_ptr<k3::comm::Communicator> comm = [] {
    auto c = k3::comm::make_mpi_communicator({.timeout_s = 300});
    if (!c.is_ok()) {
      std::fprintf(stderr, "k3_mpi_tests: %s\n", c.status().to_string().c_str());
      std::exit(2);
    }
    return std::move(c).value();
  }();
  return *comm;
}

}  // namespace k3test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto& w = k3test::world();
  if (w.rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int mine = RUN_ALL_TESTS();
  std::vector<int> all(static_cast<size_t>(w.size()));
  if (const auto st = w.allgather(&mine, sizeof mine, all.data()); !st.is_ok()) {
    std::fprintf(stderr, "k3_mpi_tests: %s\n", st.to_string().c_str());
    return 2;
  }
  int failed = 0;
  for (int q = 0; q < w.size(); ++q) {
    if (all[static_cast<size_t>(q)] != 0) {
      if (w.rank() == 0) std::fprintf(stderr, "k3_mpi_tests: rank %d of %d failed\n", q, w.size());
      failed = 1;
    }
  }
  return failed;
}
