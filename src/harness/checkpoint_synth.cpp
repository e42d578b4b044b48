// Seeded synthetic Kimi-K3 checkpoints (k3/harness/checkpoint_synth.hpp).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "k3/harness/atomic_file.hpp"
#include "k3/checkpoint.hpp"
#include "k3/harness/checkpoint_synth.hpp"
#include "k3/formats.hpp"
#include "k3/mx.hpp"
#include "k3/safetensors.hpp"

namespace k3 {

namespace fs = std::filesystem;

namespace {

// splitmix64 finalizer: a bijective 64-bit mix, good enough for test data and seedable.
constexpr uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A counter-based stream per (seed, layer, expert, tensor kind, row): rows are independent, so
// rows can be generated in parallel and any subset of experts reproduces the same bytes.
class Stream {
 public:
  Stream(uint64_t seed, int layer, int expert, int kind, int64_t row)
      : state_(mix64(mix64(mix64(mix64(seed + 0x9E3779B97F4A7C15ull) ^ static_cast<uint64_t>(layer)) ^
                                 static_cast<uint64_t>(expert)) ^
                           static_cast<uint64_t>(kind)) ^
               static_cast<uint64_t>(row)) {}
  uint64_t next() {
    state_ += 0x9E3779B97F4A7C15ull;
    return mix64(state_);
  }
  // Uniform in [-1, 1) with 24 random bits.
  float uniform_pm1() { return static_cast<float>(next() >> 40) * (2.0f / 16777216.0f) - 1.0f; }

