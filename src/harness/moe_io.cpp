// The routed inputs of a fused-MoE call from a safetensors file (k3/harness/moe_io.hpp).
#include "k3/harness/moe_io.hpp"

#include <cstring>
#include <map>
#include <string>

#include "k3/build_info.hpp"
#include "k3/formats.hpp"
#include "k3/routing.hpp"
#include "k3/safetensors.hpp"

namespace k3 {
namespace {

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

}  // namespace

Result<MoeInputFile> load_moe_inputs(const std::string& path, const MoeLayerWeights& layer) {
  auto file = st::File::open(path);
  if (!file.is_ok()) return file.status();
  const st::File& f = file.value();
  MoeInputFile u;
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


Status write_moe_output(const std::string& path, const std::string& label, const MoeProblem& p,
                        const MoeInputFile& in, std::span<const uint8_t> out, const MoeRunRecord& rec) {
  const int64_t want = in.m * p.shape.hidden * out_dtype_size(p.out_dtype);
  if (in.m < 0 || static_cast<int64_t>(out.size()) != want) {
    return invalid_argument("write_moe_output: out has " + std::to_string(out.size()) + " bytes, expected M = " +
                            std::to_string(in.m) + " x K = " + std::to_string(p.shape.hidden) + " x " +
                            std::to_string(out_dtype_size(p.out_dtype)) + " bytes (" + out_dtype_name(p.out_dtype) + ")");
  }
  const int64_t slots = in.m * in.top_k;
  if (static_cast<int64_t>(in.topk_ids.size()) != slots || static_cast<int64_t>(in.topk_weights.size()) != slots) {
    return invalid_argument("write_moe_output: topk_ids / topk_weights have " + std::to_string(in.topk_ids.size()) +
                            " / " + std::to_string(in.topk_weights.size()) + " entries, expected M x top_k = " +
                            std::to_string(slots));
  }
  const st::DType dt = p.out_dtype == OutDType::kBF16   ? st::DType::kBF16
                       : p.out_dtype == OutDType::kFP16 ? st::DType::kF16
                                                        : st::DType::kF32;
  st::Writer w;
  K3_RETURN_IF_ERROR(w.add("out", dt, {in.m, p.shape.hidden}, out));
  K3_RETURN_IF_ERROR(w.add("topk_ids", st::DType::kI32, {in.m, in.top_k},
                           {reinterpret_cast<const uint8_t*>(in.topk_ids.data()), in.topk_ids.size() * 4}));
  K3_RETURN_IF_ERROR(w.add("topk_weights", st::DType::kF32, {in.m, in.top_k},
                           {reinterpret_cast<const uint8_t*>(in.topk_weights.data()), in.topk_weights.size() * 4}));
  std::map<std::string, std::string> meta = {
      {"k3_version", build::kVersion},
      {"backend", rec.backend},
      {"checkpoint", rec.checkpoint},
      {"layer", std::to_string(rec.layer)},
      {"ep_size", std::to_string(rec.ep_size)},
      {"recipe", recipe_name(p.recipe)},
      {"activation", activation_name(p.activation.kind)},
      {"routing", in.routed_here ? "logits routed by k3" : "topk_ids/topk_weights from the input"}};
  if (rec.ep_rank >= 0) meta["ep_rank"] = std::to_string(rec.ep_rank);
  w.set_metadata(std::move(meta));
  return w.write(path, label);
}

}  // namespace k3
