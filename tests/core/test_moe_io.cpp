// k3::load_moe_inputs (k3/harness/moe_io.hpp): the routed inputs of `k3 moe run` read by the library —
// both routing sources, the dtype conversions, and the error of every malformed file.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/st_test_util.hpp"
#include "core/synth_test_util.hpp"
#include "k3/checkpoint.hpp"
#include "k3/harness/checkpoint_synth.hpp"
#include "k3/formats.hpp"
#include "k3/harness/moe_io.hpp"
#include "k3/routing.hpp"
#include "k3/safetensors.hpp"

namespace k3 {
namespace {

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg)

template <typename T>
std::span<const uint8_t> bytes_of(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

class MoeIo : public ::testing::Test {
 protected:
  void SetUp() override {
    // A directory of this process's own: ctest runs each test as its own process, in parallel.
    dir_ = tmp_.file("ckpt");
    const SynthOptions o = test::small_synth_options(dir_);  // K 64, N 32, E 8, top-3, layer 1
    ASSERT_TRUE(write_synthetic_checkpoint(o).is_ok());
    auto l = load_moe_layer(dir_, 1, 1, 0);
    ASSERT_TRUE(l) << l.status().to_string();
    layer_ = std::move(l).value();
  }

  std::string write(const std::string& name, const std::function<void(st::Writer&)>& fill) {
    st::Writer w;
    fill(w);
    const std::string path = tmp_.file(name);
    std::remove(path.c_str());
    const Status st = w.write(path);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return path;
  }

  test::TempDir tmp_{"moe_io"};
  std::string dir_;
  MoeLayerWeights layer_;
};

TEST_F(MoeIo, LogitsAreRoutedByTheLayersRouter) {
  const int64_t m = 5, k = 64, e = 8;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> x(m * k), logits(m * e);
  for (auto& v : x) v = nd(rng);
  for (auto& v : logits) v = nd(rng);
  const std::string path = write("k3_moe_io_logits.safetensors", [&](st::Writer& w) {
    ASSERT_TRUE(w.add("x", st::DType::kF32, {m, k}, bytes_of(x)).is_ok());
    ASSERT_TRUE(w.add("logits", st::DType::kF32, {m, e}, bytes_of(logits)).is_ok());
  });
  auto in = load_moe_inputs(path, layer_);
  ASSERT_TRUE(in) << in.status().to_string();
  EXPECT_TRUE(in->routed_here);
  EXPECT_EQ(in->m, m);
  EXPECT_EQ(in->top_k, 3);
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(in->x[i], bf16_from_f32(x[i])) << i;
  // The same ids and weights as the library's router with the checkpoint's config and bias.
  const RoutingConfig rc = routing_from_config(layer_.config).value();
  std::vector<int32_t> ids(m * 3);
  std::vector<float> wts(m * 3);
  ASSERT_TRUE(route(rc, m, logits, layer_.router_bias, ids, wts).is_ok());
  EXPECT_EQ(in->topk_ids, ids);
  EXPECT_EQ(in->topk_weights, wts);
  const MoeInputsView v = in->view();
  EXPECT_EQ(v.m, m);
  EXPECT_EQ(v.topk_ids.size(), ids.size());
  std::remove(path.c_str());
}

TEST_F(MoeIo, GivenIdsAreUsedAsIs) {
  const int64_t m = 2, k = 64;
  std::vector<uint16_t> x(m * k, bf16_from_f32(0.5f));
  std::vector<int64_t> ids = {0, 7, -1, 3};
  std::vector<float> wts = {0.25f, 0.75f, 0.f, 1.f};
  const std::string path = write("k3_moe_io_ids.safetensors", [&](st::Writer& w) {
    ASSERT_TRUE(w.add("x", st::DType::kBF16, {m, k}, bytes_of(x)).is_ok());
    ASSERT_TRUE(w.add("topk_ids", st::DType::kI64, {m, 2}, bytes_of(ids)).is_ok());
    ASSERT_TRUE(w.add("topk_weights", st::DType::kF32, {m, 2}, bytes_of(wts)).is_ok());
  });
  auto in = load_moe_inputs(path, layer_);
  ASSERT_TRUE(in) << in.status().to_string();
  EXPECT_FALSE(in->routed_here);
  EXPECT_EQ(in->top_k, 2);
  EXPECT_EQ(in->x, x);
  EXPECT_EQ(in->topk_ids, (std::vector<int32_t>{0, 7, -1, 3}));
  EXPECT_EQ(in->topk_weights, wts);
  std::remove(path.c_str());
}

// The output file of `k3 moe run`, written by the library for both the single-rank and the
// distributed run: the bytes, shapes and dtypes of out / topk_ids / topk_weights, the metadata,
// and the size errors.
TEST_F(MoeIo, OutputFileHoldsTheResultTheSlotsAndTheRunRecord) {
  MoeInputFile in;
  in.m = 2;
  in.top_k = 5;  // not the config's top-3: the inputs' own slots
  in.x.assign(2 * 64, 0);
  in.topk_ids = {0, 1, 2, 3, -1, 4, 5, 6, 7, 0};
  in.topk_weights = {0.5f, 0.25f, 0.125f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f};
  auto p = moe_problem_from_layer(layer_, Recipe::kW4A16, OutDType::kFP16, in.top_k);
  ASSERT_TRUE(p) << p.status().to_string();
  EXPECT_EQ(p->shape.top_k, 5);
  EXPECT_EQ(p->shape.hidden, 64);
  std::vector<uint8_t> out(2 * 64 * 2);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>(i * 7);
  const std::string path = tmp_.file("out.safetensors");
  ASSERT_TRUE(write_moe_output(path, "--output", p.value(), in, out, {"cpu", dir_, 1, 2, 1}).is_ok());
  auto f = st::File::open(path);
  ASSERT_TRUE(f) << f.status().to_string();
  const st::TensorInfo* o = f->find("out");
  ASSERT_NE(o, nullptr);
  EXPECT_EQ(o->dtype, st::DType::kF16);
  EXPECT_EQ(o->shape, (std::vector<int64_t>{2, 64}));
  const auto ob = f->bytes(*o);
  EXPECT_TRUE(std::equal(ob.begin(), ob.end(), out.begin(), out.end()));
  const st::TensorInfo* ids = f->find("topk_ids");
  ASSERT_NE(ids, nullptr);
  EXPECT_EQ(ids->dtype, st::DType::kI32);
  EXPECT_EQ(ids->shape, (std::vector<int64_t>{2, 5}));
  const auto ib = f->bytes(*ids);
  ASSERT_EQ(ib.size(), 40u);
  EXPECT_EQ(std::memcmp(ib.data(), in.topk_ids.data(), 40), 0);
  const st::TensorInfo* wts = f->find("topk_weights");
  ASSERT_NE(wts, nullptr);
  EXPECT_EQ(wts->dtype, st::DType::kF32);
  EXPECT_EQ(std::memcmp(f->bytes(*wts).data(), in.topk_weights.data(), 40), 0);
  const auto& md = f->metadata();
  EXPECT_EQ(md.at("backend"), "cpu");
  EXPECT_EQ(md.at("checkpoint"), dir_);
  EXPECT_EQ(md.at("layer"), "1");
  EXPECT_EQ(md.at("ep_size"), "2");
  EXPECT_EQ(md.at("ep_rank"), "1");
  EXPECT_EQ(md.at("recipe"), "w4a16");
  EXPECT_EQ(md.at("routing"), "topk_ids/topk_weights from the input");
  EXPECT_FALSE(md.at("k3_version").empty());
  // The distributed run states no rank: the file holds every rank's slots.
  ASSERT_TRUE(write_moe_output(path, "--output", p.value(), in, out, {"cpu (distributed, mpi)", dir_, 1, 2, -1}).is_ok());
  EXPECT_EQ(st::File::open(path)->metadata().count("ep_rank"), 0u);
  // Sizes that do not match are named; nothing is written over the previous file.
  const Status bad = write_moe_output(path, "--output", p.value(), in, std::span<const uint8_t>(out).first(10),
                                      {"cpu", dir_, 1, 1, 0});
  EXPECT_HAS(bad.message(), "out has 10 bytes, expected M = 2 x K = 64 x 2 bytes (fp16)");
  MoeInputFile short_ids = in;
  short_ids.topk_ids.pop_back();
  EXPECT_HAS(write_moe_output(path, "--output", p.value(), short_ids, out, {"cpu", dir_, 1, 1, 0}).message(),
             "expected M x top_k = 10");
  EXPECT_EQ(st::File::open(path)->metadata().at("backend"), "cpu (distributed, mpi)");
  // A top_k beyond k3's limit is refused by name.
  auto big = moe_problem_from_layer(layer_, Recipe::kW4A16, OutDType::kBF16, 33);
  ASSERT_FALSE(big);
  EXPECT_HAS(big.status().message(), "top_k = 33 (slots per token of the inputs)");
}

// `k3 moe run` reads config.json once and hands it to the loader: the same layer, byte for byte,
// as the loader that reads the config itself, and the same errors.
TEST_F(MoeIo, LoadingWithTheConfigReadOnceGivesTheSameLayer) {
  auto cfg = load_model_config(dir_);
  ASSERT_TRUE(cfg) << cfg.status().to_string();
  auto l = load_moe_layer(cfg.value(), dir_, 1, 1, 0);
  ASSERT_TRUE(l) << l.status().to_string();
  EXPECT_EQ(l->fc1_q, layer_.fc1_q);
  EXPECT_EQ(l->fc1_scale, layer_.fc1_scale);
  EXPECT_EQ(l->fc2_q, layer_.fc2_q);
  EXPECT_EQ(l->fc2_scale, layer_.fc2_scale);
  EXPECT_EQ(l->router_bias, layer_.router_bias);
  EXPECT_EQ(l->shape.num_experts, layer_.shape.num_experts);
  EXPECT_EQ(l->config.source, layer_.config.source);
  const Status a = load_moe_layer(cfg.value(), dir_, 99, 1, 0).status();
  const Status b = load_moe_layer(dir_, 99, 1, 0).status();
  EXPECT_FALSE(a.is_ok());
  EXPECT_EQ(a.message(), b.message());
}

TEST_F(MoeIo, MalformedFilesAreNamedWithTheTensor) {
  const int64_t m = 2, k = 64;
  std::vector<float> x(m * k, 1.f), wts(m * 2, 0.5f);
  std::vector<int32_t> ids = {0, 1, 2, 3};
  struct Bad {
    const char* what;
    std::function<void(st::Writer&)> fill;
  };
  const std::vector<Bad> cases = {
      {"no tensor 'x'", [&](st::Writer& w) { ASSERT_TRUE(w.add("y", st::DType::kF32, {m, k}, bytes_of(x)).is_ok()); }},
      {"must be [M, K] with K = 64",
       [&](st::Writer& w) { ASSERT_TRUE(w.add("x", st::DType::kF32, {k, m}, bytes_of(x)).is_ok()); }},
      {"needs router 'logits' [M, E] or both 'topk_ids' and 'topk_weights'",
       [&](st::Writer& w) { ASSERT_TRUE(w.add("x", st::DType::kF32, {m, k}, bytes_of(x)).is_ok()); }},
      {"(topk_weights missing)",
       [&](st::Writer& w) {
         ASSERT_TRUE(w.add("x", st::DType::kF32, {m, k}, bytes_of(x)).is_ok());
         ASSERT_TRUE(w.add("topk_ids", st::DType::kI32, {m, 2}, bytes_of(ids)).is_ok());
       }},
      {"element [1, 1] = 9 must be -1 (masked) or a global expert id in [0, 8)",
       [&](st::Writer& w) {
         std::vector<int32_t> far = {0, 1, 2, 9};
         ASSERT_TRUE(w.add("x", st::DType::kF32, {m, k}, bytes_of(x)).is_ok());
         ASSERT_TRUE(w.add("topk_ids", st::DType::kI32, {m, 2}, bytes_of(far)).is_ok());
         ASSERT_TRUE(w.add("topk_weights", st::DType::kF32, {m, 2}, bytes_of(wts)).is_ok());
       }},
      {"must have M = 2 rows (the rows of x)",
       [&](st::Writer& w) {
         ASSERT_TRUE(w.add("x", st::DType::kF32, {m, k}, bytes_of(x)).is_ok());
         ASSERT_TRUE(w.add("topk_ids", st::DType::kI32, {1, 4}, bytes_of(ids)).is_ok());
         ASSERT_TRUE(w.add("topk_weights", st::DType::kF32, {m, 2}, bytes_of(wts)).is_ok());
       }},
      {"holds both 'logits' and 'topk_ids'/'topk_weights'",
       [&](st::Writer& w) {
         std::vector<float> lg(m * 8);
         ASSERT_TRUE(w.add("x", st::DType::kF32, {m, k}, bytes_of(x)).is_ok());
         ASSERT_TRUE(w.add("logits", st::DType::kF32, {m, 8}, bytes_of(lg)).is_ok());
         ASSERT_TRUE(w.add("topk_ids", st::DType::kI32, {m, 2}, bytes_of(ids)).is_ok());
       }},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string path = write("k3_moe_io_bad" + std::to_string(i) + ".safetensors", cases[i].fill);
    auto in = load_moe_inputs(path, layer_);
    ASSERT_FALSE(in) << cases[i].what;
    EXPECT_HAS(in.status().message(), cases[i].what);
    EXPECT_HAS(in.status().message(), path);
    std::remove(path.c_str());
  }
  EXPECT_FALSE(load_moe_inputs(tmp_.file("missing.safetensors"), layer_));
}

// Logits need a router the config allows; given ids do not.
TEST_F(MoeIo, LogitsOfAnUnroutableConfigSayWhy) {
  MoeLayerWeights odd = layer_;
  odd.config.scoring_func = "softmax";
  const int64_t m = 1, k = 64;
  std::vector<float> x(m * k, 1.f), lg(m * 8);
  const std::string path = write("k3_moe_io_softmax.safetensors", [&](st::Writer& w) {
    ASSERT_TRUE(w.add("x", st::DType::kF32, {m, k}, bytes_of(x)).is_ok());
    ASSERT_TRUE(w.add("logits", st::DType::kF32, {m, 8}, bytes_of(lg)).is_ok());
  });
  auto in = load_moe_inputs(path, odd);
  ASSERT_FALSE(in);
  EXPECT_HAS(in.status().message(), "holds router 'logits', which k3 would have to route: ");
  EXPECT_HAS(in.status().message(), "scoring_func = 'softmax'");
  std::remove(path.c_str());
}

}  // namespace
}  // namespace k3