 private:
  uint64_t state_;
};

// 256-entry table: a uniform byte -> an E2M1 code distributed like N(0, sigma^2) rounded to E2M1.
std::array<uint8_t, 256> make_code_table() {
  constexpr double kSigma = 2.0;
  // |x| rounds to magnitude index m (0, 0.5, 1, 1.5, 2, 3, 4, 6) below these midpoints.
  constexpr double kUpper[8] = {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, INFINITY};
  double cdf[17] = {0};  // codes in order -6..-0 (15..8), +0..+6 (0..7)
  uint8_t order[16];
  for (int m = 0; m < 8; ++m) {
    order[7 - m] = static_cast<uint8_t>(8 + m);  // negative codes, largest magnitude first
    order[8 + m] = static_cast<uint8_t>(m);
  }
  auto p_abs_le = [&](double t) { return std::isinf(t) ? 1.0 : std::erf(t / (kSigma * std::sqrt(2.0))); };
  double prob[16];
  for (int m = 0; m < 8; ++m) {
    const double p = p_abs_le(kUpper[m]) - (m ? p_abs_le(kUpper[m - 1]) : 0.0);
    prob[7 - m] = p / 2;
    prob[8 + m] = p / 2;
  }
  for (int i = 0; i < 16; ++i) cdf[i + 1] = cdf[i] + prob[i];
  std::array<uint8_t, 256> table{};
  int c = 0;
  for (int i = 0; i < 256; ++i) {
    const double u = (i + 0.5) / 256.0 * cdf[16];
    while (c < 15 && u > cdf[c + 1]) ++c;
    table[static_cast<size_t>(i)] = order[c];
  }
  return table;
}

const std::array<uint8_t, 256>& code_table() {
  static const auto t = make_code_table();
  return t;
}

// Scale exponent for unit-RMS GEMM outputs: codes have RMS ~2, so 2^s0 ~ 1 / (2 sqrt(fan_in)).
int base_scale_exponent(int64_t fan_in) {
  return static_cast<int>(std::lround(-std::log2(2.0 * std::sqrt(static_cast<double>(fan_in)))));
}

constexpr int kRouterWeightKind = 100, kRouterBiasKind = 101;
constexpr const char* kIndexFile = "model.safetensors.index.json";

struct PlannedTensor {
  std::string name;
  st::DType dtype;
  std::vector<int64_t> shape;
  int64_t nbytes;
  st::Writer::Fill fill;
};

std::vector<PlannedTensor> plan_tensors(const SynthOptions& o) {
  std::vector<PlannedTensor> plan;
  const int e_end = o.expert_end < 0 ? o.num_experts : o.expert_end;
  const int64_t k = o.expert_hidden, n = o.intermediate;
  for (const int layer : o.layers) {
    if (o.router) {
      plan.push_back({kimi_router_weight_name(layer), st::DType::kBF16, {o.num_experts, o.hidden_size},
                      int64_t{o.num_experts} * o.hidden_size * 2, [o, layer](std::span<uint8_t> out) {
                        // [E, hidden_size] BF16, uniform with RMS 1/sqrt(hidden): a = sqrt(3 / hidden)
                        const float a = static_cast<float>(std::sqrt(3.0 / static_cast<double>(o.hidden_size)));
                        const bool parallel = out.size() >= (size_t{1} << 20);
#pragma omp parallel for schedule(static) if (parallel)
                        for (int e = 0; e < o.num_experts; ++e) {
                          Stream s(o.seed, layer, e, kRouterWeightKind, 0);
                          for (int64_t i = 0; i < o.hidden_size; ++i) {
                            const uint16_t b = bf16_from_f32(a * s.uniform_pm1());
                            const size_t at = static_cast<size_t>((e * o.hidden_size + i) * 2);
                            out[at] = static_cast<uint8_t>(b);
                            out[at + 1] = static_cast<uint8_t>(b >> 8);
                          }
                        }
                        return Status::ok();
                      }});
      plan.push_back({kimi_router_bias_name(layer), st::DType::kBF16, {o.num_experts}, int64_t{o.num_experts} * 2,
                      [o, layer](std::span<uint8_t> out) {
                        Stream s(o.seed, layer, 0, kRouterBiasKind, 0);  // [E] BF16 in [-0.05, 0.05]
                        for (int e = 0; e < o.num_experts; ++e) {
                          const uint16_t b = bf16_from_f32(0.05f * s.uniform_pm1());
                          out[static_cast<size_t>(2 * e)] = static_cast<uint8_t>(b);
                          out[static_cast<size_t>(2 * e + 1)] = static_cast<uint8_t>(b >> 8);
                        }
                        return Status::ok();
                      }});
    }
    for (int e = o.expert_begin; e < e_end; ++e) {
      for (const int proj : {1, 2, 3}) {
        const int64_t rows = proj == 2 ? k : n, cols = proj == 2 ? n : k;
        for (const bool scale : {false, true}) {
          const int64_t width = scale ? cols / kMxBlock : cols / 2;
          plan.push_back({kimi_expert_tensor_name(layer, e, proj, scale), st::DType::kU8, {rows, width}, rows * width,
                          [o, layer, e, proj, scale](std::span<uint8_t> out) {
                            return synth_expert_tensor(o, layer, e, proj, scale, out);
                          }});
        }
      }
    }
  }
  return plan;
}

// Existing checkpoint files in `dir` (config.json, the index, *.safetensors), by file name.
std::vector<std::string> checkpoint_files(const fs::path& dir) {
  std::vector<std::string> found;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const auto name = it->path().filename().string();
    if (name == "config.json" || name == kIndexFile || it->path().extension() == ".safetensors") found.push_back(name);
  }
  std::sort(found.begin(), found.end());
  return found;
}

Result<SynthSummary> write_impl(const SynthOptions& o) {
  K3_RETURN_IF_ERROR(validate_synth_options(o));
  const fs::path dir(o.output_dir);

  auto plan = plan_tensors(o);
  // Shards: consecutive tensors while the shard stays within shard_size (a larger tensor alone).
  std::vector<std::pair<size_t, size_t>> shards;  // [first, last) tensor index
  if (o.shard_size <= 0) {
    shards.emplace_back(0, plan.size());
  } else {
    size_t first = 0;
    int64_t bytes = 0;
    for (size_t i = 0; i < plan.size(); ++i) {
      if (i > first && bytes + plan[i].nbytes > o.shard_size) {
        shards.emplace_back(first, i);
        first = i;
        bytes = 0;
      }
      bytes += plan[i].nbytes;
    }
    shards.emplace_back(first, plan.size());
  }
  std::vector<std::string> shard_names;
  for (size_t si = 0; si < shards.size(); ++si) {
    std::string file = "model.safetensors";
    if (o.shard_size > 0) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", si + 1, shards.size());
      file = buf;
    }
    shard_names.push_back(file);
  }
  // The files this run writes; --force replaces exactly these (each by an atomic rename).
  std::set<std::string> own(shard_names.begin(), shard_names.end());
  own.insert("config.json");
  if (o.shard_size > 0) own.insert(kIndexFile);

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return io_error(o.output_dir + ": cannot create directory: " + ec.message());
  SynthSummary summary;
  const auto existing = checkpoint_files(dir);
  if (!existing.empty()) {
    if (!o.overwrite) {
      return invalid_argument(o.output_dir + " already holds a checkpoint (" + existing.front() +
                              "); choose an empty directory or overwrite it (--force)");
    }
    for (const auto& name : existing) {
      if (own.count(name)) continue;  // replaced below
      if (name == kIndexFile) {
        // A stale index would make readers ignore the model.safetensors written now: it is the one
        // file --force removes without writing it again (it is a name this command writes).
        if (!fs::is_regular_file(dir / name, ec)) {
          return invalid_argument((dir / name).string() + " is not a regular file; k3 will not remove it");
        }
        fs::remove(dir / name, ec);
        if (ec) return io_error((dir / name).string() + ": cannot remove the stale index: " + ec.message());
        summary.removed.push_back(name);
        continue;
      }
      summary.kept.push_back(name);  // not k3's to touch
    }
  }

  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (size_t si = 0; si < shards.size(); ++si) {
    const std::string& file = shard_names[si];
    st::Writer w;
    w.set_metadata({{"format", "pt"}});
    for (size_t i = shards[si].first; i < shards[si].second; ++i) {
      auto& t = plan[i];
      K3_RETURN_IF_ERROR(w.add_deferred(t.name, t.dtype, t.shape, std::move(t.fill)));
      weight_map[t.name] = file;
      summary.bytes += t.nbytes;
      ++summary.tensors;
    }
    K3_RETURN_IF_ERROR(w.write((dir / file).string()));
    summary.files.push_back(file);
  }
  if (o.shard_size > 0) {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", summary.bytes}};
    index["weight_map"] = weight_map;
    K3_RETURN_IF_ERROR(write_file_atomic((dir / kIndexFile).string(), index.dump(2) + "\n"));
    summary.files.push_back(kIndexFile);
  }
  K3_RETURN_IF_ERROR(write_file_atomic((dir / "config.json").string(), synth_config_json(o)));
  summary.files.push_back("config.json");
  return summary;
}

}  // namespace

