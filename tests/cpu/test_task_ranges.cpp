// The decode schedule (cpu/task_ranges.hpp): every task exactly once, contiguous ranges of
// near-equal cost, and the ends of a slow thread's range taken by the others.
#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "cpu/task_ranges.hpp"

namespace k3::cpu::detail {
namespace {

TEST(TaskRanges, ClaimsEachTaskOnceFromEitherEnd) {
  TaskRange r;
  r.set(3, 7);
  EXPECT_EQ(r.left(), 4);
  int64_t t = -1;
  ASSERT_TRUE(r.claim(false, t));
  EXPECT_EQ(t, 3);
  ASSERT_TRUE(r.claim(true, t));
  EXPECT_EQ(t, 6);
  ASSERT_TRUE(r.claim(true, t));
  EXPECT_EQ(t, 5);
  ASSERT_TRUE(r.claim(false, t));
  EXPECT_EQ(t, 4);
  EXPECT_EQ(r.left(), 0);
  EXPECT_FALSE(r.claim(false, t));
  EXPECT_FALSE(r.claim(true, t));
  r.set(5, 5);
  EXPECT_FALSE(r.claim(true, t));
}

// The starting ranges: contiguous, in thread order, covering every task once, of near-equal
// cost (the old schedule, unchanged).
TEST(TaskRanges, StartingRangesSplitTheCostEvenly) {
  constexpr int64_t n = 64;
  auto cost = [](int64_t j) { return j < 32 ? int64_t{3} : int64_t{1}; };  // total 128
  int64_t first = -1, last = -1;
  starting_range(0, 2, n, 128, cost, first, last);
  EXPECT_EQ(first, 0);
  EXPECT_EQ(last, 22);  // the prefix reaches 64 at task 22 (cost 66)
  starting_range(1, 2, n, 128, cost, first, last);
  EXPECT_EQ(first, 22);
  EXPECT_EQ(last, n);
  for (int t : {1, 3, 7, 64, 100}) {
    int64_t next = 0;
    for (int i = 0; i < t; ++i) {
      starting_range(i, t, n, 128, cost, first, last);
      EXPECT_EQ(first, next) << "thread " << i << " of " << t;
      EXPECT_LE(first, last);
      next = last;
    }
    EXPECT_EQ(next, n) << t << " threads";
  }
}

TEST(TaskRanges, EveryTaskRunsOnceWhateverTheTeam) {
  for (int threads : {1, 2, 3, 8}) {
    for (int64_t n : {1, 2, 5, 97}) {
      std::vector<std::atomic<int>> runs(static_cast<size_t>(n));
      run_ranges(threads, n, [](int64_t j) { return 1 + j % 4; }, [&](int64_t j) { runs[j].fetch_add(1); });
      for (int64_t j = 0; j < n; ++j) ASSERT_EQ(runs[j].load(), 1) << threads << " threads, n " << n << ", task " << j;
    }
  }
}

// A thread slowed down (a busy vCPU) loses the end of its range to the others, and every task
// still runs exactly once; without the stealing thread 0 would run all of [0, 32).
TEST(TaskRanges, TheOthersTakeTheEndOfASlowThreadsRange) {
  constexpr int64_t n = 64;
  std::vector<int> owner(n, -1);
  std::vector<std::atomic<int>> runs(n);
  std::atomic<int> team{0};
  run_ranges(4, n, [](int64_t) { return int64_t{1}; }, [&](int64_t j) {
    const int me = omp_get_thread_num();
    team.store(omp_get_num_threads());
    owner[j] = me;
    runs[j].fetch_add(1);
    std::this_thread::sleep_for(std::chrono::microseconds(me == 0 ? 20000 : 500));
  });
  for (int64_t j = 0; j < n; ++j) ASSERT_EQ(runs[j].load(), 1) << "task " << j;
  if (team.load() < 4) GTEST_SKIP() << "OpenMP gave a team of " << team.load() << " (OMP_THREAD_LIMIT?)";
  // While thread 0 sleeps 20 ms per task, the three others finish their 16 tasks (8 ms) and
  // take thread 0's range [0, 16) from the back (a loose bound: a loaded CI machine may delay
  // them).
  int by_zero = 0;
  for (int64_t j = 0; j < n; ++j) by_zero += owner[j] == 0;
  EXPECT_LE(by_zero, 8) << "thread 0 ran " << by_zero << " of its 16 tasks";
  EXPECT_NE(owner[15], 0);
}

TEST(TaskRanges, FewerTasksThanThreadsAndNoTasks) {
  std::vector<std::atomic<int>> runs(3);
  run_ranges(8, 3, [](int64_t) { return int64_t{1}; }, [&](int64_t j) { runs[j].fetch_add(1); });
  for (auto& r : runs) EXPECT_EQ(r.load(), 1);
  int calls = 0;
  run_ranges(8, 0, [](int64_t) { return int64_t{1}; }, [&](int64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
}

}  // namespace
}  // namespace k3::cpu::detail
