// Routing distributions of `k3 bench moe` (docs/moe.md, benchmark protocol) and the
// replay file format.
//
// Replay file (little-endian): 8 bytes magic "K3IDS001", int64 tokens, int64 top_k, then
// tokens * top_k int32 global expert ids (-1 = masked), token-major. `k3 bench moe
// --save-routing FILE` writes one from any distribution.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "k3/moe.hpp"
#include "k3/status.hpp"

namespace k3::tool {

struct RoutingSpec {
  enum class Kind { kUniform, kZipf, kEpMixed, kReplay } kind = Kind::kEpMixed;
  double zipf_s = 1.0;
  std::string file;
  std::string name() const;  // "uniform", "zipf:1.2", "ep_mixed", "replay:FILE"
};
// "uniform" | "zipf:S" (S > 0) | "ep_mixed" | "replay:FILE"
Result<RoutingSpec> parse_routing(const std::string& s);

struct Routing {
  std::vector<int32_t> ids;     // [M, top_k] global ids
  std::vector<float> weights;   // [M, top_k] positive, each row sums to 1
};

// uniform:  top_k distinct local experts per token, uniform (needs top_k <= E_local);
// zipf:S:   top_k distinct local experts, expert of popularity rank r drawn with weight 1/r^S
//           (ranks are a fixed random permutation of the local experts);
// ep_mixed: top_k/2 distinct local + top_k - top_k/2 distinct remote experts, slots shuffled;
// replay:   the file's ids, tokens repeated cyclically up to M (ids are checked against E).
Result<Routing> make_routing(const RoutingSpec& spec, const MoeShape& shape, int64_t m, uint64_t seed);

Status save_routing(const std::string& path, int64_t tokens, int top_k, const std::vector<int32_t>& ids);
Result<std::vector<int32_t>> load_routing(const std::string& path, int top_k, int64_t* tokens);

}  // namespace k3::tool
