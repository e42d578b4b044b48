// End to end: a synthetic Kimi-K3 checkpoint (written with the library's writer in a temp dir,
// small shapes) through `k3 validate --op moe --checkpoint` and `k3 moe run`, whose output must
// equal the library's router + contract oracle rounded once; plus `k3 validate --op moe` suites
// and every user-facing error of `k3 moe run`.
#include <gtest/gtest.h>

#include "tools/cli_run.hpp"

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/st_test_util.hpp"
#include "core/synth_test_util.hpp"
#include "k3/checkpoint.hpp"
#include "k3/harness/checkpoint_synth.hpp"
#include "k3/formats.hpp"
#include "k3/moe_ref.hpp"
#include "k3/routing.hpp"
#include "k3/safetensors.hpp"

namespace k3 {
namespace {

using k3::test::CliRun;
using k3::test::run_cli;

// K 64, N 32, E 8, top-3, hidden 96, layer 1, all experts stored.
SynthOptions small_ckpt(const std::string& dir) { return test::small_synth_options(dir); }

template <typename T>
std::span<const uint8_t> bytes_of(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

template <typename T>
std::vector<T> read_tensor(const st::File& f, const std::string& name) {
  const st::TensorInfo* t = f.find(name);
  EXPECT_NE(t, nullptr) << name;
  if (t == nullptr) return {};
  const auto b = f.bytes(*t);
  std::vector<T> v(b.size() / sizeof(T));
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

class MoeCli : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(write_synthetic_checkpoint(small_ckpt(dir_.str())).is_ok()); }
  std::string ckpt() const { return dir_.str(); }
  test::TempDir dir_{"moe_cli"};
  test::TempDir io_{"moe_cli_io"};
};

TEST_F(MoeCli, ValidateOnCheckpointWeightsPasses) {
  const auto r = run_cli("validate --op moe --checkpoint " + ckpt() + " --layer 1 --ep-size 2 --ep-rank 1 --suite smoke");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("ckpt L1 ep2r1 m8 routed loc"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("vs ref"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
  // An uneven partition: 8 experts on 3 ranks, rank 2 holds experts 6 and 7.
  const auto odd = run_cli("validate --op moe --checkpoint " + ckpt() + " --layer 1 --ep-size 3 --ep-rank 2 --suite smoke");
  EXPECT_EQ(odd.code, 0) << odd.out;
  EXPECT_NE(odd.out.find("ckpt L1 ep3r2 m8 routed loc"), std::string::npos) << odd.out;
  EXPECT_EQ(odd.out.find("FAIL"), std::string::npos) << odd.out;
  // Facts come from config.json: asking for another activation fails, a missing layer fails.
  auto bad = run_cli("validate --op moe --checkpoint " + ckpt() + " --layer 1 --activation silu --suite smoke");
  EXPECT_EQ(bad.code, 1) << bad.out;
  EXPECT_NE(bad.out.find("differs from the checkpoint's hidden_act 'situ'"), std::string::npos) << bad.out;
  bad = run_cli("validate --op moe --checkpoint " + ckpt() + " --layer 2 --suite smoke");
  EXPECT_EQ(bad.code, 1) << bad.out;
  EXPECT_NE(bad.out.find("ckpt L2 ep1r0 load"), std::string::npos) << bad.out;
}

TEST_F(MoeCli, RunWithLogitsEqualsRouterPlusOracle) {
  const int64_t m = 5, k = 64, e = 8;
  std::mt19937_64 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(m * k), logits(m * e);
  for (auto& v : x) v = nd(rng);
  for (auto& v : logits) v = nd(rng);
  st::Writer w;
  ASSERT_TRUE(w.add("x", st::DType::kF32, {m, k}, bytes_of(x)).is_ok());
  ASSERT_TRUE(w.add("logits", st::DType::kF32, {m, e}, bytes_of(logits)).is_ok());
  ASSERT_TRUE(w.write(io_.file("in.safetensors")).is_ok());
  for (int rank : {0, 1}) {
    const std::string out_path = io_.file("out" + std::to_string(rank) + ".safetensors");
    const auto r = run_cli("moe run --checkpoint " + ckpt() + " --layer 1 --ep-size 2 --ep-rank " + std::to_string(rank) +
                       " --input " + io_.file("in.safetensors") + " --output " + out_path +
                       " --backend reference --recipe w4a16 --out-dtype fp32");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("M 5, top-3, w4a16 situ -> fp32, backend reference"), std::string::npos) << r.out;

    // The same computation through the library: route with the checkpoint's bias, oracle, round.
    auto layer = load_moe_layer(ckpt(), 1, 2, rank);
    ASSERT_TRUE(layer.is_ok());
    RoutingConfig rc{8, 3, 1, 1, true, 1.0f};
    std::vector<int32_t> ids(m * 3);
    std::vector<float> wts(m * 3);
    ASSERT_TRUE(route(rc, m, logits, layer->router_bias, ids, wts).is_ok());
    std::vector<uint16_t> xb(m * k);
    for (int64_t i = 0; i < m * k; ++i) xb[i] = bf16_from_f32(x[i]);
    MoeProblem p;
    p.shape = layer->shape;
    p.recipe = Recipe::kW4A16;
    p.out_dtype = OutDType::kFP32;
    std::vector<double> ref(m * k);
    ASSERT_TRUE(moe_oracle(p, layer->view(), {m, xb, ids, wts}, OracleKind::kContract, ref).is_ok());
    std::vector<uint8_t> want(m * k * 4);
    round_output(ref, OutDType::kFP32, want);

    auto f = st::File::open(out_path);
    ASSERT_TRUE(f.is_ok()) << f.status().to_string();
    EXPECT_EQ(read_tensor<uint8_t>(f.value(), "out"), want);
    EXPECT_EQ(read_tensor<int32_t>(f.value(), "topk_ids"), ids);
    EXPECT_EQ(read_tensor<float>(f.value(), "topk_weights"), wts);
    EXPECT_EQ(f->find("out")->dtype, st::DType::kF32);
    EXPECT_EQ(f->metadata().at("backend"), "reference");
  }
}

TEST_F(MoeCli, RunWithGivenIdsKeepsThemAndMasksRemoteSlots) {
  const int64_t m = 3, k = 64;
  std::vector<uint16_t> x(m * k);
  for (size_t i = 0; i < x.size(); ++i) x[i] = bf16_from_f32(static_cast<float>(static_cast<int>(i % 13) - 6) * 0.25f);
  const std::vector<int64_t> ids = {0, 5, -1, 7, 6, 4, 1, 2, 3};  // I64 accepted
  const std::vector<float> wts = {0.5f, 0.25f, 9.f, 0.2f, 0.3f, 0.5f, 0.1f, 0.1f, 0.8f};
  st::Writer w;
  ASSERT_TRUE(w.add("x", st::DType::kBF16, {m, k}, bytes_of(x)).is_ok());
  ASSERT_TRUE(w.add("topk_ids", st::DType::kI64, {m, 3}, bytes_of(ids)).is_ok());
  ASSERT_TRUE(w.add("topk_weights", st::DType::kF32, {m, 3}, bytes_of(wts)).is_ok());
  ASSERT_TRUE(w.write(io_.file("ids.safetensors")).is_ok());
  const auto r = run_cli("moe run --checkpoint " + ckpt() + " --layer 1 --ep-size 2 --ep-rank 1 --input " +
                     io_.file("ids.safetensors") + " --output " + io_.file("o.safetensors"));
  ASSERT_EQ(r.code, 0) << r.out;
  auto f = st::File::open(io_.file("o.safetensors"));
  ASSERT_TRUE(f.is_ok());
  EXPECT_EQ(read_tensor<int32_t>(f.value(), "topk_ids"), (std::vector<int32_t>{0, 5, -1, 7, 6, 4, 1, 2, 3}));
  const auto out = read_tensor<uint16_t>(f.value(), "out");  // BF16 by default
  ASSERT_EQ(out.size(), static_cast<size_t>(m * k));
  // Rank 1 holds experts 4..7: token 2 (ids 1, 2, 3) has no local slot -> exact +0.0.
  for (int64_t i = 2 * k; i < 3 * k; ++i) EXPECT_EQ(out[i], 0) << i;
  int nonzero = 0;
  for (int64_t i = 0; i < 2 * k; ++i) nonzero += out[i] != 0;
  EXPECT_GT(nonzero, 0);
}

// config.json with scoring_func = softmax: k3's router only implements sigmoid, so logits are
// refused (the message names scoring_func, its value, the config file and why), but topk_ids +
// topk_weights need no routing and run exactly as with a sigmoid config.
TEST_F(MoeCli, SoftmaxScoringRunsGivenIdsAndRefusesLogitsToRoute) {
  const int64_t m = 2, k = 64;
  const std::vector<float> x(m * k, 0.25f), lg(m * 8, 0.f), wts = {0.5f, 0.3f, 0.2f, 0.6f, 0.3f, 0.1f};
  const std::vector<int32_t> ids = {0, 5, 7, 1, 2, 6};
  st::Writer wi;
  ASSERT_TRUE(wi.add("x", st::DType::kF32, {m, k}, bytes_of(x)).is_ok());
  ASSERT_TRUE(wi.add("topk_ids", st::DType::kI32, {m, 3}, bytes_of(ids)).is_ok());
  ASSERT_TRUE(wi.add("topk_weights", st::DType::kF32, {m, 3}, bytes_of(wts)).is_ok());
  ASSERT_TRUE(wi.write(io_.file("ids.safetensors")).is_ok());
  st::Writer wl;
  ASSERT_TRUE(wl.add("x", st::DType::kF32, {m, k}, bytes_of(x)).is_ok());
  ASSERT_TRUE(wl.add("logits", st::DType::kF32, {m, 8}, bytes_of(lg)).is_ok());
  ASSERT_TRUE(wl.write(io_.file("logits.safetensors")).is_ok());
  auto run = [&](const std::string& in, const std::string& out) {
    return run_cli("moe run --checkpoint " + ckpt() + " --layer 1 --backend reference --input " + io_.file(in) +
                   " --output " + io_.file(out));
  };
  const auto sig = run("ids.safetensors", "sig.safetensors");  // the synthetic config says sigmoid
  ASSERT_EQ(sig.code, 0) << sig.out;

  const std::string cfg_path = dir_.file("config.json");
  std::ifstream cfg_in(cfg_path);
  auto cfg = nlohmann::json::parse(cfg_in);
  nlohmann::json& text = cfg.contains("text_config") ? cfg["text_config"] : cfg;
  ASSERT_EQ(text["moe_router_activation_func"], "sigmoid");
  text["moe_router_activation_func"] = "softmax";
  test::write_text(cfg_path, cfg.dump(1));

  const auto soft = run("ids.safetensors", "soft.safetensors");
  ASSERT_EQ(soft.code, 0) << soft.out;
  auto a = st::File::open(io_.file("sig.safetensors"));
  auto b = st::File::open(io_.file("soft.safetensors"));
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_EQ(read_tensor<uint8_t>(a.value(), "out"), read_tensor<uint8_t>(b.value(), "out"));
  EXPECT_EQ(read_tensor<int32_t>(b.value(), "topk_ids"), ids);

  const auto bad = run("logits.safetensors", "never.safetensors");
  EXPECT_EQ(bad.code, 2) << bad.out;
  for (const std::string& want : std::vector<std::string>{io_.file("logits.safetensors") + ": holds router 'logits'",
                                 cfg_path + ": scoring_func = 'softmax' cannot be routed by k3",
                                 "implements only scoring_func = 'sigmoid'",
                                 "'topk_ids' + 'topk_weights' instead of 'logits' needs no routing"}) {
    EXPECT_NE(bad.out.find(want), std::string::npos) << want << "\n" << bad.out;
  }
  EXPECT_FALSE(std::filesystem::exists(io_.file("never.safetensors")));
  // validate --checkpoint routes synthetic logits: refused with the same reason.
  const auto val = run_cli("validate --op moe --suite smoke --backend reference --checkpoint " + ckpt() + " --layer 1");
  EXPECT_EQ(val.code, 1) << val.out;
  EXPECT_NE(val.out.find("scoring_func = 'softmax' cannot be routed by k3"), std::string::npos) << val.out;
}

TEST_F(MoeCli, RunErrorsNameTheFileAndTensor) {
  const int64_t m = 2, k = 64;
  auto write = [&](const std::string& name, auto fill) {
    st::Writer w;
    fill(w);
    EXPECT_TRUE(w.write(io_.file(name)).is_ok());
    return io_.file(name);
  };
  const std::vector<float> x(m * k, 0.5f), lg(m * 8, 0.f), wts(m * 3, 0.3f);
  const std::vector<int32_t> ids(m * 3, 1);
  auto run = [&](const std::string& in) {
    return run_cli("moe run --checkpoint " + ckpt() + " --layer 1 --input " + in + " --output " + io_.file("e.safetensors"));
  };
  auto expect_error = [&](const CliRun& r, const std::string& needle) {
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find(needle), std::string::npos) << r.out;
  };
  expect_error(run(write("no_x.safetensors", [&](st::Writer& w) {
                 (void)w.add("logits", st::DType::kF32, {m, 8}, bytes_of(lg));
               })),
               "no_x.safetensors: no tensor 'x'");
  expect_error(run(write("wide.safetensors", [&](st::Writer& w) {
                 (void)w.add("x", st::DType::kF32, {1, m * k}, bytes_of(x));
                 (void)w.add("logits", st::DType::kF32, {1, 8}, bytes_of(std::vector<float>(8)));
               })),
               "tensor 'x' (F32 [1, 128]) must be [M, K] with K = 64");
  expect_error(run(write("both.safetensors", [&](st::Writer& w) {
                 (void)w.add("x", st::DType::kF32, {m, k}, bytes_of(x));
                 (void)w.add("logits", st::DType::kF32, {m, 8}, bytes_of(lg));
                 (void)w.add("topk_ids", st::DType::kI32, {m, 3}, bytes_of(ids));
               })),
               "holds both 'logits' and 'topk_ids'");
  expect_error(run(write("neither.safetensors", [&](st::Writer& w) {
                 (void)w.add("x", st::DType::kF32, {m, k}, bytes_of(x));
                 (void)w.add("topk_ids", st::DType::kI32, {m, 3}, bytes_of(ids));
               })),
               "(topk_weights missing)");
  expect_error(run(write("lg.safetensors", [&](st::Writer& w) {
                 (void)w.add("x", st::DType::kF32, {m, k}, bytes_of(x));
                 (void)w.add("logits", st::DType::kF32, {m, 4}, bytes_of(std::vector<float>(m * 4)));
               })),
               "tensor 'logits' (F32 [2, 4]) must have E (num_experts) = 8 columns");
  expect_error(run(write("badid.safetensors", [&](st::Writer& w) {
                 (void)w.add("x", st::DType::kF32, {m, k}, bytes_of(x));
                 std::vector<int32_t> b = ids;
                 b[4] = 8;
                 (void)w.add("topk_ids", st::DType::kI32, {m, 3}, bytes_of(b));
                 (void)w.add("topk_weights", st::DType::kF32, {m, 3}, bytes_of(wts));
               })),
               "element [1, 1] = 8 must be -1 (masked) or a global expert id in [0, 8)");
  expect_error(run(write("wdtype.safetensors", [&](st::Writer& w) {
                 (void)w.add("x", st::DType::kF32, {m, k}, bytes_of(x));
                 (void)w.add("topk_ids", st::DType::kI32, {m, 3}, bytes_of(ids));
                 (void)w.add("topk_weights", st::DType::kI32, {m, 3}, bytes_of(ids));
               })),
               "tensor 'topk_weights' (I32 [2, 3]) must be F32");
  expect_error(run(io_.file("missing.safetensors")), "missing.safetensors");
  const std::string ok_in = write("ok.safetensors", [&](st::Writer& w) {
    (void)w.add("x", st::DType::kF32, {m, k}, bytes_of(x));
    (void)w.add("logits", st::DType::kF32, {m, 8}, bytes_of(lg));
  });
  expect_error(run_cli("moe run --checkpoint " + ckpt() + " --layer 1 --input " + ok_in + " --output " +
                   io_.file("e.safetensors") + " --backend nosuch"),
               "backend 'nosuch' is not known (known: ");
  expect_error(run_cli("moe run --checkpoint " + ckpt() + " --layer 1 --input " + ok_in + " --output " +
                   io_.file("e.safetensors") + " --recipe w4a4"),
               "recipe 'w4a4' is unknown");
  expect_error(run_cli("moe run --checkpoint " + ckpt() + " --layer 1 --input " + ok_in + " --output " +
                   io_.file("e.safetensors") + " --ep-size 9"),
               "--ep-size 9 --ep-rank 0: --ep-size must be at most the checkpoint's 8 experts");  // the flag, not config.json
  EXPECT_NE(run_cli("moe run --layer 1").code, 0);  // missing required options
}

TEST(ValidateMoeCli, SmokeNonfiniteDeterminismPassWithJson) {
  test::TempDir dir("validate_moe");
  const auto r = run_cli("validate --op moe --suite smoke --recipe w4a8 --activation situ --output " + dir.file("v.json"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("smoke m32 ep2r1 uniform w4a8 situ bf16"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("smoke m32 ep3r2 mixed-2of3 w4a8 situ bf16"), std::string::npos) << r.out;  // uneven partition
  std::FILE* f = std::fopen(dir.file("v.json").c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::string text;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) text.append(buf.data(), n);
  std::fclose(f);
  const auto j = nlohmann::json::parse(text);
  int moe_records = 0;
  for (const auto& rec : j["records"]) {
    if (rec["op"] != "moe") continue;
    ++moe_records;
    EXPECT_TRUE(rec["pass"].get<bool>()) << rec.dump();
    EXPECT_EQ(rec["digest"].get<std::string>().size(), 64u) << rec.dump();
  }
  EXPECT_GE(moe_records, 11);  // 11 cases per usable backend
  EXPECT_EQ(moe_records % 11, 0);
  const auto nf = run_cli("validate --op moe --suite nonfinite --recipe w4a16");
  EXPECT_EQ(nf.code, 0) << nf.out;
  EXPECT_NE(nf.out.find("nonfinite local-w nan w4a16 silu bf16"), std::string::npos) << nf.out;
  const auto det = run_cli("validate --op moe --suite determinism --activation swiglu");
  EXPECT_EQ(det.code, 0) << det.out;
  EXPECT_NE(det.out.find("3 runs (1, 2, 3 threads) bit-identical"), std::string::npos) << det.out;
}

TEST(ValidateMoeCli, OptionErrorsAndMissingRequirementsFail) {
  auto r = run_cli("validate --op moe --suite smoke --recipe w4a4");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("recipe 'w4a4' is unknown"), std::string::npos) << r.out;
  for (const char* op : {"moe", "formats", "kda", "all"}) {  // every op: a usage error before any work
    r = run_cli(std::string("validate --op ") + op + " --suite nosuch");
    EXPECT_EQ(r.code, 2) << op << r.out;
    EXPECT_NE(r.out.find("--suite 'nosuch' is an unknown suite (known: smoke, real, nonfinite, determinism, all)"),
              std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("PASS"), std::string::npos) << r.out;
  }
  r = run_cli("validate --op moe --suite smoke --backend nosuch");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("backend 'nosuch' is not known"), std::string::npos) << r.out;
  r = run_cli("validate --op moe --suite determinism --recipe w4a8 --activation situ --require gpu-magic");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("unknown capability 'gpu-magic'"), std::string::npos) << r.out;
  // The reference path supports every recipe and activation: these requirements hold.
  r = run_cli("validate --op moe --suite determinism --recipe w4a8 --activation situ --backend reference --require situ --require w4a8");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("require situ"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace k3
