// config.json parsing: the Kimi-K3 spelling (text_config), the DeepSeek-V3 spelling, and an error
// naming every missing or mistyped key.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "core/st_test_util.hpp"
#include "k3/checkpoint.hpp"
#include "k3/harness/digest.hpp"

namespace k3 {
namespace {

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg)

// The Kimi-K3 config facts of docs/moe.md, written out by hand.
nlohmann::json kimi_config() {
  return nlohmann::json::parse(R"({
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "text_config": {
      "model_type": "kimi_linear", "hidden_size": 7168, "num_hidden_layers": 93, "num_experts": 896,
      "num_experts_per_token": 16, "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584,
      "num_shared_experts": 2, "first_k_dense_replace": 1, "moe_router_activation_func": "sigmoid",
      "num_expert_group": 1, "topk_group": 1, "moe_renormalize": true, "routed_scaling_factor": 1.0,
      "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "rms_norm_eps": 1e-5,
      "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 32}}},
        "ignore": ["lm_head"]}
    }
  })");
}

// DeepSeek-V3's public config facts (top level, DeepSeek spelling).
nlohmann::json deepseek_config() {
  return nlohmann::json::parse(R"({
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "n_group": 8,
    "topk_group": 4, "norm_topk_prob": true, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "hidden_act": "silu"
  })");
}

TEST(ModelConfig, KimiSpellingUnderTextConfig) {
  auto r = parse_model_config(kimi_config().dump(), "kimi/config.json");
  ASSERT_TRUE(r) << r.status().to_string();
  const auto& c = r.value();
  EXPECT_EQ(c.model_type, "kimi_k3");
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.expert_hidden, 3584);
  EXPECT_EQ(c.intermediate, 3072);
  EXPECT_EQ(c.num_experts, 896);
  EXPECT_EQ(c.top_k, 16);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_TRUE(c.renormalize);
  EXPECT_EQ(c.routed_scaling_factor, 1.0f);
  EXPECT_EQ(c.scoring_func, "sigmoid");
  EXPECT_EQ(c.hidden_act, "situ");
  EXPECT_EQ(c.situ_beta, 4.0f);
  EXPECT_EQ(c.situ_linear_beta, 25.0f);
  EXPECT_EQ(c.num_hidden_layers, 93);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.quant_method, "compressed-tensors");
  EXPECT_EQ(c.quant_format, "mxfp4-pack-quantized");
  EXPECT_EQ(c.quant_group_size, 32);
  EXPECT_EQ(c.source, "kimi/config.json");

  auto shape = moe_shape_from_config(c, 32, 7);
  ASSERT_TRUE(shape) << shape.status().to_string();
  EXPECT_EQ(shape->local_experts(), 28);
  EXPECT_EQ(shape->first_local_expert(), 196);
  auto nine = moe_shape_from_config(c, 9, 8);  // 896 = 9 * 99 + 5: rank 8 holds experts [797, 896)
  ASSERT_TRUE(nine) << nine.status().to_string();
  EXPECT_EQ(nine->local_experts(), 99);
  EXPECT_EQ(nine->first_local_expert(), 797);
  auto bad = moe_shape_from_config(c, 897, 0);
  ASSERT_FALSE(bad);
  EXPECT_HAS(bad.status().message(), "kimi/config.json: ep_size = 897 must be in [1, num_experts = 896]");
}

// The digest of the bytes parsed: what the ranks of a distributed run compare (one read per rank).
TEST(ModelConfig, CarriesTheSha256OfTheBytesItParsed) {
  const std::string text = kimi_config().dump();
  auto a = parse_model_config(text, "kimi/config.json");
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  EXPECT_EQ(a->sha256, sha256_hex({reinterpret_cast<const uint8_t*>(text.data()), text.size()}));
  EXPECT_EQ(a->sha256.size(), 64u);
  auto b = parse_model_config(kimi_config().dump(1), "kimi/config.json");  // same facts, other bytes
  ASSERT_TRUE(b.is_ok());
  EXPECT_EQ(b->num_experts, a->num_experts);
  EXPECT_NE(b->sha256, a->sha256);
}

TEST(ModelConfig, DeepSeekSpellingAtTopLevel) {
  auto r = parse_model_config(deepseek_config().dump(), "ds/config.json");
  ASSERT_TRUE(r) << r.status().to_string();
  const auto& c = r.value();
  EXPECT_EQ(c.model_type, "deepseek_v3");
  EXPECT_EQ(c.expert_hidden, 7168);  // no latent MoE: experts run on hidden_size
  EXPECT_EQ(c.intermediate, 2048);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.top_k, 8);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.routed_scaling_factor, 2.5f);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_EQ(c.first_k_dense_replace, 3);
  EXPECT_TRUE(c.quant_format.empty());
}

