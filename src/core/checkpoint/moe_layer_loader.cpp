// One MoE layer's routed experts for one EP rank (k3/checkpoint.hpp): checks every tensor the
// rank needs before copying anything, then copies w1 / w3 into FC1 = [gate; up] and w2 into FC2.
#include <algorithm>
#include <cstring>
#include <exception>
#include <map>
#include <set>

#include "k3/checkpoint.hpp"
#include "k3/formats.hpp"
#include "k3/safetensors.hpp"

namespace k3 {

namespace {

constexpr const char* kPrefixes[] = {"language_model.", ""};
constexpr int kMaxListedErrors = 4;

std::string layer_prefix(const std::string& prefix, int layer) {
  return prefix + "model.layers." + std::to_string(layer) + ".block_sparse_moe.";
}

// Expert ids of `layer` present in the checkpoint (any of their six tensors), from the tensor names.
std::vector<int> experts_present(const st::Checkpoint& ckpt, const std::string& prefix, int layer) {
  std::set<int> ids;
  for (const auto& name : ckpt.tensor_names()) {
    const auto t = parse_kimi_moe_tensor_name(name);
    if (t && t->kind == KimiMoeTensor::Kind::kExpert && t->layer == layer && t->prefix == prefix) ids.insert(t->expert);
  }
  return {ids.begin(), ids.end()};
}

// Reads a decimal number below 2^24 at s[*i], advancing *i; false when there is none or it is too large.
bool read_index(std::string_view s, size_t* i, int* out) {
  const size_t start = *i;
  int v = 0;
  while (*i < s.size() && s[*i] >= '0' && s[*i] <= '9') {
    v = v * 10 + (s[*i] - '0');
    if (v >= (1 << 24)) return false;
    ++*i;
  }
  *out = v;
  return *i > start;
}

// One expert tensor the rank needs, its expected shape and where it goes.
struct Need {
  std::string name;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;  // filled after the checks
};

void check_tensor(const st::File& f, const st::TensorInfo& t, st::DType want_dtype,
                    const std::vector<int64_t>& want_shape, const std::string& role, std::vector<std::string>* errors) {
  if (t.dtype != want_dtype || t.shape != want_shape) {
    errors->push_back("tensor '" + t.name + "' in " + f.path() + " is " + st::dtype_name(t.dtype) + " " +
                      st::shape_string(t.shape) + ", expected " + st::dtype_name(want_dtype) + " " +
                      st::shape_string(want_shape) + " (" + role + ")");
  }
}

std::string join_errors(const std::vector<std::string>& errors) {
  std::string msg;
  for (size_t i = 0; i < errors.size() && i < kMaxListedErrors; ++i) msg += (i ? "; " : "") + errors[i];
  if (errors.size() > kMaxListedErrors) {
    msg += "; ... (" + std::to_string(errors.size() - kMaxListedErrors) + " more tensors with the wrong dtype/shape)";
  }
  return msg;
}

Result<MoeLayerWeights> load_impl(const MoeModelConfig& c, const std::string& checkpoint_dir, int layer, int ep_size,
                                   int ep_rank) {
  auto shape = moe_shape_from_config(c, ep_size, ep_rank);
  if (!shape) return shape.status();
  const MoeShape s = shape.value();
  if (layer < 0 || layer >= c.num_hidden_layers) {
    return invalid_argument("layer = " + std::to_string(layer) + " must be in [0, num_hidden_layers = " +
                            std::to_string(c.num_hidden_layers) + ") of " + c.source);
  }
  if (layer < c.first_k_dense_replace) {
    return invalid_argument("layer " + std::to_string(layer) + " is a dense MLP layer (first_k_dense_replace = " +
                            std::to_string(c.first_k_dense_replace) + " in " + c.source + "), not an MoE layer");
  }
  if (!c.quant_format.empty() && c.quant_format != "mxfp4-pack-quantized") {
    return unsupported(c.source + ": quantization format '" + c.quant_format +
                       "' is not supported (routed experts must be mxfp4-pack-quantized)");
  }
  if (c.quant_group_size != 0 && c.quant_group_size != 32) {
    return unsupported(c.source + ": quantization group size " + std::to_string(c.quant_group_size) +
                       " is not supported (MXFP4 uses groups of 32)");
  }

  auto opened = st::Checkpoint::open(checkpoint_dir);
  if (!opened) return opened.status();
  const st::Checkpoint& ckpt = opened.value();

  const int e_local = s.local_experts(), e0 = s.first_local_expert();
  const int64_t k = s.hidden, n = s.intermediate;
  // Which naming does this checkpoint use? The first prefix holding any tensor of this layer.
  std::string prefix = kPrefixes[0];
  for (const char* p : kPrefixes) {
    if (ckpt.contains(kimi_expert_tensor_name(layer, e0, 1, false, p)) || ckpt.contains(kimi_router_weight_name(layer, p))) {
      prefix = p;
      break;
    }
  }

  // Every tensor the rank needs: per local expert w1 / w3 ([N, K]) and w2 ([K, N]), packed + scale.
  struct ProjSpec {
    int proj;
    int64_t rows, cols;
    const char* role;
  };
  const ProjSpec projs[] = {{1, n, k, "w1 = gate [N, K]"}, {3, n, k, "w3 = up [N, K]"}, {2, k, n, "w2 = down [K, N]"}};
  std::vector<int> missing;
  std::string first_missing;
  for (int e = e0; e < e0 + e_local; ++e) {
    for (const auto& p : projs) {
      for (const bool scale : {false, true}) {
        const std::string name = kimi_expert_tensor_name(layer, e, p.proj, scale, prefix);
        if (!ckpt.contains(name)) {
          if (missing.empty() || missing.back() != e) missing.push_back(e);
          if (first_missing.empty()) first_missing = name;
        }
      }
    }
  }
  if (!missing.empty()) {
    const auto held = experts_present(ckpt, prefix, layer);
    return invalid_argument(
        "checkpoint " + checkpoint_dir + " lacks " + std::to_string(missing.size()) + " of the " +
        std::to_string(e_local) + " experts that layer " + std::to_string(layer) + " needs on EP rank " +
        std::to_string(ep_rank) + " of " + std::to_string(ep_size) + " (global experts [" + std::to_string(e0) +
        ", " + std::to_string(e0 + e_local) + ")): experts " + format_id_ranges(missing) + "; first missing tensor '" +
        first_missing + "'; the checkpoint holds " +
        (held.empty() ? std::string("no experts of this layer") : "experts " + format_id_ranges(held)) +
        (c.synthetic ? " (a synthetic checkpoint: write them with `k3 checkpoint synth --layers " + std::to_string(layer) +
                           " --ep-size " + std::to_string(ep_size) + " --ep-rank " + std::to_string(ep_rank) + "`)"
                     : std::string()));
  }

  // Check dtype and shape of every tensor before copying; collect all problems.
  std::vector<std::string> errors;
  // views[e_local][proj 0..2][packed, scale]
  std::vector<std::span<const uint8_t>> views(static_cast<size_t>(e_local) * 6);
  for (int e = 0; e < e_local; ++e) {
    for (int pi = 0; pi < 3; ++pi) {
      const auto& p = projs[pi];
      for (int si = 0; si < 2; ++si) {
        const std::string name = kimi_expert_tensor_name(layer, e0 + e, p.proj, si == 1, prefix);
        auto hit = ckpt.find(name);
        if (!hit) return hit.status();
        const std::vector<int64_t> want = {p.rows, si == 0 ? p.cols / 2 : p.cols / 32};
        check_tensor(*hit->first, *hit->second, st::DType::kU8, want,
                                        std::string(p.role) + (si == 0 ? " MXFP4 codes packed two per byte"
                                                                       : " E8M0 scales, one per 32 columns") +
                                            ", K = " + std::to_string(k) + ", N = " + std::to_string(n),
                                        &errors);
        views[static_cast<size_t>(e) * 6 + static_cast<size_t>(pi) * 2 + static_cast<size_t>(si)] =
            hit->first->bytes(*hit->second);
      }
    }
  }

  MoeLayerWeights w;
  w.shape = s;
  w.config = c;
  w.layer = layer;
  // Router (optional): gate.weight BF16 [E, hidden_size]; e_score_correction_bias [E] BF16 or F32.
  const st::File* router_file = nullptr;
  const st::TensorInfo* router_t = nullptr;
  if (ckpt.contains(kimi_router_weight_name(layer, prefix))) {
    auto hit = ckpt.find(kimi_router_weight_name(layer, prefix));
    if (!hit) return hit.status();
    router_file = hit->first;
    router_t = hit->second;
    check_tensor(*router_file, *router_t, st::DType::kBF16, {s.num_experts, c.hidden_size},
                                    "router gate.weight [E, hidden_size]", &errors);
  }
  const st::File* bias_file = nullptr;
  const st::TensorInfo* bias_t = nullptr;
  if (ckpt.contains(kimi_router_bias_name(layer, prefix))) {
    auto hit = ckpt.find(kimi_router_bias_name(layer, prefix));
    if (!hit) return hit.status();
    bias_file = hit->first;
    bias_t = hit->second;
    const st::DType dt = bias_t->dtype == st::DType::kF32 ? st::DType::kF32 : st::DType::kBF16;
    check_tensor(*bias_file, *bias_t, dt, {s.num_experts},
                                    "router e_score_correction_bias [E], BF16 or F32", &errors);
  }
  if (!errors.empty()) return invalid_argument(join_errors(errors));

  // Copy. FC1 of expert e: rows [0, N) = w1 (gate), rows [N, 2N) = w3 (up).
  const size_t fc1_q_e = static_cast<size_t>(2 * n * k / 2), fc1_s_e = static_cast<size_t>(2 * n * k / 32);
  const size_t fc2_q_e = static_cast<size_t>(k * n / 2), fc2_s_e = static_cast<size_t>(k * n / 32);
  w.fc1_q.resize(static_cast<size_t>(e_local) * fc1_q_e);      // [E_local, 2N, K/2]
  w.fc1_scale.resize(static_cast<size_t>(e_local) * fc1_s_e);  // [E_local, 2N, K/32]
  w.fc2_q.resize(static_cast<size_t>(e_local) * fc2_q_e);      // [E_local, K, N/2]
  w.fc2_scale.resize(static_cast<size_t>(e_local) * fc2_s_e);  // [E_local, K, N/32]
  // Experts are independent; pages of the mapping fault in parallel (for large layers only).
  const bool parallel = w.fc1_q.size() >= (size_t{1} << 22);
#pragma omp parallel for schedule(static) if (parallel)
  for (int e = 0; e < e_local; ++e) {
    const auto v = [&](int pi, int si) { return views[static_cast<size_t>(e) * 6 + static_cast<size_t>(pi) * 2 + static_cast<size_t>(si)]; };
    uint8_t* q1 = w.fc1_q.data() + static_cast<size_t>(e) * fc1_q_e;
    uint8_t* s1 = w.fc1_scale.data() + static_cast<size_t>(e) * fc1_s_e;
    std::memcpy(q1, v(0, 0).data(), fc1_q_e / 2);                 // gate codes
    std::memcpy(q1 + fc1_q_e / 2, v(1, 0).data(), fc1_q_e / 2);   // up codes
    std::memcpy(s1, v(0, 1).data(), fc1_s_e / 2);                 // gate scales
    std::memcpy(s1 + fc1_s_e / 2, v(1, 1).data(), fc1_s_e / 2);   // up scales
    std::memcpy(w.fc2_q.data() + static_cast<size_t>(e) * fc2_q_e, v(2, 0).data(), fc2_q_e);
    std::memcpy(w.fc2_scale.data() + static_cast<size_t>(e) * fc2_s_e, v(2, 1).data(), fc2_s_e);
  }
  if (router_t != nullptr) {
    const auto b = router_file->bytes(*router_t);
    w.router_weight.resize(b.size() / 2);  // [E, hidden_size] BF16, little-endian in the file
    for (size_t i = 0; i < w.router_weight.size(); ++i) {
      w.router_weight[i] = static_cast<uint16_t>(b[2 * i] | (b[2 * i + 1] << 8));
    }
  }
  if (bias_t != nullptr) {
    const auto b = bias_file->bytes(*bias_t);
    w.router_bias.resize(static_cast<size_t>(s.num_experts));  // [E] FP32
    for (size_t i = 0; i < w.router_bias.size(); ++i) {
      if (bias_t->dtype == st::DType::kF32) {
        const uint32_t u = static_cast<uint32_t>(b[4 * i]) | (static_cast<uint32_t>(b[4 * i + 1]) << 8) |
                           (static_cast<uint32_t>(b[4 * i + 2]) << 16) | (static_cast<uint32_t>(b[4 * i + 3]) << 24);
        w.router_bias[i] = bits_to_f32(u);
      } else {
        w.router_bias[i] = bf16_to_f32(static_cast<uint16_t>(b[2 * i] | (b[2 * i + 1] << 8)));
      }
    }
  }
  return w;
}

}  // namespace

std::string kimi_expert_tensor_name(int layer, int expert, int proj, bool scale, const std::string& prefix) {
  return layer_prefix(prefix, layer) + "experts." + std::to_string(expert) + ".w" + std::to_string(proj) +
         (scale ? ".weight_scale" : ".weight_packed");
}
std::optional<KimiMoeTensor> parse_kimi_moe_tensor_name(std::string_view name) {
  static constexpr std::string_view kLayers = "model.layers.", kMoe = ".block_sparse_moe.";
  const size_t at = name.find(kLayers);
  if (at == std::string_view::npos) return std::nullopt;
  KimiMoeTensor t;
  t.prefix = std::string(name.substr(0, at));
  size_t i = at + kLayers.size();
  if (!read_index(name, &i, &t.layer) || name.substr(i, kMoe.size()) != kMoe) return std::nullopt;
  const std::string_view rest = name.substr(i + kMoe.size());
  if (rest == "gate.weight") {
    t.kind = KimiMoeTensor::Kind::kRouterWeight;
    return t;
  }
  if (rest == "gate.e_score_correction_bias") {
    t.kind = KimiMoeTensor::Kind::kRouterBias;
    return t;
  }
  static constexpr std::string_view kExperts = "experts.";
  if (rest.substr(0, kExperts.size()) != kExperts) return std::nullopt;
  size_t j = kExperts.size();
  if (!read_index(rest, &j, &t.expert)) return std::nullopt;
  const std::string_view tail = rest.substr(j);
  if (tail.size() < 4 || tail.substr(0, 2) != ".w" || tail[2] < '1' || tail[2] > '3') return std::nullopt;
  t.proj = tail[2] - '0';
  const std::string_view kind = tail.substr(3);
  if (kind == ".weight_packed") {
    t.scale = false;
  } else if (kind == ".weight_scale") {
    t.scale = true;
  } else {
    return std::nullopt;
  }
  t.kind = KimiMoeTensor::Kind::kExpert;
  return t;
}

std::string kimi_router_weight_name(int layer, const std::string& prefix) {
  return layer_prefix(prefix, layer) + "gate.weight";
}
std::string kimi_router_bias_name(int layer, const std::string& prefix) {
  return layer_prefix(prefix, layer) + "gate.e_score_correction_bias";
}

std::string format_id_ranges(const std::vector<int>& ids, int max_ranges) {
  std::string out;
  int ranges = 0;
  size_t i = 0;
  while (i < ids.size()) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (ranges == max_ranges) {
      out += ", ... (" + std::to_string(ids.size() - i) + " more)";
      break;
    }
    if (!out.empty()) out += ", ";
    out += std::to_string(ids[i]);
    if (j > i) {
      out += '-';
      out += std::to_string(ids[j]);
    }
    ++ranges;
    i = j + 1;
  }
  return out;
}

MoeWeightsView MoeLayerWeights::view() const {
  MoeWeightsView v;
  v.fc1_q = fc1_q;
  v.fc1_scale = fc1_scale;
  v.fc2_q = fc2_q;
  v.fc2_scale = fc2_scale;
  return v;
}

Result<MoeLayerWeights> load_moe_layer(const std::string& checkpoint_dir, int layer, int ep_size, int ep_rank) {
  auto cfg = load_model_config(checkpoint_dir);
  if (!cfg) return cfg.status();
  return load_moe_layer(cfg.value(), checkpoint_dir, layer, ep_size, ep_rank);
}

Result<MoeLayerWeights> load_moe_layer(const MoeModelConfig& config, const std::string& checkpoint_dir, int layer,
                                       int ep_size, int ep_rank) {
  try {
    return load_impl(config, checkpoint_dir, layer, ep_size, ep_rank);
  } catch (const std::exception& e) {  // std::bad_alloc for a rank too large for this machine
    return io_error(checkpoint_dir + ": cannot load layer " + std::to_string(layer) + ": " + e.what());
  }
}

}  // namespace k3
