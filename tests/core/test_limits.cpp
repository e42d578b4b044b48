// The machine-limit probes of k3 bench (k3/harness/limits.hpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "k3/harness/limits.hpp"

namespace {

// The probe kept allocated next to the timings: each pass is a finite positive rate, measure() is
// the best of its passes, the buffer is whole 256-byte units and the thread count at least 1.
TEST(Limits, ReadBandwidthProbeMeasuresEachPassAndKeepsItsBuffer) {
  const k3::ReadBandwidthProbe probe(2, (int64_t{8} << 20) + 100);
  EXPECT_EQ(probe.bytes(), int64_t{8} << 20);
  EXPECT_EQ(probe.threads(), 2);
  const auto t = probe.trials(4);
  ASSERT_EQ(t.size(), 4u);
  for (double r : t) {
    EXPECT_TRUE(std::isfinite(r));
    EXPECT_GT(r, 1e8) << "below 0.1 GB/s";
  }
  EXPECT_GT(probe.measure(3), 0);
  EXPECT_GT(probe.measure(0), 0);  // at least one pass
  EXPECT_EQ(k3::ReadBandwidthProbe(0, 1 << 20).threads(), 1);
}

TEST(Limits, ReadBandwidthIsTheBestOfItsTrials) {
  const k3::MeasuredRate r = k3::measure_read_bandwidth(1, int64_t{16} << 20);
  EXPECT_GT(r.value, 0);
  EXPECT_EQ(r.value, r.max);
  EXPECT_LE(r.min, r.median);
  EXPECT_LE(r.median, r.max);
  EXPECT_NE(r.what.find("16 MiB buffer, 1 thread(s) (best of 5)"), std::string::npos) << r.what;
}

}  // namespace
