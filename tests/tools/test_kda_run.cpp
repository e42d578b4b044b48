// `k3 kda run`: tensors in a safetensors file -> o and final_state, equal bit for bit to the
// library calls on the same inputs; errors name the tensor.
#include <gtest/gtest.h>

#include "tools/cli_run.hpp"

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "k3/harness/kda_case.hpp"
#include "k3/backend.hpp"
#include "k3/cpu_kda.hpp"
#include "k3/kda.hpp"
#include "k3/safetensors.hpp"
#include "k3/system.hpp"
#include "scoped_env.hpp"

namespace k3::kda {
namespace {

using k3::test::CliRun;
using k3::test::run_cli;

template <typename T>
std::span<const uint8_t> bytes_of(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

template <typename T>
std::vector<T> read_tensor(const st::File& f, const char* name) {
  const st::TensorInfo* t = f.find(name);
  EXPECT_NE(t, nullptr) << name;
  if (t == nullptr) return {};
  std::vector<T> v(static_cast<size_t>(t->numel()));
  std::memcpy(v.data(), f.bytes(*t).data(), v.size() * sizeof(T));
  return v;
}

// Writes the case's tensors under the names `k3 kda run` reads.
void write_case(const KdaCase& c, const std::string& path, bool batch_dim, const std::string& beta_name,
                const char* skip = "") {
  st::Writer w;
  const auto& k = c.spec.cfg;
  const int64_t T = c.num_tokens, H = k.num_heads;
  auto shape = [&](std::vector<int64_t> s) {
    if (batch_dim) s.insert(s.begin(), 1);
    return s;
  };
  auto add = [&](const char* name, st::DType dt, std::vector<int64_t> s, std::span<const uint8_t> b) {
    if (std::string(name) == skip) return;
    ASSERT_TRUE(w.add(name, dt, std::move(s), b).is_ok()) << name;
  };
  if (c.spec.bf16) {
    add("q", st::DType::kBF16, shape({T, H, k.head_k}), bytes_of(c.q16));
    add("k", st::DType::kBF16, shape({T, H, k.head_k}), bytes_of(c.k16));
    add("v", st::DType::kBF16, shape({T, H, k.head_v}), bytes_of(c.v16));
  } else {
    add("q", st::DType::kF32, shape({T, H, k.head_k}), bytes_of(c.q32));
    add("k", st::DType::kF32, shape({T, H, k.head_k}), bytes_of(c.k32));
    add("v", st::DType::kF32, shape({T, H, k.head_v}), bytes_of(c.v32));
  }
  add("g", st::DType::kF32, shape({T, H, k.head_k}), bytes_of(c.g));
  add(beta_name.c_str(), st::DType::kF32, shape({T, H}), bytes_of(c.beta));
  if (!c.a_log.empty()) {
    add("A_log", st::DType::kF32, {static_cast<int64_t>(c.a_log.size())}, bytes_of(c.a_log));
    add("dt_bias", st::DType::kF32, {H, k.head_k}, bytes_of(c.dt_bias));
  }
  if (!c.cu_seqlens.empty()) {
    add("cu_seqlens", st::DType::kI64, {static_cast<int64_t>(c.cu_seqlens.size())}, bytes_of(c.cu_seqlens));
  }
  if (!c.initial_state.empty()) {
    const bool kf = k.layout == StateLayout::kKFirst;
    add("initial_state", st::DType::kF32,
        {c.num_seqs, H, kf ? k.head_k : k.head_v, kf ? k.head_v : k.head_k}, bytes_of(c.initial_state));
  }
  ASSERT_TRUE(w.write(path).is_ok());
}

TEST(KdaRun, Bf16SafeGateVarlenEqualsTheLibraryBitForBit) {
  CaseSpec s;
  s.cfg.num_heads = 3;
  s.cfg.head_k = 32;
  s.cfg.head_v = 24;
  s.cfg.gate = GateMode::kSafe;
  s.seqlens = {15, 40, 2};
  const KdaCase c = make_case(s);
  const std::string in = ::testing::TempDir() + "kda_run_in1.safetensors";
  const std::string out = ::testing::TempDir() + "kda_run_out1.safetensors";
  write_case(c, in, false, "beta_logits");
  const auto r = run_cli("kda run --threads 3 --input " + in + " --output " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("gate safe"), std::string::npos) << r.out;
  std::vector<float> o(c.o_size()), f(c.state_size());
  cpu::KdaOptions opt;
  opt.threads = 1;
  ASSERT_TRUE(cpu::prefill(c.spec.cfg, c.inputs(), {o, f}, opt).is_ok());
  auto file = st::File::open(out);
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  EXPECT_EQ(read_tensor<float>(file.value(), "o"), o);
  EXPECT_EQ(read_tensor<float>(file.value(), "final_state"), f);
  EXPECT_EQ(file->find("final_state")->shape, (std::vector<int64_t>{3, 3, 32, 24}));
  EXPECT_EQ(file->metadata().at("beta"), "logits");
  std::remove(in.c_str());
  std::remove(out.c_str());
}

TEST(KdaRun, Fp32VFirstBatchDimFp64ReferenceAndGivenBeta) {
  CaseSpec s;
  s.cfg.num_heads = 2;
  s.cfg.head_k = 20;
  s.cfg.head_v = 12;
  s.cfg.gate = GateMode::kLogDecay;
  s.cfg.layout = StateLayout::kVFirst;
  s.cfg.beta_logits = false;
  s.bf16 = false;
  s.seqlens = {9};
  KdaCase c = make_case(s);
  for (auto& b : c.beta) b = 1.0f / (1.0f + std::exp(-b));  // beta itself
  const std::string in = ::testing::TempDir() + "kda_run_in2.safetensors";
  const std::string out = ::testing::TempDir() + "kda_run_out2.safetensors";
  write_case(c, in, true, "beta");
  const auto r = run_cli("kda run --layout v_first --backend fp64-reference --input " + in + " --output " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  std::vector<double> o(c.o_size()), f(c.state_size());
  ASSERT_TRUE(reference_fp64(c.spec.cfg, c.inputs(), o, f).is_ok());
  auto file = st::File::open(out);
  ASSERT_TRUE(file.is_ok());
  EXPECT_EQ(read_tensor<double>(file.value(), "o"), o);
  EXPECT_EQ(read_tensor<double>(file.value(), "final_state"), f);
  EXPECT_EQ(file->metadata().at("state_layout"), "v_first");
  // The same file with the state read as K-first has the wrong shape: an error, not garbage.
  const auto bad = run_cli("kda run --input " + in + " --output " + out);
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.out.find("tensor 'initial_state' has shape [1, 2, 12, 20], expected [1, 2, 20, 12]"),
            std::string::npos)
      << bad.out;
  std::remove(in.c_str());
  std::remove(out.c_str());
}

TEST(KdaRun, ErrorsNameTheTensor) {
  CaseSpec s;
  s.cfg.num_heads = 2;
  s.cfg.head_k = 8;
  s.cfg.head_v = 8;
  s.cfg.gate = GateMode::kLogDecay;
  s.seqlens = {4};
  const KdaCase c = make_case(s);
  const std::string in = ::testing::TempDir() + "kda_run_in3.safetensors";
  const std::string out = ::testing::TempDir() + "kda_run_out3.safetensors";
  write_case(c, in, false, "beta", "q");
  auto r = run_cli("kda run --input " + in + " --output " + out);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("tensor 'q' is missing"), std::string::npos) << r.out;
  write_case(c, in, false, "beta");
  r = run_cli("kda run --gate sigmoid --input " + in + " --output " + out);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("gate 'sigmoid' is unknown"), std::string::npos) << r.out;
  r = run_cli("kda run --gate safe --input " + in + " --output " + out);
  EXPECT_NE(r.out.find("--gate safe needs the tensor 'A_log'"), std::string::npos) << r.out;
  r = run_cli("kda run --backend gpu --input " + in + " --output " + out);
  EXPECT_NE(r.out.find("--backend gpu is unknown (known: cpu, cuda, reference, fp32-reference (= reference), "
                       "fp64-reference)"),
            std::string::npos)
      << r.out;
  r = run_cli("kda run --input /nonexistent/x.safetensors --output " + out);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(run_cli("kda run --input " + in).code, 0);  // --output is required
  // Both beta and beta_logits.
  st::Writer w;
  auto f = st::File::open(in);
  ASSERT_TRUE(f.is_ok());
  for (const auto& t : f->tensors()) ASSERT_TRUE(w.add(t.name, t.dtype, t.shape, f->bytes(t)).is_ok());
  ASSERT_TRUE(w.add("beta_logits", st::DType::kF32, {4, 2}, bytes_of(c.beta)).is_ok());
  const std::string in2 = ::testing::TempDir() + "kda_run_in4.safetensors";
  ASSERT_TRUE(w.write(in2).is_ok());
  r = run_cli("kda run --input " + in2 + " --output " + out);
  EXPECT_NE(r.out.find("exactly one of 'beta'"), std::string::npos) << r.out;
  std::remove(in.c_str());
  std::remove(in2.c_str());
  std::remove(out.c_str());
}

KdaCase small_case() {
  CaseSpec s;
  s.cfg.num_heads = 2;
  s.cfg.head_k = 16;
  s.cfg.head_v = 24;
  s.cfg.gate = GateMode::kSafe;
  s.seqlens = {7, 30};
  return make_case(s);
}

// `--backend` takes the registry's names; `reference` is the FP32 recurrence that
// `fp32-reference` named before (still accepted), bit for bit.
TEST(KdaRun, ReferenceBackendIsTheFp32ReferenceUnderBothNames) {
  const KdaCase c = small_case();
  const std::string in = ::testing::TempDir() + "kda_run_in5.safetensors";
  const std::string out = ::testing::TempDir() + "kda_run_out5.safetensors";
  write_case(c, in, false, "beta_logits");
  std::vector<float> o(c.o_size()), f(c.state_size());
  ASSERT_TRUE(reference_fp32(c.spec.cfg, c.inputs(), {o, f}).is_ok());
  for (const char* name : {"reference", "fp32-reference"}) {
    const auto r = run_cli(std::string("kda run --backend ") + name + " --input " + in + " --output " + out);
    ASSERT_EQ(r.code, 0) << name << "\n" << r.out;
    EXPECT_NE(r.out.find("backend reference (recurrent)"), std::string::npos) << r.out;
    auto file = st::File::open(out);
    ASSERT_TRUE(file.is_ok()) << file.status().to_string();
    EXPECT_EQ(read_tensor<float>(file.value(), "o"), o) << name;
    EXPECT_EQ(read_tensor<float>(file.value(), "final_state"), f) << name;
    EXPECT_EQ(file->metadata().at("backend"), "reference");
    EXPECT_EQ(file->metadata().at("algorithm"), "recurrent");
  }
  // The reference is token-recurrent only; the FP64 oracle likewise.
  for (const char* name : {"reference", "fp64-reference"}) {
    const auto r = run_cli(std::string("kda run --algorithm chunked --backend ") + name + " --input " + in +
                           " --output " + out);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find("token-recurrent only"), std::string::npos) << r.out;
  }
  // cuda without a usable device (every machine that runs this suite in CI): the registry's reason.
  if (!k3::find_kda_backend("cuda").value()->available().is_ok()) {
    const auto cuda = run_cli("kda run --backend cuda --input " + in + " --output " + out);
    EXPECT_EQ(cuda.code, 2) << cuda.out;
    EXPECT_NE(cuda.out.find("--backend cuda is not usable here"), std::string::npos) << cuda.out;
  }
  std::remove(in.c_str());
  std::remove(out.c_str());
}

