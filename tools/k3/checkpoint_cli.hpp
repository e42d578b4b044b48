// Shared pieces of `k3 checkpoint synth` and `k3 checkpoint inspect` (tools/k3/cmd_checkpoint.cpp,
// tools/k3/checkpoint_inspect.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "k3/status.hpp"

namespace k3::tool {

// "1,2,5-7" -> {1, 2, 5, 6, 7}
Result<std::vector<int>> parse_int_list(const std::string& s, const char* option);
// "196:224" -> {196, 224} (end exclusive)
Result<std::pair<int, int>> parse_range(const std::string& s, const char* option);
// "5GB", "500M", "2GiB", "1048576" -> bytes (K/M/G = 10^3/10^6/10^9, Ki/Mi/Gi = 2^10/2^20/2^30)
Result<int64_t> parse_byte_size(const std::string& s, const char* option);
// 15.7 GB / 512.0 KiB style, for humans
std::string human_bytes(int64_t bytes);

struct InspectArgs {
  std::string path;
  bool json = false;
  bool summary = false;  // text: skip the per-tensor listing
  int layer = -1;        // >= 0: also load this MoE layer for (ep_size, ep_rank) with load_moe_layer
  int ep_size = 1, ep_rank = 0;
};
Status run_inspect(const InspectArgs& a);

}  // namespace k3::tool
