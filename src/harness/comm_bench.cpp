// bench_allreduce (k3/harness/comm_bench.hpp): k3's exact all-reduce, its fused RMSNorm variant and the
// transport's own FP32 all-reduce on the same bytes, median per rank, max over ranks.
#include "k3/harness/comm_bench.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <new>
#include <string>

#include "k3/allreduce.hpp"
#include "k3/formats.hpp"

namespace k3::comm {
namespace {

constexpr int64_t kCols = 3584;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Median of `iters` timed calls of fn (microseconds) after `warmup` untimed ones; `before` runs
// untimed ahead of each call (e.g. restoring an in-place buffer), then a barrier.
template <typename Fn, typename Before>
Result<double> time_us(Communicator& comm, int warmup, int iters, Before before, Fn fn) {
  for (int i = 0; i < warmup; ++i) {
    before();
    K3_RETURN_IF_ERROR(fn());
  }
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    before();
    K3_RETURN_IF_ERROR(comm.barrier());
    const auto t0 = std::chrono::steady_clock::now();
    K3_RETURN_IF_ERROR(fn());
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(std::move(t));
}

uint16_t random_bf16(uint64_t& state) {
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  const double u = static_cast<double>(state >> 11) * 0x1p-53;  // [0, 1)
  return bf16_from_f32(static_cast<float>(2.0 * u - 1.0));
}

Result<std::vector<AllreduceBenchRecord>> bench_impl(Communicator& comm, std::span<const AllreduceShape> shapes,
                                                     int iters, int threads) {
  if (iters < 1 || iters > 10000) return invalid_argument("bench_allreduce: iters = " + std::to_string(iters) + " must be in [1, 10000]");
  std::string key = "iters=" + std::to_string(iters);
  for (size_t k = 0; k < shapes.size(); ++k) {
    const AllreduceShape& s = shapes[k];
    if (s.rows < 1 || s.rows > (int64_t{1} << 24) || s.cols < 1 || s.cols > kAllreduceMaxCols ||
        s.rows * s.cols * 2 > (int64_t{1} << 36)) {
      return invalid_argument("bench_allreduce: shapes[" + std::to_string(k) + "] = " + std::to_string(s.rows) + " x " +
                              std::to_string(s.cols) + " must have rows in [1, 2^24], cols in [1, " +
                              std::to_string(kAllreduceMaxCols) + "] and at most 2^36 bytes");
    }
    key += ',' + std::to_string(s.rows) + 'x' + std::to_string(s.cols);
  }
  K3_RETURN_IF_ERROR(check_same_on_all_ranks(comm, "bench_allreduce sizes and iters", key));
  const int w = comm.size();
  const int warmup = std::max(2, iters / 5);
  const AllreduceOptions opt{.threads = threads};
  std::vector<AllreduceBenchRecord> table;
  for (const AllreduceShape& shape : shapes) {
    AllreduceBenchRecord rec;
    rec.cols = shape.cols;
    rec.rows = shape.rows;
    rec.bytes = rec.rows * rec.cols * 2;
    const auto n = static_cast<size_t>(rec.rows * rec.cols);
    // x differs per rank; residual and gamma are replicated, as in tensor parallelism.
    uint64_t state = 0x9E3779B97F4A7C15ull;
    std::vector<uint16_t> x(n), residual(n), out(n), residual_out(n), gamma(static_cast<size_t>(rec.cols));
    for (auto& v : residual) v = random_bf16(state);
    for (auto& v : gamma) v = bf16_from_f32(1.0f + 0.25f * bf16_to_f32(random_bf16(state)));
    state ^= static_cast<uint64_t>(comm.rank() + 1) * 0xD1B54A32D192ED03ull;
    for (auto& v : x) v = random_bf16(state);
    const auto nothing = [] {};
    K3_ASSIGN_OR_RETURN(rec.k3_us, time_us(comm, warmup, iters, nothing,
                                           [&] { return allreduce_bf16(comm, x, rec.rows, rec.cols, out, opt); }));
    K3_ASSIGN_OR_RETURN(rec.k3_rmsnorm_us, time_us(comm, warmup, iters, nothing, [&] {
                          return allreduce_add_rmsnorm_bf16(comm, x, residual, gamma, rec.rows, rec.cols, 1e-6f, out,
                                                            residual_out, opt);
                        }));
    const auto floats = static_cast<size_t>(rec.bytes / 4);
    std::vector<float> pristine(floats), data(floats);
    for (size_t i = 0; i < floats; ++i) pristine[i] = bf16_to_f32(random_bf16(state));
    K3_ASSIGN_OR_RETURN(rec.native_us, time_us(
                                           comm, warmup, iters, [&] { std::copy(pristine.begin(), pristine.end(), data.begin()); },
                                           [&] { return comm.native_allreduce_sum_f32(data.data(), static_cast<int64_t>(floats)); }));
    // Every rank reports the slowest rank's median.
    const double mine[3] = {rec.k3_us, rec.k3_rmsnorm_us, rec.native_us};
    std::vector<double> all(3 * static_cast<size_t>(w));
    K3_RETURN_IF_ERROR(comm.allgather(mine, sizeof mine, all.data()));
    for (int q = 0; q < w; ++q) {
      rec.k3_us = std::max(rec.k3_us, all[3 * static_cast<size_t>(q)]);
      rec.k3_rmsnorm_us = std::max(rec.k3_rmsnorm_us, all[3 * static_cast<size_t>(q) + 1]);
      rec.native_us = std::max(rec.native_us, all[3 * static_cast<size_t>(q) + 2]);
    }
    if (w > 1) {
      const double moved = 2.0 * (w - 1) / w * static_cast<double>(rec.bytes);
      rec.k3_busbw_gbs = rec.k3_us > 0 ? moved / (rec.k3_us * 1e3) : 0;
      rec.native_busbw_gbs = rec.native_us > 0 ? moved / (rec.native_us * 1e3) : 0;
    }
    table.push_back(rec);
  }
  return table;
}

}  // namespace

Result<std::vector<AllreduceBenchRecord>> bench_allreduce(Communicator& comm, std::span<const int64_t> sizes_bytes,
                                                          int iters, int threads) {
  std::vector<AllreduceShape> shapes;
  for (size_t k = 0; k < sizes_bytes.size(); ++k) {
    const int64_t b = sizes_bytes[k];
    if (b < 2 || b > (int64_t{1} << 36)) {
      return invalid_argument("bench_allreduce: sizes_bytes[" + std::to_string(k) + "] = " + std::to_string(b) +
                              " must be in [2, 2^36]");
    }
    shapes.push_back(b >= 2 * kCols ? AllreduceShape{b / (2 * kCols), kCols} : AllreduceShape{1, b / 2});
  }
  return bench_allreduce_shapes(comm, shapes, iters, threads);
}

Result<std::vector<AllreduceBenchRecord>> bench_allreduce_shapes(Communicator& comm, std::span<const AllreduceShape> shapes,
                                                                 int iters, int threads) {
  try {
    return bench_impl(comm, shapes, iters, threads);
  } catch (const std::bad_alloc&) {  // the inputs of a size too large for this machine
    return unavailable("bench_allreduce: out of memory for the benchmark buffers (rank " + std::to_string(comm.rank()) +
                       ")");
  }
}

}  // namespace k3::comm
