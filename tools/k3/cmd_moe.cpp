// `k3 moe run --checkpoint PATH --layer L --input FILE --output FILE [--backend B]
//             [--ep-size S --ep-rank R] [--recipe w4a8|w4a16] [--out-dtype bf16|fp16|fp32]`
//
// Runs one checkpoint layer's routed experts on tensors a user brings, so that k3 can be compared
// with another engine. Input safetensors: `x` BF16 or F32 [M, K] (F32 is rounded to BF16, RNE,
// exactly what the fused MoE consumes) and either `logits` F32 or BF16 [M, E] (routed here with the
// checkpoint's correction bias and config.json routing facts) or `topk_ids` I32 / I64 [M, k] with
// `topk_weights` F32 [M, k] (global expert ids, -1 masked, any k in [1, 32]). Output safetensors:
// `out` [M, K] in the output dtype, and the `topk_ids` I32 / `topk_weights` F32 that were used.
// See docs/moe.md.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "command.hpp"
#include "k3/atomic_file.hpp"
#include "k3/build_info.hpp"
#include "k3/checkpoint.hpp"
#include "k3/digest.hpp"
#include "k3/expert_map.hpp"
#include "k3/formats.hpp"
#include "k3/routing.hpp"
#include "k3/safetensors.hpp"
#include "backend_options.hpp"
#include "moe_layer.hpp"
#include "paths.hpp"

