// The MPI communicator's collectives against what each rank knows the others sent.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "mpi/mpi_world.hpp"

namespace {

using k3::comm::Communicator;

TEST(MpiCommunicator, AlltoallvDeliversVariableCountsIncludingEmptyPeers) {
  Communicator& w = k3test::world();
  const int n = w.size(), r = w.rank();
  // rank r sends (r + q) % 3 bytes to rank q (some zero), each byte = 16 r + q.
  std::vector<int64_t> sc(static_cast<size_t>(n)), rc(static_cast<size_t>(n)), got(static_cast<size_t>(n));
  std::vector<uint8_t> send;
  for (int q = 0; q < n; ++q) {
    sc[static_cast<size_t>(q)] = (r + q) % 3;
    for (int i = 0; i < (r + q) % 3; ++i) send.push_back(static_cast<uint8_t>(16 * r + q));
  }
  ASSERT_TRUE(w.alltoall_counts(sc, got).is_ok());
  for (int q = 0; q < n; ++q) {
    rc[static_cast<size_t>(q)] = (q + r) % 3;
    EXPECT_EQ(got[static_cast<size_t>(q)], rc[static_cast<size_t>(q)]) << "count from rank " << q;
  }
  std::vector<uint8_t> recv(static_cast<size_t>(std::accumulate(rc.begin(), rc.end(), int64_t{0})), 0xEE);
  ASSERT_TRUE(w.alltoallv(send.data(), sc, recv.data(), rc).is_ok());
  size_t at = 0;
  for (int q = 0; q < n; ++q) {
    for (int i = 0; i < (q + r) % 3; ++i) EXPECT_EQ(recv[at++], static_cast<uint8_t>(16 * q + r));
  }
}

TEST(MpiCommunicator, AllgatherAndBarrier) {
  Communicator& w = k3test::world();
  const int64_t mine = 1000 + w.rank();
  std::vector<int64_t> all(static_cast<size_t>(w.size()));
  ASSERT_TRUE(w.allgather(&mine, sizeof mine, all.data()).is_ok());
  for (int q = 0; q < w.size(); ++q) EXPECT_EQ(all[static_cast<size_t>(q)], 1000 + q);
  EXPECT_TRUE(w.barrier().is_ok());
}

TEST(MpiCommunicator, CountArraysOfTheWrongSizeAreRefused) {
  Communicator& w = k3test::world();
  std::vector<int64_t> bad(static_cast<size_t>(w.size()) + 1, 0);
  const auto st = w.alltoallv(nullptr, bad, nullptr, bad);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("expected size() = " + std::to_string(w.size())), std::string::npos) << st.message();
}

TEST(MpiCommunicator, CheckSameOnAllRanksNamesTheRankThatDiffers) {
  Communicator& w = k3test::world();
  EXPECT_TRUE(k3::comm::check_same_on_all_ranks(w, "checkpoint digest", "abc").is_ok());
  const std::string v = w.rank() == w.size() - 1 && w.size() > 1 ? "xyz" : "abc";
  const auto st = k3::comm::check_same_on_all_ranks(w, "checkpoint digest", v);
  if (w.size() == 1) {
    EXPECT_TRUE(st.is_ok());
  } else {
    ASSERT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find("rank " + std::to_string(w.size() - 1) + " has 'xyz'"), std::string::npos) << st.message();
  }
}

}  // namespace
