// Hostile safetensors headers and config.json files: strict JSON (byte order mark, repeated keys,
// bytes after the value, with the byte offset), an entry-count limit enforced before parsing, a
// header of 100 000 tensors parsed in O(n log n), absurd SiTU betas, overflow-free numel, and
// printable tensor names.
#include <gtest/gtest.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>

#include "core/st_test_util.hpp"
#include "k3/checkpoint.hpp"
#include "k3/safetensors.hpp"

namespace k3 {
namespace {

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg)

std::string parse_error(const std::vector<uint8_t>& img) {
  auto r = st::parse_header(img, "bad.safetensors");
  if (r) return "(parsed)";
  return r.status().message();
}

std::string at_byte(const std::string& header, const std::string& needle, size_t nth = 1) {
  size_t p = std::string::npos;
  for (size_t i = 0; i < nth; ++i) p = header.find(needle, p == std::string::npos ? 0 : p + 1);
  return "byte " + std::to_string(8 + p);
}

TEST(HostileSafetensors, ByteOrderMarkIsRefused) {
  const auto m = parse_error(test::st_image("\xEF\xBB\xBF{}"));
  EXPECT_HAS(m, "bad.safetensors: header starts with a UTF-8 byte order mark (EF BB BF at byte 8)");
}

TEST(HostileSafetensors, DuplicateKeysInsideAnEntryAreRefusedWithTheOffset) {
  const std::string h = R"({"w":{"dtype":"U8","shape":[1],"dtype":"I8","data_offsets":[0,1]}})";
  const auto m = parse_error(test::st_image(h, {7}));
  EXPECT_HAS(m, "bad.safetensors: tensor 'w': key \"dtype\" appears more than once (at " + at_byte(h, "\"dtype\"", 2) + ")");
  // The same key spelled with an escape is the same key.
  const std::string h2 = R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"\u0064type":"U8"}})";
  EXPECT_HAS(parse_error(test::st_image(h2, {7})), "key \"dtype\" appears more than once");
  const std::string h3 = R"({"__metadata__":{"a":"1","a":"2"}})";
  EXPECT_HAS(parse_error(test::st_image(h3)), "tensor '__metadata__': key \"a\" appears more than once");
}

TEST(HostileSafetensors, DuplicateTopLevelNamesGiveTheOffset) {
  const std::string h = R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"w":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})";
  EXPECT_HAS(parse_error(test::st_image(h)),
             "bad.safetensors: tensor 'w': name appears more than once (at " + at_byte(h, "\"w\"", 2) + ")");
}

TEST(HostileSafetensors, BytesAfterTheJsonAreRefusedWithTheOffset) {
  // Spaces are the permitted padding.
  EXPECT_TRUE(st::parse_header(test::st_image("{}      "), "ok.safetensors"));
  auto m = parse_error(test::st_image(std::string("{}\0   ", 6)));
  EXPECT_HAS(m, "bad.safetensors: header is not valid JSON at byte 10 (0x00): a NUL byte");
  m = parse_error(test::st_image("{} garbage"));
  EXPECT_HAS(m, "header is not valid JSON at byte 11 ('g')");
  m = parse_error(test::st_image("{}\n  "));
  EXPECT_HAS(m, "header has 0x0a at byte 10 after the JSON value (only spaces may pad it)");
  m = parse_error(test::st_image("{}\t"));
  EXPECT_HAS(m, "0x09 at byte 10");
}

TEST(HostileSafetensors, HundredThousandTensorsParseQuickly) {
  // Used to take seconds at 20 000 entries; the checks are O(n log n) now.
  constexpr int kN = 100'000;
  std::string h = "{";
  for (int i = 0; i < kN; ++i) {
    h += (i ? ",\"t" : "\"t") + std::to_string(i) + R"(":{"dtype":"U8","shape":[0],"data_offsets":[0,0]})";
  }
  h += "}";
  const auto img = test::st_image(h);
  const auto t0 = std::chrono::steady_clock::now();
  auto r = st::parse_header(img, "many.safetensors");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(r) << r.status().to_string();
  EXPECT_EQ(r->size(), static_cast<size_t>(kN));
  EXPECT_LT(secs, 30.0) << "100 000 empty tensors took " << secs << " s";
}

TEST(HostileSafetensors, EntryCountAboveTheLimitIsRefusedBeforeParsing) {
  std::string h = "{";
  h.reserve(static_cast<size_t>(st::kMaxTensors) * 6 + 16);
  for (int64_t i = 0; i <= st::kMaxTensors; ++i) h += i ? ",\"a\":0" : "\"a\":0";
  h += "}";
  const auto m = parse_error(test::st_image(h));
  EXPECT_HAS(m, "bad.safetensors: header has 1000001 entries, above the limit of 1000000 (kMaxTensors)");
}

