// `k3 moe run --backend cpu` on a synthetic checkpoint: the CPU backend's output agrees with the
// reference backend (contract oracle rounded once) within the contract tolerance, and the CPU
// backend is the default when no GPU backend is usable.
#include <gtest/gtest.h>

#include "tools/cli_run.hpp"

#include <array>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/st_test_util.hpp"
#include "core/synth_test_util.hpp"
#include "k3/harness/checkpoint_synth.hpp"
#include "k3/formats.hpp"
#include "k3/safetensors.hpp"

namespace k3 {
namespace {

using k3::test::CliRun;
using k3::test::run_cli;

// FP32 outputs: NRMSE vs the reference backend (FP32 accumulation order; same bound as the
// unit tests' worst case with one intermediate flip in a token, tests/cpu/test_cpu_moe.cpp).
constexpr double kMaxNrmse = 3e-2;

template <typename T>
std::span<const uint8_t> bytes_of(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

std::vector<float> read_out(const std::string& path) {
  auto f = st::File::open(path);
  EXPECT_TRUE(f.is_ok()) << f.status().to_string();
  if (!f.is_ok()) return {};
  const auto* t = f->find("out");
  EXPECT_NE(t, nullptr);
  if (t == nullptr) return {};
  const auto b = f->bytes(*t);
  std::vector<float> v(b.size() / 4);
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

TEST(MoeCliCpu, RunOnTheCpuBackendAgreesWithTheReferenceAndIsTheDefault) {
  test::TempDir io("moe_cli_cpu");
  const std::string dir = io.file("ckpt");
  const SynthOptions o = test::small_synth_options(dir, 5);
  ASSERT_TRUE(write_synthetic_checkpoint(o).is_ok());
  const int64_t m = 6, k = 64, e = 8;
  std::mt19937_64 rng(12);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(m * k), logits(m * e);
  for (auto& v : x) v = nd(rng);
  for (auto& v : logits) v = nd(rng);
  st::Writer w;
  ASSERT_TRUE(w.add("x", st::DType::kF32, {m, k}, bytes_of(x)).is_ok());
  ASSERT_TRUE(w.add("logits", st::DType::kF32, {m, e}, bytes_of(logits)).is_ok());
  const std::string in = io.file("in.safetensors");
  ASSERT_TRUE(w.write(in).is_ok());
  for (const char* recipe : {"w4a8", "w4a16"}) {
    std::vector<std::vector<float>> outs;
    for (const char* backend : {"reference", "cpu", ""}) {
      const std::string out = io.file(std::string("out_") + recipe + backend + ".safetensors");
      const std::string be = *backend ? std::string(" --backend ") + backend : "";
      const auto r = run_cli("moe run --checkpoint " + dir + " --layer 1 --ep-size 2 --ep-rank 1 --input " + in +
                         " --output " + out + " --recipe " + recipe + " --out-dtype fp32" + be);
      ASSERT_EQ(r.code, 0) << r.out;
      if (!*backend) {
        // Without a GPU backend the default is the CPU backend.
        const bool gpu = r.out.find("backend cuda") != std::string::npos;
        if (!gpu) {
          EXPECT_NE(r.out.find("backend cpu"), std::string::npos) << r.out;
        }
      }
      outs.push_back(read_out(out));
    }
    ASSERT_EQ(outs[0].size(), static_cast<size_t>(m * k));
    ASSERT_EQ(outs[1].size(), outs[0].size());
    double se = 0, sr = 0;
    for (size_t i = 0; i < outs[0].size(); ++i) {
      se += (static_cast<double>(outs[1][i]) - outs[0][i]) * (static_cast<double>(outs[1][i]) - outs[0][i]);
      sr += static_cast<double>(outs[0][i]) * outs[0][i];
    }
    ASSERT_GT(sr, 0) << recipe;
    EXPECT_LE(std::sqrt(se / sr), kMaxNrmse) << recipe;
  }
}

}  // namespace
}  // namespace k3
