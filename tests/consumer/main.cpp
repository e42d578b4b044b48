// The outside consumer: a small fused MoE on the CPU backend through the installed headers and
// library, checked against the library's FP64 contract oracle. Exit 0 only when it matches.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "k3/harness/moe_case.hpp"  // the harness: seeded cases
#include "k3/k3.hpp"                 // the whole user API

int main() {
  k3::MoeCaseSpec spec;
  spec.problem.shape = {64, 96, 8, 2, 1, 0};
  spec.problem.out_dtype = k3::OutDType::kFP32;
  spec.m = 4;
  spec.seed = 7;
  auto c = k3::make_moe_case(spec);
  if (!c.is_ok()) return std::printf("case: %s\n", c.status().to_string().c_str()), 1;
  k3::cpu::MoeOptions opt;
  opt.threads = 1;
  opt.max_tokens = 4;
  auto plan = k3::cpu::plan(c->problem, opt);
  if (!plan.is_ok()) return std::printf("plan: %s\n", plan.status().to_string().c_str()), 1;
  auto w = k3::cpu::prepack(plan.value(), c->weights());
  if (!w.is_ok()) return std::printf("prepack: %s\n", w.status().to_string().c_str()), 1;
  std::vector<uint8_t> ws(static_cast<size_t>(plan->workspace_bytes));
  std::vector<uint8_t> out(static_cast<size_t>(4 * 64 * 4));
  const k3::Status st = k3::cpu::run(plan.value(), w.value(), c->inputs(), ws, out);
  if (!st.is_ok()) return std::printf("run: %s\n", st.to_string().c_str()), 1;
  std::vector<double> ref(static_cast<size_t>(4 * 64));
  const k3::Status so = k3::moe_oracle(c->problem, c->weights(), c->inputs(), k3::OracleKind::kContract, ref);
  if (!so.is_ok()) return std::printf("oracle: %s\n", so.to_string().c_str()), 1;
  double err = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    float v;
    std::memcpy(&v, out.data() + 4 * i, 4);
    err += (v - ref[i]) * (v - ref[i]);
    norm += ref[i] * ref[i];
  }
  const double nrmse = std::sqrt(err / norm);
  std::printf("k3 consumer: %s; nrmse vs the FP64 oracle %.3e\n", plan->describe().c_str(), nrmse);
  return nrmse < 1e-2 ? 0 : 1;
}