TEST(ModelConfig, EveryMissingKeyIsNamedWithTheFile) {
  const char* kimi_keys[] = {"hidden_size",         "moe_intermediate_size",   "routed_expert_hidden_size",
                             "num_experts",         "num_experts_per_token",   "num_expert_group",
                             "topk_group",          "moe_renormalize",         "routed_scaling_factor",
                             "moe_router_activation_func", "hidden_act",       "activation_situ_beta",
                             "activation_situ_linear_beta", "num_hidden_layers", "first_k_dense_replace"};
  for (const char* key : kimi_keys) {
    auto j = kimi_config();
    ASSERT_EQ(j["text_config"].erase(key), 1u) << key;
    auto r = parse_model_config(j.dump(), "/ckpt/config.json");
    ASSERT_FALSE(r) << key;
    EXPECT_HAS(r.status().message(), "/ckpt/config.json: text_config lacks \"" + std::string(key) + "\"");
  }
  const char* ds_keys[][2] = {{"n_routed_experts", "num_experts"}, {"num_experts_per_tok", "num_experts_per_token"},
                              {"n_group", "num_expert_group"},     {"norm_topk_prob", "moe_renormalize"},
                              {"scoring_func", "moe_router_activation_func"}};
  for (const auto& [key, kimi_name] : ds_keys) {
    auto j = deepseek_config();
    ASSERT_EQ(j.erase(key), 1u) << key;
    auto r = parse_model_config(j.dump(), "/ds/config.json");
    ASSERT_FALSE(r) << key;
    // Both spellings are named so a user knows what either family calls it.
    EXPECT_HAS(r.status().message(), "/ds/config.json lacks \"" + std::string(kimi_name) + "\" (or \"" + key + "\")");
  }
  auto j = kimi_config();
  j.erase("model_type");
  EXPECT_HAS(parse_model_config(j.dump(), "c.json").status().message(), "c.json lacks \"model_type\"");
}

TEST(ModelConfig, MistypedAndInconsistentValues) {
  auto j = kimi_config();
  j["text_config"]["num_experts"] = "896";
  EXPECT_HAS(parse_model_config(j.dump(), "c.json").status().message(),
             "c.json: text_config: \"num_experts\" = \"896\" must be an integer");
  j = kimi_config();
  j["text_config"]["moe_intermediate_size"] = -5;
  EXPECT_HAS(parse_model_config(j.dump(), "c.json").status().message(), "\"moe_intermediate_size\" = -5 must be");
  j = kimi_config();
  j["text_config"]["moe_renormalize"] = 1;
  EXPECT_HAS(parse_model_config(j.dump(), "c.json").status().message(), "\"moe_renormalize\" = 1 must be true or false");
  j = kimi_config();
  j["text_config"]["num_experts_per_token"] = 900;
  EXPECT_HAS(parse_model_config(j.dump(), "c.json").status().message(), "top-k = 900 exceeds the 896 experts");
  j = kimi_config();
  j["text_config"]["num_expert_group"] = 5;
  EXPECT_HAS(parse_model_config(j.dump(), "c.json").status().message(), "n_group = 5, topk_group = 1 must satisfy");
  j = kimi_config();
  j["text_config"]["moe_router_activation_func"] = "tanh";
  EXPECT_HAS(parse_model_config(j.dump(), "c.json").status().message(), "scoring function 'tanh' is not supported");
  j = kimi_config();
  j["text_config"] = 3;
  EXPECT_HAS(parse_model_config(j.dump(), "c.json").status().message(), "\"text_config\" must be an object");
  EXPECT_HAS(parse_model_config("{", "c.json").status().message(), "c.json: not valid JSON");
  // A hostile nesting depth is refused before parsing (quoting such a value would recurse per level).
  const std::string deep = R"({"model_type":"kimi_k3","text_config":{"hidden_size":)" + std::string(100000, '[') +
                           std::string(100000, ']') + "}}";
  EXPECT_HAS(parse_model_config(deep, "c.json").status().message(), "c.json: JSON nests 100002 levels deep (limit 64)");
  EXPECT_HAS(parse_model_config("[]", "c.json").status().message(), "must be a JSON object");
}

// config.json -> activation / router configuration / problem: one definition in the library,
// used by `k3 moe run`, `k3 validate --checkpoint` and the Python MoeLayer.
TEST(ModelConfig, ActivationRoutingAndProblemFromTheConfig) {
  auto kimi = parse_model_config(kimi_config().dump(), "kimi/config.json");
  ASSERT_TRUE(kimi) << kimi.status().to_string();
  auto act = activation_from_config(kimi.value());
  ASSERT_TRUE(act) << act.status().to_string();
  EXPECT_EQ(act->kind, ActivationKind::kSiTU);
  EXPECT_EQ(act->situ_beta, 4.0f);
  EXPECT_EQ(act->situ_linear_beta, 25.0f);
  auto rc = routing_from_config(kimi.value());
  ASSERT_TRUE(rc) << rc.status().to_string();
  EXPECT_EQ(rc->num_experts, 896);
  EXPECT_EQ(rc->top_k, 16);
  EXPECT_TRUE(rc->renormalize);

  auto ds = parse_model_config(deepseek_config().dump(), "ds/config.json");
  ASSERT_TRUE(ds) << ds.status().to_string();
  auto ds_rc = routing_from_config(ds.value());
  ASSERT_TRUE(ds_rc) << ds_rc.status().to_string();
  EXPECT_EQ(ds_rc->n_group, 8);
  EXPECT_EQ(ds_rc->topk_group, 4);
  EXPECT_EQ(ds_rc->routed_scaling_factor, 2.5f);
  EXPECT_EQ(activation_from_config(ds.value())->kind, ActivationKind::kSiLU);

  MoeLayerWeights layer;
  layer.config = kimi.value();
  auto shape = moe_shape_from_config(layer.config, 32, 7);
  ASSERT_TRUE(shape) << shape.status().to_string();
  layer.shape = shape.value();
  auto p = moe_problem_from_layer(layer, Recipe::kW4A16, OutDType::kFP32);
  ASSERT_TRUE(p) << p.status().to_string();
  EXPECT_EQ(p->shape.local_experts(), 28);
  EXPECT_EQ(p->recipe, Recipe::kW4A16);
  EXPECT_EQ(p->out_dtype, OutDType::kFP32);
  EXPECT_EQ(p->activation.kind, ActivationKind::kSiTU);
}

