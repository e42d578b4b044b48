// Microbenchmarks of the CPU linear layer's decode route (M = rows = 1 or 2, one thread, W8A16): streamed from
// memory (copies of the seed's 3584 -> 7168 layer rotated past the caches) and from L2 (a small
// layer), at the level K3_ISA selects. Counter: weight bytes (E4M3 codes + E8M0 scales) per second;
// compare with BM_StreamRead (bench_cpu_moe.cpp), one core's plain read of a weight stream.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "k3/cpu_linear.hpp"
#include "k3/formats.hpp"
#include "k3/system.hpp"

namespace {

void linear_decode(benchmark::State& state, int64_t k, int64_t n, int copies) {
  const int rows = static_cast<int>(state.range(0));
  const auto isa = k3::active_isa_level();
  if (!isa.is_ok()) {
    state.SkipWithError(isa.status().to_string().c_str());
    return;
  }
  k3::LinearProblem p;
  p.k = k;
  p.n = n;
  p.recipe = k3::LinearRecipe::kW8A16;
  k3::cpu::LinearOptions o;
  o.threads = 1;
  o.isa = isa.value();
  o.max_tokens = rows;
  auto plan = k3::cpu::plan(p, o);
  if (!plan.is_ok()) {
    state.SkipWithError(plan.status().to_string().c_str());
    return;
  }
  std::mt19937 rng(5);
  std::vector<uint8_t> codes(static_cast<size_t>(n * k)), scales(static_cast<size_t>(n * k / 32), 120);
  for (auto& c : codes) {
    c = static_cast<uint8_t>(rng() & 0xFF);
    if ((c & 0x7F) == 0x7F) c = 0x7E;  // no NaN codes
  }
  k3::LinearWeightsView wv;
  wv.codes = codes;
  wv.scales = scales;
  std::vector<k3::cpu::PackedLinear> packed;
  for (int c = 0; c < copies; ++c) {
    auto pk = k3::cpu::prepack(plan.value(), wv);
    if (!pk.is_ok()) {
      state.SkipWithError(pk.status().to_string().c_str());
      return;
    }
    packed.push_back(std::move(pk.value()));
  }
  std::normal_distribution<float> nd;
  std::vector<uint16_t> x(static_cast<size_t>(rows * k));
  for (auto& v : x) v = k3::bf16_from_f32(nd(rng));
  std::vector<uint8_t> ws(static_cast<size_t>(plan->workspace_bytes)), out(static_cast<size_t>(rows * n * 2));
  size_t i = 0;
  for (auto _ : state) {
    if (!k3::cpu::run(plan.value(), packed[i], rows, x, ws, out).is_ok()) {
      state.SkipWithError("run failed");
      return;
    }
    benchmark::DoNotOptimize(out.data());
    i = (i + 1) % packed.size();
  }
  state.SetBytesProcessed(state.iterations() * (n * k + n * k / 32));
  state.SetLabel(plan->stream_kernel);
}

void BM_LinearDecodeStream(benchmark::State& state) { linear_decode(state, 3584, 7168, 10); }
BENCHMARK(BM_LinearDecodeStream)->ArgName("rows")->Arg(1)->Arg(2)->UseRealTime();
void BM_LinearDecodeCached(benchmark::State& state) { linear_decode(state, 1024, 448, 1); }
BENCHMARK(BM_LinearDecodeCached)->ArgName("rows")->Arg(1)->Arg(2)->UseRealTime();

}  // namespace
