// Microbenchmarks of the host MX codecs (single thread of the row quantizer).
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "k3/mx.hpp"

namespace {

void BM_MxQuantize(benchmark::State& state) {
  const auto el = static_cast<k3::MxElement>(state.range(0));
  const int64_t rows = 64, cols = 3584;
  std::vector<float> x(rows * cols);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  std::vector<uint8_t> q(rows * k3::mx_row_bytes(el, cols)), s(rows * cols / 32);
  for (auto _ : state) {
    auto st = k3::mx_quantize(x, rows, cols, el, k3::ScaleRule::kRceil, q, s);
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(q.data());
  }
  state.SetItemsProcessed(state.iterations() * rows * cols);
}
BENCHMARK(BM_MxQuantize)->Arg(0)->Arg(1)->ArgNames({"e4m3"});

}  // namespace
