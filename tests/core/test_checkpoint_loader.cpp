// load_moe_layer on hand-built checkpoints: FC1 = [gate; up] and FC2 byte for byte, EP slices,
// the router, and every error (missing experts, wrong dtype / shape, dense layer, bad EP).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/st_test_util.hpp"
#include "k3/checkpoint.hpp"
#include "k3/formats.hpp"
#include "k3/safetensors.hpp"

namespace k3 {
namespace {

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg)

struct Small {
  int64_t hidden = 96, k = 64, n = 32;
  int experts = 8, top_k = 3, layers = 4;
};

// A byte that identifies (layer, expert, projection, packed/scale, row, col) independently of
// the loader: any misplaced row, column or projection shows up as a wrong value.
uint8_t pattern(int layer, int expert, int proj, bool scale, int64_t row, int64_t col) {
  return static_cast<uint8_t>(layer * 89 + expert * 37 + proj * 53 + (scale ? 101 : 0) + row * 7 + col * 3);
}

nlohmann::json small_config(const Small& s) {
  nlohmann::json text = {{"model_type", "kimi_linear"},
                         {"hidden_size", s.hidden},
                         {"num_hidden_layers", s.layers},
                         {"num_experts", s.experts},
                         {"num_experts_per_token", s.top_k},
                         {"moe_intermediate_size", s.n},
                         {"routed_expert_hidden_size", s.k},
                         {"first_k_dense_replace", 1},
                         {"moe_router_activation_func", "sigmoid"},
                         {"num_expert_group", 1},
                         {"topk_group", 1},
                         {"moe_renormalize", true},
                         {"routed_scaling_factor", 1.0},
                         {"hidden_act", "situ"},
                         {"activation_situ_beta", 4.0},
                         {"activation_situ_linear_beta", 25.0}};
  return {{"model_type", "kimi_k3"}, {"text_config", text}};
}

struct BuildOptions {
  int layer = 1;
  int expert_begin = 0, expert_end = -1;
  std::string prefix = "language_model.";
  bool router = true;
  st::DType bias_dtype = st::DType::kBF16;
  std::string skip;                                 // a tensor name to leave out
  std::string retype;                               // a tensor name stored as I8 instead of U8
  std::string reshape;                              // a tensor name stored with one row less
  int shards = 1;                                   // > 1: write an index
};

void build_checkpoint(const std::string& dir, const Small& s, const BuildOptions& b) {
  test::write_text(dir + "/config.json", small_config(s).dump(2));
  std::vector<st::Writer> writers(static_cast<size_t>(b.shards));
  nlohmann::json weight_map = nlohmann::json::object();
  int count = 0;
  auto add = [&](const std::string& name, st::DType dt, std::vector<int64_t> shape, std::vector<uint8_t> bytes) {
    if (name == b.skip) return;
    if (name == b.retype) dt = st::DType::kI8;
    if (name == b.reshape) {
      shape[0] -= 1;
      bytes.resize(bytes.size() - static_cast<size_t>(shape[1] * st::dtype_size(dt)));
    }
    const int shard = count++ % b.shards;
    ASSERT_TRUE(writers[static_cast<size_t>(shard)].add(name, dt, shape, bytes).is_ok());
    weight_map[name] = "shard-" + std::to_string(shard) + ".safetensors";
  };
  const int e_end = b.expert_end < 0 ? s.experts : b.expert_end;
  for (int e = b.expert_begin; e < e_end; ++e) {
    for (const int proj : {1, 2, 3}) {
      const int64_t rows = proj == 2 ? s.k : s.n, cols = proj == 2 ? s.n : s.k;
      for (const bool scale : {false, true}) {
        const int64_t w = scale ? cols / 32 : cols / 2;
        std::vector<uint8_t> bytes(static_cast<size_t>(rows * w));
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < w; ++c) bytes[static_cast<size_t>(r * w + c)] = pattern(b.layer, e, proj, scale, r, c);
        }
        add(kimi_expert_tensor_name(b.layer, e, proj, scale, b.prefix), st::DType::kU8, {rows, w}, bytes);
      }
    }
  }
  if (b.router) {
    std::vector<uint8_t> wbytes(static_cast<size_t>(s.experts * s.hidden * 2));
    for (size_t i = 0; i < wbytes.size() / 2; ++i) {
      const uint16_t v = bf16_from_f32(static_cast<float>(i) * 0.25f - 3.0f);
      wbytes[2 * i] = static_cast<uint8_t>(v);
      wbytes[2 * i + 1] = static_cast<uint8_t>(v >> 8);
    }
    add(kimi_router_weight_name(b.layer, b.prefix), st::DType::kBF16, {s.experts, s.hidden}, wbytes);
    const int sz = st::dtype_size(b.bias_dtype);
    std::vector<uint8_t> bias(static_cast<size_t>(s.experts * sz));
    for (int e = 0; e < s.experts; ++e) {
      const float v = 0.125f * static_cast<float>(e) - 0.5f;
      const uint32_t bits = sz == 4 ? f32_to_bits(v) : bf16_from_f32(v);
      for (int i = 0; i < sz; ++i) bias[static_cast<size_t>(e * sz + i)] = static_cast<uint8_t>(bits >> (8 * i));
    }
    add(kimi_router_bias_name(b.layer, b.prefix), b.bias_dtype, {s.experts}, bias);
  }
  if (b.shards == 1) {
    ASSERT_TRUE(writers[0].write(dir + "/model.safetensors").is_ok());
    return;
  }
  for (int i = 0; i < b.shards; ++i) {
    ASSERT_TRUE(writers[static_cast<size_t>(i)].write(dir + "/shard-" + std::to_string(i) + ".safetensors").is_ok());
  }
  test::write_text(dir + "/model.safetensors.index.json", nlohmann::json({{"weight_map", weight_map}}).dump());
}