// The tool reads K3_ISA / K3_NUM_THREADS and passes them to the cpu backend explicitly (the
// library itself reads neither): the level shows in the output, the bits are the library's at
// that level, and a thread count out of range names the variable.
TEST(KdaRun, EnvironmentReachesTheCpuBackendThroughTheTool) {
  const KdaCase c = small_case();
  const std::string in = ::testing::TempDir() + "kda_run_in6.safetensors";
  const std::string out = ::testing::TempDir() + "kda_run_out6.safetensors";
  write_case(c, in, false, "beta_logits");
  {
    k3::test::ScopedEnv isa("K3_ISA", "scalar");
    const auto r = run_cli("kda run --algorithm chunked --input " + in + " --output " + out);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("backend cpu (chunked, isa scalar)"), std::string::npos) << r.out;
    std::vector<float> o(c.o_size()), f(c.state_size());
    cpu::KdaOptions opt;
    opt.algorithm = Algorithm::kChunked;
    opt.isa = IsaLevel::kScalar;
    ASSERT_TRUE(cpu::prefill(c.spec.cfg, c.inputs(), {o, f}, opt).is_ok());
    auto file = st::File::open(out);
    ASSERT_TRUE(file.is_ok());
    EXPECT_EQ(read_tensor<float>(file.value(), "o"), o);
    EXPECT_EQ(file->metadata().at("isa"), "scalar");
    EXPECT_EQ(file->metadata().at("backend"), "cpu");
  }
  {
    const auto r = run_cli("kda run --input " + in + " --output " + out);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(std::string("isa ") + isa_level_name(best_isa_level())), std::string::npos) << r.out;
  }
  {
    k3::test::ScopedEnv threads("K3_NUM_THREADS", "5000");
    const auto r = run_cli("kda run --input " + in + " --output " + out);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find("threads = 5000 (from K3_NUM_THREADS=5000) must be in [0, 256]"), std::string::npos)
        << r.out;
    const auto given = run_cli("kda run --threads 2 --input " + in + " --output " + out);  // --threads wins
    EXPECT_EQ(given.code, 0) << given.out;
  }
  std::remove(in.c_str());
  std::remove(out.c_str());
}

}  // namespace
}  // namespace k3::kda