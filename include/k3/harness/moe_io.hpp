// k3/harness/moe_io.hpp — the routed inputs of one fused-MoE call from a safetensors file (what `k3 moe
// run --input` reads), every shape, dtype and id checked before use (docs/moe.md, "`k3 moe run`").
//
// Tensor names:
//   x [M, K]: BF16 (kept as is) or F32 (rounded to BF16, RNE); K = the layer's expert width
//   either logits [M, E] (F32 or BF16), routed here by the layer's router (routing_from_config,
//           its e_score_correction_bias), or topk_ids [M, top_k] (I32 or I64, -1 = masked, else a
//           global expert id) + topk_weights [M, top_k] (F32), 1 <= top_k <= 32, used as given
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "k3/checkpoint.hpp"
#include "k3/moe.hpp"
#include "k3/status.hpp"

namespace k3 {

// The inputs read from the file, owned; view() gives what the MoE calls take.
struct MoeInputFile {
  int64_t m = 0;
  int top_k = 0;
  std::vector<uint16_t> x;            // [M, K] BF16
  std::vector<int32_t> topk_ids;      // [M, top_k]
  std::vector<float> topk_weights;    // [M, top_k]
  bool routed_here = false;           // true: the file held logits and k3's router chose the ids
  MoeInputsView view() const { return {m, x, topk_ids, topk_weights}; }
};

// Reads `path` for `layer` (its K, E, router config and bias). Errors name the file, the tensor,
// its dtype and shape and what was expected; routing facts are read from the config only when
// the file holds logits (with topk_ids / topk_weights nothing is routed, so the config's
// scoring_func does not matter).
Result<MoeInputFile> load_moe_inputs(const std::string& path, const MoeLayerWeights& layer);

// The output file of `k3 moe run` (one writer for the single-rank and the distributed runs):
//   out [M, K] in the problem's output dtype (BF16 / F16 / F32), the bytes of `out`;
//   topk_ids I32 and topk_weights F32 [M, top_k], the slots that were used (`in`);
//   metadata: k3_version, backend, checkpoint, layer, ep_size, ep_rank (when >= 0), recipe,
//   activation, routing ("logits routed by k3" or "topk_ids/topk_weights from the input").
// Written atomically (st::Writer). Errors: out's size is not M * K * the dtype's size, or the
// inputs' sizes do not match their M and top_k (named); `label` names the path's argument.
struct MoeRunRecord {
  std::string backend;     // e.g. "cpu", "cpu (distributed, mpi)"
  std::string checkpoint;
  int layer = 0;
  int ep_size = 1;
  int ep_rank = -1;        // -1: not stated (the distributed run's file holds every rank's slots)
};
Status write_moe_output(const std::string& path, const std::string& label, const MoeProblem& p,
                        const MoeInputFile& in, std::span<const uint8_t> out, const MoeRunRecord& rec);

}  // namespace k3