TEST(ModelConfig, WhatTheLibraryCannotRouteOrRunIsNamed) {
  auto j = kimi_config();
  j["text_config"]["moe_router_activation_func"] = "softmax";
  j["text_config"]["hidden_act"] = "gelu";
  auto c = parse_model_config(j.dump(), "odd/config.json");
  ASSERT_TRUE(c) << c.status().to_string();
  auto rc = routing_from_config(c.value());
  ASSERT_FALSE(rc);
  EXPECT_EQ(rc.status().code(), StatusCode::kUnsupported);
  EXPECT_HAS(rc.status().message(), "odd/config.json: scoring_func = 'softmax' cannot be routed by k3");
  auto act = activation_from_config(c.value());
  ASSERT_FALSE(act);
  EXPECT_EQ(act.status().code(), StatusCode::kUnsupported);
  EXPECT_HAS(act.status().message(), "odd/config.json: hidden_act 'gelu' is not a fused-MoE activation");
  MoeLayerWeights layer;
  layer.config = c.value();
  layer.shape = moe_shape_from_config(layer.config, 1, 0).value();
  EXPECT_FALSE(moe_problem_from_layer(layer, Recipe::kW4A8, OutDType::kBF16));
  // A grouping the router refuses names the file.
  auto g = kimi_config();
  g["text_config"]["num_expert_group"] = 64;  // 1 group of 14 experts cannot hold top-16
  auto gc = parse_model_config(g.dump(), "grp/config.json");
  ASSERT_TRUE(gc) << gc.status().to_string();
  auto grc = routing_from_config(gc.value());
  ASSERT_FALSE(grc);
  EXPECT_HAS(grc.status().message(), "grp/config.json: routing: topk_group = 1 groups of 14 experts hold 14");
}

TEST(ModelConfig, LoadFromDirectoryOrFile) {
  test::TempDir dir("cfg_load");
  auto r = load_model_config(dir.str());
  ASSERT_FALSE(r);
  EXPECT_HAS(r.status().message(), dir.file("config.json") + ": cannot read");
  test::write_text(dir.file("config.json"), kimi_config().dump());
  r = load_model_config(dir.str());
  ASSERT_TRUE(r) << r.status().to_string();
  EXPECT_EQ(r->num_experts, 896);
  test::write_text(dir.file("model.safetensors"), "x");
  r = load_model_config(dir.file("model.safetensors"));  // the config next to the file
  ASSERT_TRUE(r) << r.status().to_string();
  EXPECT_EQ(r->source, dir.file("config.json"));
}

TEST(ModelConfigCorpus, ReplaysEveryFile) {
  // The fuzzing seed corpus of fuzz/fuzz_model_config.cpp (and any crashers added after a run).
  const std::filesystem::path dir = std::filesystem::path(K3_TEST_DATA_DIR) / "model_config_corpus";
  ASSERT_TRUE(std::filesystem::is_directory(dir)) << dir;
  int valid = 0, bad = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::ifstream in(entry.path(), std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string name = entry.path().filename().string();
    auto r = parse_model_config(text, name);
    if (name.rfind("valid_", 0) == 0) {
      ++valid;
      EXPECT_TRUE(r) << name << ": " << r.status().to_string();
    } else {
      ++bad;
      ASSERT_FALSE(r) << name << " parsed but is malformed";
      EXPECT_EQ(r.status().message().rfind(name, 0), 0u) << r.status().message();
    }
  }
  EXPECT_GE(valid, 2);
  EXPECT_GE(bad, 7);
}

TEST(ModelConfig, IdRanges) {
  EXPECT_EQ(format_id_ranges({}), "");
  EXPECT_EQ(format_id_ranges({3}), "3");
  EXPECT_EQ(format_id_ranges({3, 7, 8, 9, 12}), "3, 7-9, 12");
  EXPECT_EQ(format_id_ranges({1, 3, 5, 7, 9}, 2), "1, 3, ... (3 more)");
}

}  // namespace
}  // namespace k3
