// k3::load_moe_inputs (k3/moe_io.hpp): the routed inputs of `k3 moe run` read by the library —
// both routing sources, the dtype conversions, and the error of every malformed file.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/st_test_util.hpp"
#include "core/synth_test_util.hpp"
#include "k3/checkpoint.hpp"
#include "k3/checkpoint_synth.hpp"
#include "k3/formats.hpp"
#include "k3/moe_io.hpp"
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
