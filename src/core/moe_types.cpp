#include <string>

#include "k3/moe.hpp"
#include "k3/mx.hpp"

namespace k3 {

const char* recipe_name(Recipe r) { return r == Recipe::kW4A8 ? "w4a8" : "w4a16"; }
const char* activation_name(ActivationKind a) {
  switch (a) {
    case ActivationKind::kSiTU: return "situ";
    case ActivationKind::kSwiGLU: return "swiglu";
    case ActivationKind::kSiLU: return "silu";
  }
  return "?";
}
const char* out_dtype_name(OutDType d) {
  switch (d) {
    case OutDType::kBF16: return "bf16";
    case OutDType::kFP16: return "fp16";
    case OutDType::kFP32: return "fp32";
  }
  return "?";
}
int out_dtype_size(OutDType d) { return d == OutDType::kFP32 ? 4 : 2; }

Result<Recipe> parse_recipe(const std::string& s) {
  if (s == "w4a8") return Recipe::kW4A8;
  if (s == "w4a16") return Recipe::kW4A16;
  return invalid_argument("recipe '" + s + "' is unknown (expected w4a8 or w4a16)");
}
Result<ActivationKind> parse_activation(const std::string& s) {
  if (s == "situ") return ActivationKind::kSiTU;
  if (s == "swiglu") return ActivationKind::kSwiGLU;
  if (s == "silu") return ActivationKind::kSiLU;
  return invalid_argument("activation '" + s + "' is unknown (expected situ, swiglu or silu)");
}
Result<OutDType> parse_out_dtype(const std::string& s) {
  if (s == "bf16") return OutDType::kBF16;
  if (s == "fp16") return OutDType::kFP16;
  if (s == "fp32") return OutDType::kFP32;
  return invalid_argument("output dtype '" + s + "' is unknown (expected bf16, fp16 or fp32)");
}

namespace {
std::string num(int64_t v) { return std::to_string(v); }
}  // namespace

Status validate_moe_shape(const MoeShape& s) {
  if (s.hidden <= 0 || s.hidden % kMxBlock != 0) {
    return invalid_argument("hidden (K) = " + num(s.hidden) + " must be a positive multiple of 32");
  }
  if (s.intermediate <= 0 || s.intermediate % kMxBlock != 0) {
    return invalid_argument("intermediate (N) = " + num(s.intermediate) + " must be a positive multiple of 32");
  }
  if (s.num_experts < 1 || s.num_experts > 4096) {
    return invalid_argument("num_experts = " + num(s.num_experts) + " must be in [1, 4096]");
  }
  if (s.top_k < 1 || s.top_k > 32 || s.top_k > s.num_experts) {
    return invalid_argument("top_k = " + num(s.top_k) + " must be in [1, min(32, num_experts = " +
                            num(s.num_experts) + ")]");
  }
  if (s.ep_size < 1 || s.ep_size > s.num_experts) {
    return invalid_argument("ep_size = " + num(s.ep_size) + " must be in [1, num_experts = " + num(s.num_experts) +
                            "] (every rank holds at least one expert)");
  }
  if (s.ep_rank < 0 || s.ep_rank >= s.ep_size) {
    return invalid_argument("ep_rank = " + num(s.ep_rank) + " must be in [0, ep_size = " + num(s.ep_size) + ")");
  }
  return Status::ok();
}

namespace {
Status need(const char* name, size_t have, int64_t want) {
  if (static_cast<int64_t>(have) != want) {
    return invalid_argument(std::string(name) + " has " + num(static_cast<int64_t>(have)) + " elements, expected " +
                            num(want));
  }
  return Status::ok();
}
}  // namespace

Status validate_moe_weights(const MoeProblem& p, const MoeWeightsView& w) {
  K3_RETURN_IF_ERROR(validate_moe_shape(p.shape));
  const int64_t e = p.shape.local_experts(), k = p.shape.hidden, n = p.shape.intermediate;
  K3_RETURN_IF_ERROR(need("fc1_q [E_local, 2N, K/2]", w.fc1_q.size(), e * 2 * n * k / 2));
  K3_RETURN_IF_ERROR(need("fc1_scale [E_local, 2N, K/32]", w.fc1_scale.size(), e * 2 * n * k / 32));
  K3_RETURN_IF_ERROR(need("fc2_q [E_local, K, N/2]", w.fc2_q.size(), e * k * n / 2));
  K3_RETURN_IF_ERROR(need("fc2_scale [E_local, K, N/32]", w.fc2_scale.size(), e * k * n / 32));
  if (!w.situ_beta.empty()) K3_RETURN_IF_ERROR(need("situ_beta [E_local]", w.situ_beta.size(), e));
  if (!w.situ_linear_beta.empty()) K3_RETURN_IF_ERROR(need("situ_linear_beta [E_local]", w.situ_linear_beta.size(), e));
  return Status::ok();
}

Status validate_moe_inputs(const MoeProblem& p, const MoeInputsView& in) {
  K3_RETURN_IF_ERROR(validate_moe_shape(p.shape));
  const int64_t k = p.shape.hidden;
  if (in.m < 0) return invalid_argument("m = " + num(in.m) + " must be >= 0");
  K3_RETURN_IF_ERROR(need("x [M, K]", in.x.size(), in.m * k));
  K3_RETURN_IF_ERROR(need("topk_ids [M, top_k]", in.topk_ids.size(), in.m * p.shape.top_k));
  K3_RETURN_IF_ERROR(need("topk_weights [M, top_k]", in.topk_weights.size(), in.m * p.shape.top_k));
  for (size_t i = 0; i < in.topk_ids.size(); ++i) {
    const int32_t id = in.topk_ids[i];
    if (id < -1 || id >= p.shape.num_experts) {
      return invalid_argument("topk_ids[" + num(static_cast<int64_t>(i) / p.shape.top_k) + ", " +
                              num(static_cast<int64_t>(i) % p.shape.top_k) + "] = " + num(id) +
                              " must be -1 (masked) or a global expert id in [0, " + num(p.shape.num_experts) + ")");
    }
  }
  return Status::ok();
}

Status validate_moe_buffers(const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in) {
  K3_RETURN_IF_ERROR(validate_moe_weights(p, w));
  return validate_moe_inputs(p, in);
}

}  // namespace k3
