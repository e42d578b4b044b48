// k3/harness/moe_workload.hpp — the fused-MoE benchmark workload, in the library so that every backend's
// benchmark (the `k3 bench moe` CPU and CUDA paths, the Python package, a user's own harness)
// times the same thing and counts it the same way (docs/moe.md, "Benchmark protocol"):
//
//   * routing distributions (uniform, zipf:S, ep_mixed, replay:FILE) and the replay file format;
//   * synthetic MXFP4 expert weights (only their bytes matter to a timing);
//   * the traffic of one call: the weight bytes it streams and the FLOPs it does.
//
// Replay file (little-endian): 8 bytes magic "K3IDS001", int64 tokens, int64 top_k, then
// tokens * top_k int32 global expert ids (-1 = masked), token-major.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "k3/moe.hpp"
#include "k3/status.hpp"

namespace k3 {

struct BenchRouting {
  enum class Kind { kUniform, kZipf, kEpMixed, kReplay } kind = Kind::kEpMixed;
  double zipf_s = 1.0;
  std::string file;          // kReplay
  std::string name() const;  // "uniform", "zipf:1.2", "ep_mixed", "replay:FILE"
};
// "uniform" | "zipf:S" (finite S > 0) | "ep_mixed" | "replay:FILE". Errors quote the text.
Result<BenchRouting> parse_bench_routing(const std::string& text);

struct RoutedTokens {
  std::vector<int32_t> ids;    // [M, top_k] global expert ids
  std::vector<float> weights;  // [M, top_k] positive, each row sums to 1
};
// uniform:  top_k distinct local experts per token, uniform (needs top_k <= E_local);
// zipf:S:   top_k distinct local experts; the expert of popularity rank r is drawn with weight
//           1/r^S (ranks are a seeded random permutation of the local experts);
// ep_mixed: top_k/2 distinct local + top_k - top_k/2 distinct remote experts, slots shuffled;
// replay:   the file's ids, its tokens repeated cyclically up to M (ids checked against E).
// A pure function of (spec, shape, m, seed).
Result<RoutedTokens> make_bench_routing(const BenchRouting& spec, const MoeShape& shape, int64_t m, uint64_t seed);

// Writes / reads a replay file. `label` names the argument in errors ("--save-routing").
Status save_routing_replay(const std::string& path, int64_t tokens, int top_k, std::span<const int32_t> ids,
                           const std::string& label = "routing replay");
Result<std::vector<int32_t>> load_routing_replay(const std::string& path, int top_k, int64_t* tokens,
                                                 const std::string& label = "routing replay");

// Random MXFP4 expert weights of `shape`'s local experts: codes uniform over all bytes, E8M0
// scales in 2^-8 .. 2^-6 (unit-scale GEMM outputs at Kimi fan-ins). Bit-identical for any
// thread count; finite by construction.
struct SyntheticMoeWeights {
  std::vector<uint8_t> fc1_q, fc1_scale, fc2_q, fc2_scale;
  MoeWeightsView view() const { return {fc1_q, fc1_scale, fc2_q, fc2_scale, {}, {}}; }
};
SyntheticMoeWeights synthetic_moe_weights(const MoeShape& shape, uint64_t seed);

// MXFP4 bytes of one expert: FC1 (2N x K) and FC2 (K x N) codes and scales = 3NK/2 + 3NK/32.
int64_t mxfp4_expert_bytes(const MoeShape& shape);

// What one fused-MoE call over `m` tokens routed by `ids` must do on this rank: every local expert
// with a row in a chunk of `chunk_tokens` tokens streams its weights once per chunk (a backend
// that takes all tokens in one pass has chunk_tokens >= m), and every local slot costs the
// 2 * 3 * K * N FLOPs of its two GEMMs.
struct MoeCallTraffic {
  double weight_bytes = 0;
  double flops = 0;
  int64_t local_slots = 0;
  int64_t active_experts = 0;  // local experts with >= 1 row over the whole call
};
Result<MoeCallTraffic> moe_call_traffic(const MoeShape& shape, int64_t m, std::span<const int32_t> ids,
                                        int64_t chunk_tokens);

}  // namespace k3