namespace k3::tool {
namespace {

struct MoeRunArgs {
  std::string checkpoint, input, output;
  int layer = 1;
  int ep_size = 1, ep_rank = 0;
  std::string backend;  // "" = default (highest priority usable)
  std::string recipe = "w4a8";
  std::string out_dtype = "bf16";
};

// The routed inputs read from the user's file.
struct UserInputs {
  int64_t m = 0;
  int top_k = 0;
  std::vector<uint16_t> x;             // [M, K] BF16
  std::vector<int32_t> topk_ids;       // [M, top_k]
  std::vector<float> topk_weights;     // [M, top_k]
  bool routed_here = false;
};

Status tensor_error(const st::File& f, const st::TensorInfo& t, const std::string& what) {
  return invalid_argument(f.path() + ": tensor '" + t.name + "' (" + st::dtype_name(t.dtype) + " " +
                          st::shape_string(t.shape) + ") " + what);
}

template <typename T>
T load_le(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);  // safetensors is little-endian, as is every host k3 supports
  return v;
}

// A 2-D tensor [rows, cols] with cols == want_cols (want_cols < 0: any width in [1, 32]).
Status check_2d(const st::File& f, const st::TensorInfo& t, int64_t want_rows, int64_t want_cols, const char* cols_name) {
  if (t.shape.size() != 2) return tensor_error(f, t, "must be 2-D");
  if (want_rows >= 0 && t.shape[0] != want_rows) {
    return tensor_error(f, t, "must have M = " + std::to_string(want_rows) + " rows (the rows of x)");
  }
  if (want_cols >= 0 && t.shape[1] != want_cols) {
    return tensor_error(f, t, std::string("must have ") + cols_name + " = " + std::to_string(want_cols) + " columns");
  }
  if (want_cols < 0 && (t.shape[1] < 1 || t.shape[1] > kMaxTopK)) {
    return tensor_error(f, t, "must have between 1 and 32 columns (slots per token)");
  }
  return Status::ok();
}

// Routing facts are read from the config only when the file holds logits: with topk_ids /
// topk_weights nothing is routed, so the config's scoring_func (softmax included) does not matter.
Result<UserInputs> read_inputs(const std::string& path, const MoeLayerWeights& layer) {
  auto file = st::File::open(path);
  if (!file.is_ok()) return file.status();
  const st::File& f = file.value();
  UserInputs u;
  const st::TensorInfo* x = f.find("x");
  if (x == nullptr) return invalid_argument(path + ": no tensor 'x' (the expert input [M, K], BF16 or F32)");
  const int64_t k = layer.shape.hidden;
  if (x->shape.size() != 2 || x->shape[1] != k) {
    return tensor_error(f, *x, "must be [M, K] with K = " + std::to_string(k) + " (the checkpoint's expert width)");
  }
  u.m = x->shape[0];
  u.x.resize(u.m * k);
  const auto xb = f.bytes(*x);
  if (x->dtype == st::DType::kBF16) {
    for (int64_t i = 0; i < u.m * k; ++i) u.x[i] = load_le<uint16_t>(xb.data() + 2 * i);
  } else if (x->dtype == st::DType::kF32) {
    for (int64_t i = 0; i < u.m * k; ++i) u.x[i] = bf16_from_f32(load_le<float>(xb.data() + 4 * i));
  } else {
    return tensor_error(f, *x, "must be BF16 or F32");
  }

  const st::TensorInfo* logits = f.find("logits");
  const st::TensorInfo* ids = f.find("topk_ids");
  const st::TensorInfo* wts = f.find("topk_weights");
  if (logits != nullptr && (ids != nullptr || wts != nullptr)) {
    return invalid_argument(path + ": holds both 'logits' and 'topk_ids'/'topk_weights'; give one routing source");
  }
  if (logits != nullptr) {
    auto routing = routing_from_config(layer.config);
    if (!routing.is_ok()) {
      return Status(routing.status().code(), path + ": holds router 'logits', which k3 would have to route: " +
                                                 routing.status().message());
    }
    const RoutingConfig& rc = routing.value();
    K3_RETURN_IF_ERROR(check_2d(f, *logits, u.m, rc.num_experts, "E (num_experts)"));
    std::vector<float> lg(u.m * rc.num_experts);
    const auto lb = f.bytes(*logits);
    if (logits->dtype == st::DType::kF32) {
      for (size_t i = 0; i < lg.size(); ++i) lg[i] = load_le<float>(lb.data() + 4 * i);
    } else if (logits->dtype == st::DType::kBF16) {
      for (size_t i = 0; i < lg.size(); ++i) lg[i] = bf16_to_f32(load_le<uint16_t>(lb.data() + 2 * i));
    } else {
      return tensor_error(f, *logits, "must be F32 or BF16");
    }
    u.top_k = rc.top_k;
    u.topk_ids.resize(u.m * u.top_k);
    u.topk_weights.resize(u.m * u.top_k);
    K3_RETURN_IF_ERROR(route(rc, u.m, lg, layer.router_bias, u.topk_ids, u.topk_weights));
    u.routed_here = true;
    return u;
  }
  if (ids == nullptr || wts == nullptr) {
    return invalid_argument(path + ": needs router 'logits' [M, E] or both 'topk_ids' and 'topk_weights' [M, top_k]" +
                            std::string(ids == nullptr && wts == nullptr ? "" : (ids ? " (topk_weights missing)" : " (topk_ids missing)")));
  }
  K3_RETURN_IF_ERROR(check_2d(f, *ids, u.m, -1, "top_k"));
  u.top_k = static_cast<int>(ids->shape[1]);
  K3_RETURN_IF_ERROR(check_2d(f, *wts, u.m, u.top_k, "top_k (the columns of topk_ids)"));
  if (wts->dtype != st::DType::kF32) return tensor_error(f, *wts, "must be F32");
  u.topk_ids.resize(u.m * u.top_k);
  u.topk_weights.resize(u.m * u.top_k);
  const auto ib = f.bytes(*ids);
  const auto wb = f.bytes(*wts);
  for (int64_t i = 0; i < u.m * u.top_k; ++i) {
    int64_t id;
    if (ids->dtype == st::DType::kI32) id = load_le<int32_t>(ib.data() + 4 * i);
    else if (ids->dtype == st::DType::kI64) id = load_le<int64_t>(ib.data() + 8 * i);
    else return tensor_error(f, *ids, "must be I32 or I64");
    if (id < -1 || id >= layer.shape.num_experts) {
      return tensor_error(f, *ids, "element [" + std::to_string(i / u.top_k) + ", " + std::to_string(i % u.top_k) +
                                       "] = " + std::to_string(id) + " must be -1 (masked) or a global expert id in [0, " +
                                       std::to_string(layer.shape.num_experts) + ")");
    }
    u.topk_ids[i] = static_cast<int32_t>(id);
    u.topk_weights[i] = load_le<float>(wb.data() + 4 * i);
  }
  return u;
}

std::span<const uint8_t> as_bytes(const auto& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(v[0])};
}

