// k3/model.hpp — the native model runner (docs/runner.md): a Kimi-family checkpoint directory
// (config.json + safetensors shards, as published or as transformers' save_pretrained writes it)
// run end to end in C++ on k3's ops, with no Python per layer.
//
//   load      reads and checks config.json (every size against a stated limit, named), memory-maps
//             the shards, checks every tensor's name, dtype and shape, and packs once: the trunk's
//             projections as MXFP8 (the default) or BF16 linear layers, the routed experts as MXFP4
//             (quantized once from BF16, RCEIL); the packed bytes and the peak RSS are reported.
//   forward   runs new tokens of one or more sequences, each in its own slot of the state pool
//             (KDA recurrent and conv states, the MLA latent cache), and returns logits.
//   generate  prefill, then decode with a seeded sampler (greedy, temperature, top-k, top-p).
//
// Families: Kimi-Linear (transformers' KimiLinearForCausalLM: KDA + NoPE MLA layers, a dense
// layer 0, sigmoid-routed MoE with shared experts). Kimi-K3 checkpoints are recognized and refused
// by name until its ops (AttnRes, latent MoE, gated MLA, the full-rank KDA gate) are in.
//
// Numerics: activations are BF16 between ops, as in a BF16 transformers model; norms, the KDA
// gate and core, the router and the attention softmax in FP32. Every op is deterministic, so the
// same inputs give the same bits at any thread count.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "k3/moe.hpp"
#include "k3/status.hpp"
#include "k3/system.hpp"

