// Synthetic checkpoints: format (config, names, shards), determinism (seed, thread count, EP
// slice == full), and that the weights are realistic (code distribution, scales, output RMS).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <random>

#include "core/st_test_util.hpp"
#include "k3/checkpoint.hpp"
#include "k3/harness/checkpoint_synth.hpp"
#include "k3/formats.hpp"
#include "k3/mx.hpp"
#include "k3/safetensors.hpp"

namespace k3 {
namespace {

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg)

SynthOptions small(const std::string& dir) {
  SynthOptions o;
  o.output_dir = dir;
  o.hidden_size = 64;
  o.expert_hidden = 64;
  o.intermediate = 32;
  o.num_experts = 8;
  o.top_k = 3;
  o.layers = {1, 2};
  o.seed = 7;
  return o;
}

TEST(CheckpointSynth, WritesAKimiCheckpointThatLoads) {
  test::TempDir dir("synth_basic");
  const auto o = small(dir.str());
  auto sum = write_synthetic_checkpoint(o);
  ASSERT_TRUE(sum) << sum.status().to_string();
  EXPECT_EQ(sum->tensors, 2 * (2 + 8 * 6));
  const int64_t per_expert = 2 * (32 * 32 + 32 * 2) + 64 * 16 + 64 * 1;
  EXPECT_EQ(sum->bytes, 2 * (8 * 64 * 2 + 8 * 2 + 8 * per_expert));
  EXPECT_EQ(sum->files, (std::vector<std::string>{"model.safetensors", "config.json"}));

  // config.json in the Kimi spelling, read by the loader's parser.
  auto cfg = load_model_config(dir.str());
  ASSERT_TRUE(cfg) << cfg.status().to_string();
  EXPECT_EQ(cfg->model_type, "kimi_k3");
  EXPECT_EQ(cfg->hidden_size, 64);
  EXPECT_EQ(cfg->expert_hidden, 64);
  EXPECT_EQ(cfg->intermediate, 32);
  EXPECT_EQ(cfg->num_experts, 8);
  EXPECT_EQ(cfg->top_k, 3);
  EXPECT_EQ(cfg->hidden_act, "situ");
  EXPECT_EQ(cfg->quant_format, "mxfp4-pack-quantized");
  EXPECT_EQ(cfg->quant_group_size, 32);

  // Exactly the Kimi-K3 names, dtypes and shapes.
  auto f = st::File::open(dir.file("model.safetensors"));
  ASSERT_TRUE(f) << f.status().to_string();
  const auto* t = f->find("language_model.model.layers.2.block_sparse_moe.experts.7.w2.weight_packed");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, st::DType::kU8);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{64, 16}));
  t = f->find("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{32, 2}));
  t = f->find("language_model.model.layers.1.block_sparse_moe.gate.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, st::DType::kBF16);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{8, 64}));
  t = f->find("language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{8}));

  // The loaded FC1 rows are the synthetic w1 then w3 bytes.
  auto w = load_moe_layer(dir.str(), 2, 4, 3);
  ASSERT_TRUE(w) << w.status().to_string();
  std::vector<uint8_t> gate(32 * 32), up(32 * 32);
  ASSERT_TRUE(synth_expert_tensor(o, 2, 7, 1, false, gate).is_ok());
  ASSERT_TRUE(synth_expert_tensor(o, 2, 7, 3, false, up).is_ok());
  const size_t per = 2 * 32 * 32;  // FC1 codes per expert
  EXPECT_TRUE(std::equal(gate.begin(), gate.end(), w->fc1_q.begin() + per));
  EXPECT_TRUE(std::equal(up.begin(), up.end(), w->fc1_q.begin() + per + gate.size()));
  ASSERT_EQ(w->router_bias.size(), 8u);
  for (float b : w->router_bias) EXPECT_LE(std::fabs(b), 0.05f);
}

TEST(CheckpointSynth, EpSliceAndShardsEqualTheFullCheckpoint) {
  test::TempDir full("synth_full"), slice("synth_slice"), sharded("synth_sharded");
  auto o = small(full.str());
  ASSERT_TRUE(write_synthetic_checkpoint(o));
  auto os = small(slice.str());
  os.expert_begin = 4;
  os.expert_end = 6;  // EP4 rank 2
  os.layers = {2};
  ASSERT_TRUE(write_synthetic_checkpoint(os));
  auto oh = small(sharded.str());
  oh.shard_size = 3000;
  auto sh = write_synthetic_checkpoint(oh);
  ASSERT_TRUE(sh) << sh.status().to_string();
  EXPECT_GT(sh->files.size(), 4u);
  EXPECT_EQ(sh->files[sh->files.size() - 2], "model.safetensors.index.json");
  auto ck = st::Checkpoint::open(sharded.str());
  ASSERT_TRUE(ck) << ck.status().to_string();
  EXPECT_EQ(ck->shard_files().size(), sh->files.size() - 2);
  EXPECT_EQ(ck->tensor_names().size(), static_cast<size_t>(sh->tensors));

  auto a = load_moe_layer(full.str(), 2, 4, 2);
  auto b = load_moe_layer(slice.str(), 2, 4, 2);
  auto c = load_moe_layer(sharded.str(), 2, 4, 2);
  ASSERT_TRUE(a && b && c) << b.status().to_string() << c.status().to_string();
  EXPECT_EQ(a->fc1_q, b->fc1_q);
  EXPECT_EQ(a->fc1_scale, b->fc1_scale);
  EXPECT_EQ(a->fc2_q, b->fc2_q);
  EXPECT_EQ(a->fc2_scale, b->fc2_scale);
  EXPECT_EQ(a->router_weight, b->router_weight);
  EXPECT_EQ(a->router_bias, b->router_bias);
  EXPECT_EQ(a->fc1_q, c->fc1_q);
  EXPECT_EQ(a->fc2_scale, c->fc2_scale);
  // The slice lacks the other ranks' experts, and says so.
  EXPECT_HAS(load_moe_layer(slice.str(), 2, 4, 0).status().message(), "holds experts 4-5");
}

TEST(CheckpointSynth, DeterministicAcrossThreadsAndSeeded) {
  SynthOptions o = small("unused");
  o.expert_hidden = 3584;  // Kimi w1: 5.5 MB, large enough for the threaded path
  o.intermediate = 3072;
  std::vector<uint8_t> ref(3072 * 1792);
  const int saved = omp_get_max_threads();
  for (const int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    std::vector<uint8_t> got(ref.size());
    ASSERT_TRUE(synth_expert_tensor(o, 1, 3, 1, false, got).is_ok());
    if (threads == 1) ref = got;
    EXPECT_EQ(got, ref) << threads << " threads";
  }
  omp_set_num_threads(saved);
  std::vector<uint8_t> other(ref.size());
  o.seed = 8;
  ASSERT_TRUE(synth_expert_tensor(o, 1, 3, 1, false, other).is_ok());
  EXPECT_NE(other, ref);
  o.seed = 7;
  ASSERT_TRUE(synth_expert_tensor(o, 1, 4, 1, false, other).is_ok());  // another expert
  EXPECT_NE(other, ref);
  EXPECT_FALSE(synth_expert_tensor(o, 1, 3, 4, false, other).is_ok());
  EXPECT_HAS(synth_expert_tensor(o, 1, 3, 1, false, std::span<uint8_t>(other).subspan(1)).message(), "expected 5505024");
  // Odd shapes (K 96, N 160) generate the same bytes twice.
  o.expert_hidden = 96;
  o.intermediate = 160;
  std::vector<uint8_t> odd1(160 * 3), odd2(160 * 3);
  ASSERT_TRUE(synth_expert_tensor(o, 2, 1, 3, true, odd1).is_ok());
  ASSERT_TRUE(synth_expert_tensor(o, 2, 1, 3, true, odd2).is_ok());
  EXPECT_EQ(odd1, odd2);
}

TEST(CheckpointSynth, LargeLayerLoadsIdenticallyWithOneTwoThreeThreads) {
  // 4 experts x K 1024 x N 1024: FC1 is 4 MiB, enough for the loader's threaded copy.
  test::TempDir dir("synth_threads");
  auto o = small(dir.str());
  o.expert_hidden = 1024;
  o.intermediate = 1024;
  o.num_experts = 4;
  o.layers = {1};
  ASSERT_TRUE(write_synthetic_checkpoint(o));
  const int saved = omp_get_max_threads();
  std::vector<uint8_t> ref_fc1, ref_fc2s;
  for (const int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    auto w = load_moe_layer(dir.str(), 1, 1, 0);
    ASSERT_TRUE(w) << w.status().to_string();
    if (threads == 1) {
      ref_fc1 = w->fc1_q;
      ref_fc2s = w->fc2_scale;
      // Expert 3's up half is the synthetic w3 of expert 3.
      std::vector<uint8_t> up(1024 * 512);
      ASSERT_TRUE(synth_expert_tensor(o, 1, 3, 3, false, up).is_ok());
      EXPECT_TRUE(std::equal(up.begin(), up.end(), w->fc1_q.begin() + (3 * 2048 + 1024) * 512));
    }
    EXPECT_EQ(w->fc1_q, ref_fc1) << threads << " threads";
    EXPECT_EQ(w->fc2_scale, ref_fc2s) << threads << " threads";
  }
  omp_set_num_threads(saved);
}

TEST(CheckpointSynth, WeightsLookTrainedAndKeepOutputsAtUnitScale) {
  SynthOptions o;  // Kimi shapes: K 3584, N 3072; one expert's w1 is 5.5 MB
  o.output_dir = "unused";
  const int64_t n = 3072, k = 3584;
  std::vector<uint8_t> q(static_cast<size_t>(n * k / 2)), sc(static_cast<size_t>(n * k / 32));
  ASSERT_TRUE(synth_expert_tensor(o, 1, 100, 1, false, q).is_ok());
  ASSERT_TRUE(synth_expert_tensor(o, 1, 100, 1, true, sc).is_ok());
  // Codes: bell-shaped. P(|x| <= 0.25) for N(0, 4) is 0.0995; every one of the 16 codes occurs.
  std::vector<int64_t> hist(16, 0);
  for (uint8_t b : q) {
    ++hist[fp4_low(b)];
    ++hist[fp4_high(b)];
  }
  const double total = static_cast<double>(q.size() * 2);
  EXPECT_NEAR(static_cast<double>(hist[0] + hist[8]) / total, 0.0995, 0.01);
  EXPECT_NEAR(static_cast<double>(hist[7] + hist[15]) / total, 0.0124, 0.004);  // |x| > 5 saturates to 6
  for (int c = 0; c < 16; ++c) EXPECT_GT(hist[static_cast<size_t>(c)], 0) << "code " << c;
  // Scales: 2^(s0 + {-1, 0, +1}), s0 = round(-log2(2 sqrt(3584))) = -7.
  std::vector<int64_t> shist(256, 0);
  for (uint8_t s : sc) ++shist[s];
  EXPECT_EQ(shist[119] + shist[120] + shist[121], static_cast<int64_t>(sc.size()));
  EXPECT_NEAR(static_cast<double>(shist[120]) / static_cast<double>(sc.size()), 0.5, 0.02);

  // GEMM1 rows on a unit-RMS input have RMS of order 1.
  std::vector<float> w(static_cast<size_t>(n * k));
  ASSERT_TRUE(mx_dequantize(q, sc, n, k, MxElement::kE2M1, w).is_ok());
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(k));
  for (auto& v : x) v = normal(rng);
  double sum_sq = 0;
  for (int64_t r = 0; r < n; ++r) {
    double acc = 0;
    for (int64_t c = 0; c < k; ++c) acc += static_cast<double>(w[static_cast<size_t>(r * k + c)]) * x[static_cast<size_t>(c)];
    sum_sq += acc * acc;
  }
  const double rms = std::sqrt(sum_sq / static_cast<double>(n));
  EXPECT_GT(rms, 0.5);
  EXPECT_LT(rms, 2.0);
}

TEST(CheckpointSynth, OptionErrors) {
  test::TempDir dir("synth_errors");
  auto o = small(dir.str());
  o.layers = {0};
  EXPECT_HAS(write_synthetic_checkpoint(o).status().message(), "layer 0 is not an MoE layer: MoE layers are [1, 93)");
  o = small(dir.str());
  o.layers = {1, 1};
  EXPECT_HAS(validate_synth_options(o).message(), "layer 1 is listed twice");
  o = small(dir.str());
  o.expert_begin = 6;
  o.expert_end = 9;
  EXPECT_HAS(validate_synth_options(o).message(), "experts [6, 9) must be a non-empty range within [0, 8)");
  o = small(dir.str());
  o.expert_hidden = 48;
  EXPECT_HAS(validate_synth_options(o).message(), "expert-hidden (K) = 48 must be a positive multiple of 32");
  o = small(dir.str());
  o.top_k = 9;
  EXPECT_HAS(validate_synth_options(o).message(), "top-k = 9 must be in [1, min(32, num-experts = 8)]");
  o = small(dir.str());
  o.activation = "gelu";
  EXPECT_HAS(validate_synth_options(o).message(), "activation 'gelu' is unknown");
  o = small(dir.str());
  o.output_dir = "";
  EXPECT_HAS(validate_synth_options(o).message(), "output directory must be given");

  o = small(dir.str());
  ASSERT_TRUE(write_synthetic_checkpoint(o));
  EXPECT_HAS(write_synthetic_checkpoint(o).status().message(), "already holds a checkpoint");
  o.overwrite = true;
  o.shard_size = 4000;
  auto r = write_synthetic_checkpoint(o);
  ASSERT_TRUE(r);
  // --force only replaces files this run writes: the old single file stays (and is reported),
  // readers follow the new index.
  EXPECT_TRUE(std::filesystem::exists(dir.file("model.safetensors")));
  EXPECT_EQ(r->kept, std::vector<std::string>{"model.safetensors"});
  EXPECT_TRUE(load_moe_layer(dir.str(), 1, 1, 0));
}

TEST(CheckpointSynth, ConfigCarriesActivationAndProvenance) {
  auto o = small("unused");
  o.activation = "silu";
  const auto j = nlohmann::json::parse(synth_config_json(o));
  EXPECT_EQ(j["text_config"]["hidden_act"], "silu");
  EXPECT_FALSE(j["text_config"].contains("activation_situ_beta"));
  EXPECT_EQ(j["k3_synthetic"]["seed"], 7);
  EXPECT_EQ(j["k3_synthetic"]["experts"], nlohmann::json::array({0, 8}));
  auto cfg = parse_model_config(j.dump(), "c.json");
  ASSERT_TRUE(cfg) << cfg.status().to_string();
  EXPECT_EQ(cfg->hidden_act, "silu");
}

}  // namespace
}  // namespace k3