int run_moe(const MoeRunArgs& a) {
  auto fail = [](const Status& st) {
    std::fprintf(stderr, "k3 moe run: %s\n", st.to_string().c_str());
    return 1;
  };
  // Paths first, before anything is loaded or written: the input must be a regular file (a FIFO
  // is refused, not waited on) and the output must not be the input or a checkpoint file.
  if (Status s = check_checkpoint_arg("--checkpoint", a.checkpoint); !s.is_ok()) return fail(s);
  if (Status s = check_input_file("--input", a.input); !s.is_ok()) return fail(s);
  if (Status s = check_output_path("--output", a.output); !s.is_ok()) return fail(s);
  if (Status s = check_output_not_input("--output", a.output, "--input", a.input); !s.is_ok()) return fail(s);
  if (Status s = check_output_not_checkpoint("--output", a.output, a.checkpoint); !s.is_ok()) return fail(s);
  auto recipe = parse_recipe(a.recipe);
  if (!recipe.is_ok()) return fail(recipe.status());
  auto dtype = parse_out_dtype(a.out_dtype);
  if (!dtype.is_ok()) return fail(dtype.status());
  const MoeBackend* backend = &default_moe_backend();
  if (!a.backend.empty()) {
    auto b = find_moe_backend(a.backend);
    if (!b.is_ok()) return fail(b.status());
    if (const Status av = b.value()->available(); !av.is_ok()) {
      return fail(unavailable("backend '" + a.backend + "' is not usable here: " + av.message()));
    }
    backend = b.value();
  }
  if (Status s = check_ep_flags(a.ep_size, a.ep_rank, a.checkpoint); !s.is_ok()) return fail(s);
  auto layer = load_moe_layer(a.checkpoint, a.layer, a.ep_size, a.ep_rank);
  if (!layer.is_ok()) return fail(layer.status());
  auto prob = problem_from_layer(layer.value(), recipe.value(), dtype.value());
  if (!prob.is_ok()) return fail(prob.status());
  auto in = read_inputs(a.input, layer.value());
  if (!in.is_ok()) return fail(in.status());
  MoeProblem p = prob.value();
  p.shape.top_k = in->top_k;  // user-supplied ids may carry any number of slots
  if (const Status st = validate_moe_shape(p.shape); !st.is_ok()) return fail(st);

  std::vector<uint8_t> out(in->m * p.shape.hidden * out_dtype_size(p.out_dtype));
  const MoeInputsView view{in->m, in->x, in->topk_ids, in->topk_weights};
  const auto t0 = std::chrono::steady_clock::now();
  if (const Status st = k3::run_moe(*backend, p, layer->view(), view, out, backend_options()); !st.is_ok()) return fail(st);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  st::Writer w;
  const st::DType out_st = p.out_dtype == OutDType::kBF16 ? st::DType::kBF16
                                                          : (p.out_dtype == OutDType::kFP16 ? st::DType::kF16 : st::DType::kF32);
  Status st = w.add("out", out_st, {in->m, p.shape.hidden}, out);
  if (st.is_ok()) st = w.add("topk_ids", st::DType::kI32, {in->m, in->top_k}, as_bytes(in->topk_ids));
  if (st.is_ok()) st = w.add("topk_weights", st::DType::kF32, {in->m, in->top_k}, as_bytes(in->topk_weights));
  if (!st.is_ok()) return fail(st);
  w.set_metadata({{"k3_version", build::kVersion},
                  {"backend", backend->name},
                  {"checkpoint", a.checkpoint},
                  {"layer", std::to_string(a.layer)},
                  {"ep_size", std::to_string(a.ep_size)},
                  {"ep_rank", std::to_string(a.ep_rank)},
                  {"recipe", recipe_name(p.recipe)},
                  {"activation", activation_name(p.activation.kind)},
                  {"routing", in->routed_here ? "logits routed by k3" : "topk_ids/topk_weights from the input"}});
  if (const Status ws = w.write(a.output, "--output"); !ws.is_ok()) return fail(ws);
  std::printf("k3 moe run: layer %d EP%d rank %d, M %lld, top-%d, %s %s -> %s, backend %s, %.3f s\n", a.layer,
              a.ep_size, a.ep_rank, static_cast<long long>(in->m), in->top_k, recipe_name(p.recipe),
              activation_name(p.activation.kind), out_dtype_name(p.out_dtype), backend->name.c_str(), secs);
  if (auto map = map_expert_parallel(p.shape, in->m, in->topk_ids); map.is_ok()) {
    std::printf("%s\n", map->to_string().c_str());
  }
  std::printf("out sha256 %s -> %s\n", sha256_hex(out).c_str(), a.output.c_str());
  return 0;
}

const CommandRegistration kRegistration("moe", 30, [](CLI::App& app) -> std::function<int()> {
  auto* cmd = app.add_subcommand("moe", "Run a checkpoint's fused-MoE layer on your own tensors");
  cmd->require_subcommand(1);
  auto* run = cmd->add_subcommand("run", "Routed experts of one layer: input x + logits or topk ids/weights -> out");
  auto a = std::make_shared<MoeRunArgs>();
  run->add_option("--checkpoint", a->checkpoint, "Checkpoint directory (config.json + safetensors)")->required();
  run->add_option("--layer", a->layer, "MoE layer")->required();
  run->add_option("--input", a->input, "safetensors with x [M, K] and logits [M, E] or topk_ids + topk_weights")
      ->required();
  run->add_option("--output", a->output, "safetensors to write: out, topk_ids, topk_weights")->required();
  run->add_option("--backend", a->backend, "Backend (default: the fastest usable one)");
  run->add_option("--ep-size", a->ep_size, "Expert-parallel ranks")->capture_default_str();
  run->add_option("--ep-rank", a->ep_rank, "This rank (its experts only; other slots contribute zero)")
      ->capture_default_str();
  run->add_option("--recipe", a->recipe, "w4a8 (MXFP8 x MXFP4) or w4a16 (BF16 x MXFP4)")->capture_default_str();
  run->add_option("--out-dtype", a->out_dtype, "bf16, fp16 or fp32")->capture_default_str();
  return [a]() { return run_moe(*a); };
});

}  // namespace
}  // namespace k3::tool
