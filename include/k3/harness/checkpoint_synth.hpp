// k3/harness/checkpoint_synth.hpp — seeded synthetic Kimi-K3 checkpoints (what `k3 checkpoint synth`
// writes): exactly the tensor names, dtypes and shapes of k3/checkpoint.hpp and a config.json in
// the Kimi-K3 spelling, for any subset of layers and experts.
//
// Content (deterministic in (seed, layer, expert, tensor, row): an expert's bytes are the same
// whichever range, shard size or thread count writes it, so an EP rank's slice of a checkpoint
// equals the same experts of the full one):
//   * E2M1 codes: a discretized N(0, 2^2) (bell-shaped like trained weights, about 1 % of codes at
//     the +-6 saturation value), both signs, including -0;
//   * E8M0 scales: 2^(s0 + j) with s0 = round(-log2(2 sqrt(fan_in))) and j in {-1, 0, 0, +1} per
//     block, so that each GEMM output has roughly unit RMS for unit-RMS inputs (fan_in K for w1 /
//     w3, N for w2: 2^-7 at Kimi shapes, 2^-4 for K = 64);
//   * router gate.weight BF16 [E, hidden_size] uniform with RMS 1/sqrt(hidden_size) (unit-RMS
//     logits for unit-RMS tokens); e_score_correction_bias BF16 [E] uniform in [-0.05, 0.05].
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "k3/status.hpp"

namespace k3 {

struct SynthOptions {
  std::string output_dir;
  std::vector<int> layers = {1};      // MoE layers to store (>= first_k_dense_replace)
  int expert_begin = 0;               // global experts [expert_begin, expert_end) are stored
  int expert_end = -1;                // -1: num_experts
  int64_t hidden_size = 7168;
  int64_t expert_hidden = 3584;       // K (routed_expert_hidden_size)
  int64_t intermediate = 3072;        // N (moe_intermediate_size)
  int num_experts = 896;
  int top_k = 16;
  int num_hidden_layers = 93;
  int first_k_dense_replace = 1;
  std::string activation = "situ";    // hidden_act: situ / silu / swiglu
  uint64_t seed = 0;
  int64_t shard_size = 0;             // max bytes of tensor data per shard; 0 = one model.safetensors
  bool router = true;                 // write gate.weight and e_score_correction_bias
  // Write into a directory that already holds checkpoint files (config.json, the index or
  // *.safetensors): only the files this run writes are replaced (each by an atomic rename), plus a
  // stale model.safetensors.index.json is removed when writing one model.safetensors; any other
  // *.safetensors file is left in place (SynthSummary::kept).
  bool overwrite = false;
};

struct SynthSummary {
  int64_t tensors = 0;
  int64_t bytes = 0;                  // tensor data bytes over all files
  std::vector<std::string> files;     // written files, relative to output_dir
  std::vector<std::string> removed;   // a stale index removed by overwrite
  std::vector<std::string> kept;      // checkpoint files found in output_dir, not written, left in place
};

// Checks the options (shapes multiples of 32, layer and expert ranges, ...); the message names
// the option and the value.
Status validate_synth_options(const SynthOptions& o);

// Writes config.json, the safetensors file(s) and, when sharded, model.safetensors.index.json.
Result<SynthSummary> write_synthetic_checkpoint(const SynthOptions& o);

// The bytes of one synthetic expert tensor (proj 1 = w1 gate, 2 = w2 down, 3 = w3 up; scale =
// weight_scale instead of weight_packed); `out` must have the tensor's size.
Status synth_expert_tensor(const SynthOptions& o, int layer, int expert, int proj, bool scale, std::span<uint8_t> out);

// config.json text for the options (Kimi-K3 spelling: model_type kimi_k3, facts under text_config).
std::string synth_config_json(const SynthOptions& o);

}  // namespace k3