Status validate_synth_options(const SynthOptions& o) {
  auto s = [](int64_t v) { return std::to_string(v); };
  if (o.output_dir.empty()) return invalid_argument("output directory must be given");
  if (o.hidden_size < 1 || o.hidden_size > (1 << 20)) {
    return invalid_argument("hidden = " + s(o.hidden_size) + " must be in [1, 1048576]");
  }
  if (o.expert_hidden <= 0 || o.expert_hidden % kMxBlock != 0 || o.expert_hidden > (1 << 20)) {
    return invalid_argument("expert-hidden (K) = " + s(o.expert_hidden) + " must be a positive multiple of 32, <= 1048576");
  }
  if (o.intermediate <= 0 || o.intermediate % kMxBlock != 0 || o.intermediate > (1 << 20)) {
    return invalid_argument("intermediate (N) = " + s(o.intermediate) + " must be a positive multiple of 32, <= 1048576");
  }
  if (o.num_experts < 1 || o.num_experts > 4096) {
    return invalid_argument("num-experts = " + s(o.num_experts) + " must be in [1, 4096]");
  }
  if (o.top_k < 1 || o.top_k > std::min(32, o.num_experts)) {
    return invalid_argument("top-k = " + s(o.top_k) + " must be in [1, min(32, num-experts = " + s(o.num_experts) + ")]");
  }
  if (o.num_hidden_layers < 1 || o.first_k_dense_replace < 0 || o.first_k_dense_replace >= o.num_hidden_layers) {
    return invalid_argument("first_k_dense_replace = " + s(o.first_k_dense_replace) + " must be in [0, layers = " +
                            s(o.num_hidden_layers) + ")");
  }
  if (o.layers.empty()) return invalid_argument("layers must name at least one MoE layer");
  std::set<int> seen;
  for (const int l : o.layers) {
    if (l < o.first_k_dense_replace || l >= o.num_hidden_layers) {
      return invalid_argument("layer " + s(l) + " is not an MoE layer: MoE layers are [" + s(o.first_k_dense_replace) +
                              ", " + s(o.num_hidden_layers) + ")");
    }
    if (!seen.insert(l).second) return invalid_argument("layer " + s(l) + " is listed twice");
  }
  const int end = o.expert_end < 0 ? o.num_experts : o.expert_end;
  if (o.expert_begin < 0 || o.expert_begin >= end || end > o.num_experts) {
    return invalid_argument("experts [" + s(o.expert_begin) + ", " + s(end) + ") must be a non-empty range within [0, " +
                            s(o.num_experts) + ")");
  }
  if (o.activation != "situ" && o.activation != "silu" && o.activation != "swiglu") {
    return invalid_argument("activation '" + o.activation + "' is unknown (expected situ, silu or swiglu)");
  }
  if (o.shard_size < 0) return invalid_argument("shard-size = " + s(o.shard_size) + " must be >= 0 (0: one file)");
  return Status::ok();
}