TEST(HostileSafetensors, NumelNeverOverflows) {
  st::TensorInfo t;
  t.shape = {int64_t{1} << 40, int64_t{1} << 40, 0};
  EXPECT_EQ(t.numel(), 0);
  t.shape = {int64_t{1} << 40, int64_t{1} << 40};
  EXPECT_EQ(t.numel(), -1);
  t.shape = {3, 4};
  EXPECT_EQ(t.numel(), 12);
  t.shape = {};
  EXPECT_EQ(t.numel(), 1);
}

TEST(HostileSafetensors, NamesWithControlCharactersArePrintable) {
  EXPECT_EQ(st::printable_name("a\x1b[2Jb\n\x7f\\"), "a\\x1b[2Jb\\x0a\\x7f\\x5c");
  EXPECT_EQ(st::printable_name("caf\xC3\xA9 \xC2\x9B"), "caf\xC3\xA9 \\xc2\\x9b");
  // Error messages quote names through it.
  const std::string h = "{\"w\\u001b[2J\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,1]}}";
  const auto m = parse_error(test::st_image(h, {7}));
  EXPECT_HAS(m, "tensor 'w\\x1b[2J'");
  EXPECT_EQ(m.find('\x1b'), std::string::npos) << m;
}

// --- config.json ---

nlohmann::json kimi_config() {
  return nlohmann::json::parse(R"({
    "model_type": "kimi_k3",
    "text_config": {
      "model_type": "kimi_linear", "hidden_size": 7168, "num_hidden_layers": 93, "num_experts": 896,
      "num_experts_per_token": 16, "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584,
      "first_k_dense_replace": 1, "moe_router_activation_func": "sigmoid",
      "num_expert_group": 1, "topk_group": 1, "moe_renormalize": true, "routed_scaling_factor": 1.0,
      "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0
    }
  })");
}

std::string config_error(const std::string& text) {
  auto r = parse_model_config(text, "c.json");
  if (r) return "(parsed)";
  return r.status().message();
}

TEST(HostileConfig, ByteOrderMarkIsRefused) {
  EXPECT_HAS(config_error("\xEF\xBB\xBF" + kimi_config().dump()), "c.json: starts with a UTF-8 byte order mark (EF BB BF at byte 0)");
}

TEST(HostileConfig, DuplicateKeysAreRefusedWithTheOffset) {
  std::string text = kimi_config().dump();
  const std::string key = "\"num_experts\":896";
  text.insert(text.find(key), "\"num_experts\":8,");
  const size_t second = text.find("\"num_experts\"", text.find("\"num_experts\"") + 1);
  EXPECT_HAS(config_error(text), "c.json: key \"num_experts\" inside \"text_config\" appears more than once (second at byte " +
                                     std::to_string(second) + ")");
  EXPECT_HAS(config_error(R"({"model_type":"a","model_type":"b"})"), "key \"model_type\" appears more than once (second at byte 18)");
}

TEST(HostileConfig, TrailingGarbageIsRefusedWithTheOffset) {
  const std::string text = kimi_config().dump();
  EXPECT_TRUE(parse_model_config(text + "\n", "c.json")) << "a trailing newline is whitespace";
  EXPECT_HAS(config_error(text + "x"), "c.json: not valid JSON at byte " + std::to_string(text.size()) + " ('x')");
  EXPECT_HAS(config_error(text + std::string("\0", 1)), "at byte " + std::to_string(text.size()) + " (0x00)");
}

TEST(HostileConfig, AbsurdSituBetasAreRefusedNamingKeyAndFile) {
  for (const char* key : {"activation_situ_beta", "activation_situ_linear_beta"}) {
    for (const double v : {1e300, 1e39, 1e-50, 1e-30, -4.0, 0.0}) {
      auto j = kimi_config();
      j["text_config"][key] = v;
      const auto m = config_error(j.dump());
      EXPECT_HAS(m, std::string("c.json: text_config: \"") + key + "\" = ");
      EXPECT_HAS(m, "outside the accepted range [0.001, 1e+06]");
    }
    auto j = kimi_config();
    j["text_config"][key] = 1e39;
    EXPECT_HAS(config_error(j.dump()), "(overflows FP32)");
    j["text_config"][key] = 1e-50;
    EXPECT_HAS(config_error(j.dump()), "(underflows to 0 in FP32)");
  }
  auto j = kimi_config();
  j["text_config"]["activation_situ_beta"] = 0.5;
  EXPECT_TRUE(parse_model_config(j.dump(), "c.json"));
}

}  // namespace
}  // namespace k3