// Checks every byte of the loaded FC1 / FC2 against the pattern.
void expect_layer_matches(const MoeLayerWeights& w, const Small& s, int layer) {
  const int e_local = w.shape.local_experts(), e0 = w.shape.first_local_expert();
  const int64_t k = s.k, n = s.n;
  ASSERT_EQ(w.fc1_q.size(), static_cast<size_t>(e_local * 2 * n * k / 2));
  ASSERT_EQ(w.fc1_scale.size(), static_cast<size_t>(e_local * 2 * n * k / 32));
  ASSERT_EQ(w.fc2_q.size(), static_cast<size_t>(e_local * k * n / 2));
  ASSERT_EQ(w.fc2_scale.size(), static_cast<size_t>(e_local * k * n / 32));
  int bad = 0;
  for (int e = 0; e < e_local; ++e) {
    for (int64_t r = 0; r < 2 * n; ++r) {  // rows [0, N) gate = w1, [N, 2N) up = w3
      const int proj = r < n ? 1 : 3;
      for (int64_t c = 0; c < k / 2; ++c) {
        bad += w.fc1_q[static_cast<size_t>((e * 2 * n + r) * (k / 2) + c)] != pattern(layer, e0 + e, proj, false, r % n, c);
      }
      for (int64_t c = 0; c < k / 32; ++c) {
        bad += w.fc1_scale[static_cast<size_t>((e * 2 * n + r) * (k / 32) + c)] != pattern(layer, e0 + e, proj, true, r % n, c);
      }
    }
    for (int64_t r = 0; r < k; ++r) {
      for (int64_t c = 0; c < n / 2; ++c) {
        bad += w.fc2_q[static_cast<size_t>((e * k + r) * (n / 2) + c)] != pattern(layer, e0 + e, 2, false, r, c);
      }
      for (int64_t c = 0; c < n / 32; ++c) {
        bad += w.fc2_scale[static_cast<size_t>((e * k + r) * (n / 32) + c)] != pattern(layer, e0 + e, 2, true, r, c);
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST(MoeLayerLoader, LoadsEveryEpRankByteForByte) {
  const Small s;
  test::TempDir dir("load_all");
  build_checkpoint(dir.str(), s, {});
  for (const int ep_size : {1, 2, 3, 4, 5, 6, 7, 8}) {  // 8 experts: uneven partitions at 3, 5, 6 and 7
    int next = 0;  // the ranks' experts tile [0, 8) in rank order, the first 8 mod W ranks one more
    for (int rank = 0; rank < ep_size; ++rank) {
      auto w = load_moe_layer(dir.str(), 1, ep_size, rank);
      ASSERT_TRUE(w) << w.status().to_string();
      EXPECT_EQ(w->shape.first_local_expert(), next) << "EP" << ep_size << " rank " << rank;
      EXPECT_EQ(w->shape.local_experts(), s.experts / ep_size + (rank < s.experts % ep_size ? 1 : 0));
      EXPECT_EQ(w->fc1_q.size(), static_cast<size_t>(w->shape.local_experts() * 2 * s.n * s.k / 2));
      next += w->shape.local_experts();
      ASSERT_TRUE(w) << w.status().to_string();
      EXPECT_EQ(w->shape.hidden, s.k);
      EXPECT_EQ(w->shape.intermediate, s.n);
      EXPECT_EQ(w->shape.num_experts, s.experts);
      EXPECT_EQ(w->shape.top_k, s.top_k);
      EXPECT_EQ(w->shape.ep_size, ep_size);
      EXPECT_EQ(w->shape.ep_rank, rank);
      EXPECT_EQ(w->layer, 1);
      expect_layer_matches(w.value(), s, 1);
      // The view is what the backends take: it passes the shared buffer checks.
      MoeProblem p;
      p.shape = w->shape;
      EXPECT_TRUE(validate_moe_buffers(p, w->view(), MoeInputsView{}).is_ok());
    }
    EXPECT_EQ(next, s.experts) << "EP" << ep_size;
  }
}

TEST(MoeLayerLoader, RouterWeightAndBias) {
  const Small s;
  for (const auto dt : {st::DType::kBF16, st::DType::kF32}) {
    test::TempDir dir("load_router");
    BuildOptions b;
    b.bias_dtype = dt;
    build_checkpoint(dir.str(), s, b);
    auto w = load_moe_layer(dir.str(), 1, 2, 0);
    ASSERT_TRUE(w) << w.status().to_string();
    ASSERT_EQ(w->router_weight.size(), static_cast<size_t>(s.experts * s.hidden));
    EXPECT_EQ(w->router_weight[5], bf16_from_f32(5 * 0.25f - 3.0f));
    EXPECT_EQ(w->router_weight.back(), bf16_from_f32(static_cast<float>(s.experts * s.hidden - 1) * 0.25f - 3.0f));
    ASSERT_EQ(w->router_bias.size(), static_cast<size_t>(s.experts));
    for (int e = 0; e < s.experts; ++e) EXPECT_EQ(w->router_bias[static_cast<size_t>(e)], 0.125f * static_cast<float>(e) - 0.5f);
  }
  test::TempDir dir("load_norouter");
  BuildOptions b;
  b.router = false;
  build_checkpoint(dir.str(), s, b);
  auto w = load_moe_layer(dir.str(), 1, 1, 0);
  ASSERT_TRUE(w) << w.status().to_string();
  EXPECT_TRUE(w->router_weight.empty());
  EXPECT_TRUE(w->router_bias.empty());
}

TEST(MoeLayerLoader, OddShapesShardedAndTextOnlyPrefix) {
  Small s;
  s.k = 96;
  s.n = 160;
  s.experts = 5;
  s.top_k = 3;
  s.hidden = 40;
  test::TempDir dir("load_odd");
  BuildOptions b;
  b.layer = 2;
  b.prefix = "";  // text-only Kimi checkpoints have no "language_model." prefix
  b.shards = 3;
  build_checkpoint(dir.str(), s, b);
  for (int rank = 0; rank < 5; ++rank) {
    auto w = load_moe_layer(dir.str(), 2, 5, rank);
    ASSERT_TRUE(w) << w.status().to_string();
    expect_layer_matches(w.value(), s, 2);
  }
  EXPECT_EQ(load_moe_layer(dir.str(), 2, 1, 0).value().router_weight.size(), static_cast<size_t>(5 * 40));
}

TEST(MoeLayerLoader, NamesEveryMissingExpertAndWhatIsHeld) {
  const Small s;
  test::TempDir dir("load_missing");
  BuildOptions b;
  b.expert_begin = 0;
  b.expert_end = 4;  // only EP rank 0 of 2
  build_checkpoint(dir.str(), s, b);
  ASSERT_TRUE(load_moe_layer(dir.str(), 1, 2, 0));
  auto r = load_moe_layer(dir.str(), 1, 2, 1);
  ASSERT_FALSE(r);
  const auto& m = r.status().message();
  EXPECT_HAS(m, "lacks 4 of the 4 experts that layer 1 needs on EP rank 1 of 2 (global experts [4, 8)): experts 4-7");
  EXPECT_HAS(m, "first missing tensor 'language_model.model.layers.1.block_sparse_moe.experts.4.w1.weight_packed'");
  EXPECT_HAS(m, "the checkpoint holds experts 0-3");
  EXPECT_EQ(m.find("k3 checkpoint synth"), std::string::npos) << "no synth hint for a real checkpoint: " << m;
  // A layer that is absent altogether.
  auto r2 = load_moe_layer(dir.str(), 2, 1, 0);
  ASSERT_FALSE(r2);
  EXPECT_HAS(r2.status().message(), "experts 0-7");
  EXPECT_HAS(r2.status().message(), "holds no experts of this layer");
}

TEST(MoeLayerLoader, PartialExpertIsNamedWithItsMissingTensor) {
  const Small s;
  test::TempDir dir("load_partial");
  BuildOptions b;
  b.skip = kimi_expert_tensor_name(1, 5, 2, true);
  build_checkpoint(dir.str(), s, b);
  auto r = load_moe_layer(dir.str(), 1, 2, 1);
  ASSERT_FALSE(r);
  EXPECT_HAS(r.status().message(), "lacks 1 of the 4 experts");
  EXPECT_HAS(r.status().message(), "experts 5;");
  EXPECT_HAS(r.status().message(), "experts.5.w2.weight_scale");
  EXPECT_TRUE(load_moe_layer(dir.str(), 1, 2, 0));  // rank 0 does not need expert 5
}

TEST(MoeLayerLoader, WrongDtypeOrShapeIsNamed) {
  const Small s;
  {
    test::TempDir dir("load_dtype");
    BuildOptions b;
    b.retype = kimi_expert_tensor_name(1, 2, 3, false);
    build_checkpoint(dir.str(), s, b);
    auto r = load_moe_layer(dir.str(), 1, 1, 0);
    ASSERT_FALSE(r);
    EXPECT_HAS(r.status().message(), "tensor '" + kimi_expert_tensor_name(1, 2, 3, false) + "' in ");
    EXPECT_HAS(r.status().message(), "is I8 [32, 32], expected U8 [32, 32] (w3 = up [N, K] MXFP4 codes");
  }
  {
    test::TempDir dir("load_shape");
    BuildOptions b;
    b.reshape = kimi_expert_tensor_name(1, 6, 2, true);
    build_checkpoint(dir.str(), s, b);
    auto r = load_moe_layer(dir.str(), 1, 1, 0);
    ASSERT_FALSE(r);
    EXPECT_HAS(r.status().message(), "experts.6.w2.weight_scale' in ");
    EXPECT_HAS(r.status().message(), "is U8 [63, 1], expected U8 [64, 1] (w2 = down [K, N] E8M0 scales");
  }
  {
    test::TempDir dir("load_router_shape");
    BuildOptions b;
    b.reshape = kimi_router_weight_name(1);
    build_checkpoint(dir.str(), s, b);
    auto r = load_moe_layer(dir.str(), 1, 1, 0);
    ASSERT_FALSE(r);
    EXPECT_HAS(r.status().message(), "gate.weight' in ");
    EXPECT_HAS(r.status().message(), "is BF16 [7, 96], expected BF16 [8, 96] (router gate.weight");
  }
  {
    // Many bad tensors: the first few are listed with a count of the rest.
    test::TempDir dir("load_many");
    Small wrong = s;
    wrong.k = 32;  // every tensor is half as wide as the config says
    BuildOptions b;
    build_checkpoint(dir.str(), wrong, b);
    test::write_text(dir.file("config.json"), small_config(s).dump());
    auto r = load_moe_layer(dir.str(), 1, 1, 0);
    ASSERT_FALSE(r);
    EXPECT_HAS(r.status().message(), "more tensors with the wrong dtype/shape)");
  }
}

TEST(MoeLayerLoader, LayerEpAndFormatErrors) {
  const Small s;
  test::TempDir dir("load_errors");
  build_checkpoint(dir.str(), s, {});
  EXPECT_HAS(load_moe_layer(dir.str(), 0, 1, 0).status().message(), "layer 0 is a dense MLP layer (first_k_dense_replace = 1");
  EXPECT_HAS(load_moe_layer(dir.str(), 4, 1, 0).status().message(), "layer = 4 must be in [0, num_hidden_layers = 4)");
  EXPECT_HAS(load_moe_layer(dir.str(), 1, 9, 0).status().message(), "ep_size = 9 must be in [1, num_experts = 8]");
  EXPECT_HAS(load_moe_layer(dir.str(), 1, 2, 2).status().message(), "ep_rank = 2 must be in [0, ep_size = 2)");
  auto cfg = small_config(s);
  cfg["text_config"]["quantization_config"] = {{"quant_method", "compressed-tensors"}, {"format", "float-quantized"}};
  test::write_text(dir.file("config.json"), cfg.dump());
  auto r = load_moe_layer(dir.str(), 1, 1, 0);
  EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
  EXPECT_HAS(r.status().message(), "quantization format 'float-quantized' is not supported");
  EXPECT_HAS(load_moe_layer(dir.file("nothing"), 1, 1, 0).status().message(), "config.json: cannot read");
}

}  // namespace
}  // namespace k3

namespace k3 {
namespace {

// The parser of the Kimi MoE tensor names is the inverse of the three name functions, for any
// prefix, and refuses every other or malformed name.
TEST(KimiTensorNames, ParseInvertsTheNameFunctionsAndRefusesOthers) {
  for (const std::string prefix : {"language_model.", "", "a.b."}) {
    for (int layer : {0, 7, 60}) {
      for (int expert : {0, 13, 895}) {
        for (int proj : {1, 2, 3}) {
          for (bool scale : {false, true}) {
            const auto t = parse_kimi_moe_tensor_name(kimi_expert_tensor_name(layer, expert, proj, scale, prefix));
            ASSERT_TRUE(t.has_value());
            EXPECT_EQ(t->kind, KimiMoeTensor::Kind::kExpert);
            EXPECT_EQ(t->prefix, prefix);
            EXPECT_EQ(t->layer, layer);
            EXPECT_EQ(t->expert, expert);
            EXPECT_EQ(t->proj, proj);
            EXPECT_EQ(t->scale, scale);
          }
        }
      }
      const auto w = parse_kimi_moe_tensor_name(kimi_router_weight_name(layer, prefix));
      ASSERT_TRUE(w.has_value());
      EXPECT_EQ(w->kind, KimiMoeTensor::Kind::kRouterWeight);
      EXPECT_EQ(w->layer, layer);
      EXPECT_EQ(w->prefix, prefix);
      const auto b = parse_kimi_moe_tensor_name(kimi_router_bias_name(layer, prefix));
      ASSERT_TRUE(b.has_value());
      EXPECT_EQ(b->kind, KimiMoeTensor::Kind::kRouterBias);
    }
  }
  for (const char* bad : {"", "model.layers.", "model.layers.1", "model.layers.1.block_sparse_moe.",
                          "model.layers.x.block_sparse_moe.gate.weight", "model.layers.1.mlp.gate.weight",
                          "model.layers.1.block_sparse_moe.experts.3.w4.weight_packed",
                          "model.layers.1.block_sparse_moe.experts.3.w0.weight_scale",
                          "model.layers.1.block_sparse_moe.experts..w1.weight_packed",
                          "model.layers.1.block_sparse_moe.experts.3.w1.weight",
                          "model.layers.1.block_sparse_moe.experts.3.w1.weight_packed.extra",
                          "model.layers.1.block_sparse_moe.experts.3.w12.weight_packed",
                          "model.layers.1.block_sparse_moe.gate.weight.x",
                          "model.layers.99999999999.block_sparse_moe.gate.weight",
                          "model.layers.1.block_sparse_moe.experts.16777216.w1.weight_packed",
                          "model.layers.-1.block_sparse_moe.gate.weight", "model.embed_tokens.weight"}) {
    EXPECT_FALSE(parse_kimi_moe_tensor_name(bad).has_value()) << bad;
  }
}

}  // namespace
}  // namespace k3