namespace k3 {

enum class TrunkFormat : uint8_t {
  kMxfp8,  // E4M3 weights + E8M0 scales per 32 (W8A16 linear layers): half the BF16 bytes
  kBf16,   // the checkpoint's BF16 weights (W16A16 linear layers)
};
const char* trunk_format_name(TrunkFormat f);  // "mxfp8" / "bf16"
Result<TrunkFormat> parse_trunk_format(const std::string& s);

// Limits of a config.json that load() accepts (a larger value is refused by name).
inline constexpr int64_t kModelMaxHidden = 65536;
inline constexpr int64_t kModelMaxLayers = 1024;
inline constexpr int64_t kModelMaxVocab = int64_t{1} << 22;
inline constexpr int64_t kModelMaxHeads = 1024;
inline constexpr int64_t kModelMaxHeadDim = 512;
inline constexpr int64_t kModelMaxIntermediate = int64_t{1} << 20;
inline constexpr int64_t kModelMaxContext = int64_t{1} << 20;
inline constexpr int kModelMaxSeqs = 1024;

// The parsed Kimi-Linear configuration (config.json field names in the comments).
struct KimiLinearConfig {
  int64_t vocab_size = 0;             // vocab_size
  int64_t hidden = 0;                 // hidden_size
  int64_t intermediate = 0;           // intermediate_size (the dense MLP of layers < first_k_dense)
  int64_t moe_intermediate = 0;       // moe_intermediate_size
  int64_t layers = 0;                 // num_hidden_layers
  int64_t first_k_dense = 1;          // first_k_dense_replace
  float rms_norm_eps = 1e-5f;         // rms_norm_eps
  // MLA (NoPE): num_attention_heads, q_lora_rank (0: none), kv_lora_rank, qk_nope_head_dim,
  // qk_rope_head_dim, v_head_dim
  int64_t mla_heads = 0, q_lora_rank = 0, kv_lora_rank = 0, qk_nope = 0, qk_rope = 0, v_head = 0;
  // KDA: linear_attn_config.{num_heads, head_dim, short_conv_kernel_size}
  int64_t kda_heads = 0, kda_head_dim = 0, conv_width = 4;
  // MoE: num_experts, num_experts_per_token, num_shared_experts, num_expert_group, topk_group,
  // moe_renormalize, routed_scaling_factor
  int num_experts = 0, top_k = 0, shared_experts = 0, n_group = 1, topk_group = 1;
  bool renormalize = true;
  float routed_scaling_factor = 1.0f;
  bool tie_word_embeddings = false;
  // [layers], with transformers' precedence: layer_types ("full_attention" = MLA), else
  // linear_attn_config.{full_attn_layers, kda_layers} (1-based), else MLA at 4, 8, ...
  std::vector<bool> layer_is_mla;
  // [layers]: mlp_layer_types ("dense"), else the first first_k_dense_replace layers
  std::vector<bool> layer_is_dense;
  std::vector<int32_t> eos_token_ids; // eos_token_id (an int or a list; may be empty)
};

// Reads config.json text; `source` names it in messages. Kimi-K3 configs are refused (kUnsupported).
Result<KimiLinearConfig> parse_kimi_linear_config(const std::string& json_text, const std::string& source);

struct ModelOptions {
  int threads = 0;                    // 0: all logical CPUs; at most kMaxThreadCount
  std::optional<IsaLevel> isa;        // unset: best_isa_level()
  TrunkFormat trunk = TrunkFormat::kMxfp8;
  Recipe experts = Recipe::kW4A16;    // MXFP4 experts with BF16 (w4a16) or MXFP8 (w4a8) activations
  int max_seqs = 1;                   // slots of the state pool, 1 .. kModelMaxSeqs
  int64_t max_context = 4096;         // tokens per slot (prompt + generated), 1 .. kModelMaxContext
  int64_t max_batch_tokens = 512;     // tokens of one forward() call (all sequences), 1 .. 65536
  // Called with one line as loading proceeds ("packing layer 3 of 27 ..."); may be empty.
  std::function<void(const std::string&)> progress;
};

struct ModelInfo {
  std::string family;                 // "kimi_linear"
  std::string directory;
  KimiLinearConfig config;
  TrunkFormat trunk = TrunkFormat::kMxfp8;
  Recipe experts = Recipe::kW4A16;
  int threads = 1;
  int max_seqs = 1;
  int64_t max_context = 0, max_batch_tokens = 0;
  IsaLevel isa = IsaLevel::kScalar;
  int64_t packed_bytes = 0;           // weights as the runner holds them (packed layers + BF16 tables)
  int64_t state_bytes = 0;            // the state pool
  int64_t step_bytes = 0;             // bytes one decode step of one sequence reads (weights, routed experts at top-k)
  int64_t peak_rss_bytes = 0;         // the process's peak RSS after load
  double load_seconds = 0;
  std::string describe() const;       // a few lines: family, sizes, kernels
};

struct SamplingOptions {
  float temperature = 0.0f;           // 0: greedy (the lowest id among equal maxima)
  int top_k = 0;                      // 0: no top-k cut
  float top_p = 1.0f;                 // in (0, 1]; 1: no nucleus cut
  uint64_t seed = 0;
};

// Draws one token id from logits [vocab] (FP32): the same seed and logits give the same id on every
// machine (a 64-bit Mersenne Twister, std::mt19937_64, whose sequence the C++ standard fixes).
class Sampler {
 public:
  explicit Sampler(const SamplingOptions& o);
  static Status check(const SamplingOptions& o);  // temperature >= 0 finite, top_k >= 0, top_p in (0, 1]
  // NaN logits are never drawn; all-NaN logits are an error.
  Result<int32_t> sample(std::span<const float> logits);
 private:
  SamplingOptions o_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> scratch_;
};

struct GenerateTimings {
  int64_t prompt_tokens = 0, new_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;  // decode: the steps after the first new token
};

class Model {
 public:
  virtual ~Model() = default;
  static Result<std::unique_ptr<Model>> load(const std::string& directory, const ModelOptions& options = {});

  virtual const ModelInfo& info() const = 0;
  int64_t vocab_size() const { return info().config.vocab_size; }

  // Empties a slot (its position goes back to 0).
  virtual Status reset(int slot) = 0;
  // Tokens held by a slot (its position).
  virtual Result<int64_t> position(int slot) const = 0;

  // New tokens of N sequences flattened: sequence n owns tokens[cu_seqlens[n] .. cu_seqlens[n+1])
  // (each at least one token) and continues slot slots[n] (distinct). cu_seqlens empty: one sequence.
  // logits: FP32, [N, vocab] (each sequence's last token) or, with all_logits, [T, vocab].
  // Checks every id against the vocabulary, the slots, T <= max_batch_tokens and each slot's
  // position + its tokens <= max_context, before any state changes.
  virtual Status forward(std::span<const int32_t> tokens, std::span<const int64_t> cu_seqlens,
                         std::span<const int32_t> slots, bool all_logits, std::span<float> logits) = 0;

  // Resets `slot`, prefills `prompt` (in pieces of max_batch_tokens), then samples up to
  // max_new_tokens, stopping after a token of `stop_ids` (kept in the output). Returns the new ids.
  Result<std::vector<int32_t>> generate(int slot, std::span<const int32_t> prompt, int64_t max_new_tokens,
                                        const SamplingOptions& sampling, std::span<const int32_t> stop_ids = {},
                                        GenerateTimings* timings = nullptr);
};

}  // namespace k3
