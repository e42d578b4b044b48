// libFuzzer target for config.json parsing (k3::parse_model_config): any text gives a config whose
// facts are consistent, or an error naming the file; never a crash (ASan / UBSan) or a hang.
// Run: scripts/fuzz.sh SECONDS model_config
#include <cstdint>
#include <cstdlib>
#include <string>

#include "k3/checkpoint.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto r = k3::parse_model_config(text, "fuzz/config.json");
  if (!r) {
    if (r.status().message().rfind("fuzz/config.json", 0) != 0) std::abort();
    return 0;
  }
  const auto& c = r.value();
  if (c.hidden_size < 1 || c.expert_hidden < 1 || c.intermediate < 1 || c.num_experts < 1 || c.top_k < 1 ||
      c.top_k > c.num_experts || c.n_group < 1 || c.num_experts % c.n_group != 0 || c.topk_group > c.n_group ||
      c.first_k_dense_replace > c.num_hidden_layers) {
    std::abort();  // parse_model_config promised consistent facts
  }
  (void)k3::moe_shape_from_config(c, 1, 0);  // must not crash on any parsed config
  return 0;
}
