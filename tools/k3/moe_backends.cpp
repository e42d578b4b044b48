// The fused-MoE backend registry and the "reference" backend: the FP64 contract oracle rounded
// once to the output dtype. It is the slowest backend and the definition of the others.
#include "moe_backends.hpp"

#include <algorithm>
#include <new>
#include <vector>

#include "k3/moe_ref.hpp"

namespace k3::tool {

std::vector<MoeBackendAdapter>& moe_backend_registry() {
  static std::vector<MoeBackendAdapter> registry;
  return registry;
}

MoeBackendRegistration::MoeBackendRegistration(MoeBackendAdapter a) {
  auto& r = moe_backend_registry();
  r.push_back(std::move(a));
  // Highest priority first; equal priorities by name, so listings never depend on link order.
  std::sort(r.begin(), r.end(), [](const MoeBackendAdapter& x, const MoeBackendAdapter& y) {
    return x.priority != y.priority ? x.priority > y.priority : x.name < y.name;
  });
}

Result<const MoeBackendAdapter*> find_moe_backend(const std::string& name) {
  std::string known;
  for (const auto& b : moe_backend_registry()) {
    if (b.name == name) return &b;
    known += (known.empty() ? "" : ", ") + b.name;
  }
  return invalid_argument("backend '" + name + "' is not known (known: " + known + ")");
}

const MoeBackendAdapter& default_moe_backend() {
  for (const auto& b : moe_backend_registry()) {
    if (b.available().is_ok()) return b;
  }
  return *find_moe_backend("reference").value();  // registered below, always available
}

Status run_moe_backend(const MoeBackendAdapter& b, const MoeProblem& p, const MoeWeightsView& w,
                       const MoeInputsView& in, std::span<uint8_t> out) {
  K3_RETURN_IF_ERROR(validate_moe_buffers(p, w, in));
  const int64_t want = in.m * p.shape.hidden * out_dtype_size(p.out_dtype);
  if (static_cast<int64_t>(out.size()) != want) {
    return invalid_argument("out has " + std::to_string(out.size()) + " bytes, expected M*K*" +
                            std::to_string(out_dtype_size(p.out_dtype)) + " = " + std::to_string(want));
  }
  if (b.supports) K3_RETURN_IF_ERROR(b.supports(p));
  return b.run(p, w, in, out);
}

namespace {

Status run_reference(const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in, std::span<uint8_t> out) {
  std::vector<double> acc;
  try {
    acc.resize(in.m * p.shape.hidden);
  } catch (const std::bad_alloc&) {
    return unavailable("reference backend: out of memory for M*K = " + std::to_string(in.m * p.shape.hidden) +
                       " FP64 values");
  }
  K3_RETURN_IF_ERROR(moe_oracle(p, w, in, OracleKind::kContract, acc));
  round_output(acc, p.out_dtype, out);
  return Status::ok();
}

const MoeBackendRegistration kReference({"reference", 0, [] { return Status::ok(); }, run_reference});

}  // namespace
}  // namespace k3::tool