Status synth_expert_tensor(const SynthOptions& o, int layer, int expert, int proj, bool scale, std::span<uint8_t> out) {
  if (proj != 1 && proj != 2 && proj != 3) return invalid_argument("proj = " + std::to_string(proj) + " must be 1, 2 or 3");
  const int64_t rows = proj == 2 ? o.expert_hidden : o.intermediate;
  const int64_t cols = proj == 2 ? o.intermediate : o.expert_hidden;  // fan-in
  const int64_t width = scale ? cols / kMxBlock : cols / 2;
  if (static_cast<int64_t>(out.size()) != rows * width) {
    return invalid_argument("synthetic tensor buffer has " + std::to_string(out.size()) + " bytes, expected " +
                            std::to_string(rows * width));
  }
  const int kind = proj * 2 + (scale ? 1 : 0);
  const auto& table = code_table();
  const int s0 = base_scale_exponent(cols);
  const bool parallel = out.size() >= (size_t{1} << 20);  // threads only for large tensors
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t r = 0; r < rows; ++r) {
    Stream s(o.seed, layer, expert, kind, r);
    uint8_t* row = out.data() + r * width;
    if (scale) {
      // [rows, cols/32] E8M0: 2^(s0 + j), j in {-1, 0, 0, +1}
      constexpr int kJitter[4] = {-1, 0, 0, 1};
      uint64_t bits = 0;
      for (int64_t b = 0; b < width; ++b) {
        if (b % 32 == 0) bits = s.next();
        row[b] = static_cast<uint8_t>(127 + s0 + kJitter[bits & 3u]);
        bits >>= 2;
      }
    } else {
      // [rows, cols/2] packed E2M1, element 2i in the low nibble
      uint64_t bits = 0;
      for (int64_t b = 0; b < width; ++b) {
        if (b % 4 == 0) bits = s.next();
        const uint8_t lo = table[bits & 0xFFu];
        const uint8_t hi = table[(bits >> 8) & 0xFFu];
        row[b] = fp4_pack(lo, hi);
        bits >>= 16;
      }
    }
  }
  return Status::ok();
}

std::string synth_config_json(const SynthOptions& o) {
  using OJ = nlohmann::ordered_json;
  OJ quant;
  quant["quant_method"] = "compressed-tensors";
  quant["format"] = "mxfp4-pack-quantized";
  quant["config_groups"] = {
      {"group_0",
       {{"targets", {"Linear"}},
        {"weights", {{"num_bits", 4}, {"type", "float"}, {"strategy", "group"}, {"group_size", 32}, {"symmetric", true}}},
        {"input_activations", nullptr}}}};
  // Everything but the routed experts stays BF16.
  quant["ignore"] = {"lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*block_sparse_moe.gate$",
                     "re:.*latent.*", "re:.*mlp\\..*"};
  OJ text;
  text["model_type"] = "kimi_linear";
  text["hidden_size"] = o.hidden_size;
  text["num_hidden_layers"] = o.num_hidden_layers;
  text["num_attention_heads"] = 96;
  text["head_dim"] = 128;
  text["intermediate_size"] = 33792;
  text["num_experts"] = o.num_experts;
  text["num_experts_per_token"] = o.top_k;
  text["moe_intermediate_size"] = o.intermediate;
  text["routed_expert_hidden_size"] = o.expert_hidden;
  text["num_shared_experts"] = 2;
  text["first_k_dense_replace"] = o.first_k_dense_replace;
  text["moe_router_activation_func"] = "sigmoid";
  text["num_expert_group"] = 1;
  text["topk_group"] = 1;
  text["moe_renormalize"] = true;
  text["routed_scaling_factor"] = 1.0;
  text["hidden_act"] = o.activation;
  if (o.activation == "situ") {
    text["activation_situ_beta"] = 4.0;
    text["activation_situ_linear_beta"] = 25.0;
  }
  text["rms_norm_eps"] = 1e-5;
  text["torch_dtype"] = "bfloat16";
  text["quantization_config"] = quant;
  OJ root;
  root["architectures"] = {"KimiK3ForConditionalGeneration"};
  root["model_type"] = "kimi_k3";
  root["text_config"] = text;
  std::vector<int> layers = o.layers;
  std::sort(layers.begin(), layers.end());
  root["k3_synthetic"] = {{"generator", "k3 checkpoint synth"},
                          {"seed", o.seed},
                          {"layers", layers},
                          {"experts", {o.expert_begin, o.expert_end < 0 ? o.num_experts : o.expert_end}},
                          {"router", o.router}};
  return root.dump(2) + "\n";
}

Result<SynthSummary> write_synthetic_checkpoint(const SynthOptions& o) {
  try {
    return write_impl(o);
  } catch (const std::exception& e) {  // std::bad_alloc, or a filesystem error without an error_code overload
    return io_error(o.output_dir + ": cannot write the synthetic checkpoint: " + e.what());
  }
}

}  // namespace k3
