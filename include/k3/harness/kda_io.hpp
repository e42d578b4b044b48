// k3/harness/kda_io.hpp — KDA inputs from a safetensors file (what `k3 kda run --input` reads), with every
// shape, dtype and size checked before anything is allocated (docs/kda.md, "`k3 kda run` input
// checks"). The loaded tensors are owned; inputs() gives the views the KDA calls take.
//
// Tensor names (shapes with an optional leading batch dim of 1):
//   q, k [T, H, K] and v [T, H, V]: BF16 (kept as is), F16, F32 or F64 (converted to FP32)
//   g [T, H, K]: the log decay, or the gate input f when A_log is present (or the gate says so)
//   beta [T, H] (beta itself) or beta_logits [T, H] (sigmoid applied inside): exactly one
//   A_log [>= H], dt_bias [H, K] or [H * K]: the gated modes (safe | softplus)
//   cu_seqlens [N + 1] I64 or I32 (optional), initial_state [N, H, K, V] / [N, H, V, K] (optional)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "k3/kda.hpp"
#include "k3/safetensors.hpp"
#include "k3/status.hpp"

namespace k3::kda {

// The settings of `k3 kda run` that decide how the file is read (its flags, as given).
struct InputFileOptions {
  std::string gate;                // "" = safe if the file holds A_log, else log_decay
  std::string layout = "k_first";  // state layout name (parse_state_layout)
  float scale = 0.0f;              // KdaConfig::scale
  float lower_bound = -5.0f;       // KdaConfig::gate_lower_bound
  bool l2norm_qk = true;           // KdaConfig::l2norm_qk
};

// Everything read from the file, owned.
struct InputFile {
  KdaConfig cfg;
  std::vector<uint16_t> q16, k16, v16;  // BF16 activations (the F32 vector of the same tensor is empty)
  std::vector<float> q32, k32, v32, g, beta, a_log, dt_bias, initial_state;
  std::vector<int64_t> cu_seqlens;
  int64_t tokens = 0;  // T
  int64_t seqs = 1;    // N
  KdaInputs inputs() const;  // views of the vectors above
};

// Reads and checks the tensors of `f`. Errors name the tensor, the expected and actual shape or
// dtype (or the cu_seqlens entry), or the limit and the bytes a tensor would need as FP32. On
// success the inputs pass validate_prefill for outputs of output_elements().
Result<InputFile> load_input_file(const st::File& f, const InputFileOptions& opt);

struct OutputElements {
  int64_t o = 0;            // [T, H, V]
  int64_t final_state = 0;  // [N, H, K, V]
};
// Element counts of the outputs, each checked with check_buffer_bytes for `elem_bytes` per
// element (4: FP32, 8: the FP64 reference) before the caller allocates them.
Result<OutputElements> output_elements(const InputFile& in, int64_t elem_bytes);

}  // namespace k3::kda
