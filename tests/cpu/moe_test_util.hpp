// Shared helpers of the CPU MoE tests: the backend run and metrics (cases: core/moe_case_util.hpp).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "k3/cpu_moe.hpp"
#include "k3/formats.hpp"
#include "k3/harness/moe_compare.hpp"
#include "k3/moe_ref.hpp"
#include "core/moe_case_util.hpp"

namespace k3::test {

// Runs the CPU backend; the output as bytes of the problem's out dtype.
inline Result<std::vector<uint8_t>> run_cpu(const MoeCase& c, cpu::MoeOptions opt = {}) {
  auto plan = cpu::plan(c.p, opt);
  if (!plan.is_ok()) return plan.status();
  auto packed = cpu::prepack(plan.value(), c.wv());
  if (!packed.is_ok()) return packed.status();
  std::vector<uint8_t> ws(static_cast<size_t>(plan->workspace_bytes));
  std::vector<uint8_t> out(static_cast<size_t>(c.m * c.p.shape.hidden * out_dtype_size(c.p.out_dtype)), 0xAB);
  const Status st = cpu::run(plan.value(), packed.value(), c.iv(), ws, out);
  if (!st.is_ok()) return st;
  return out;
}

inline std::vector<double> decode_output(const std::vector<uint8_t>& bytes, OutDType d) {
  const size_t es = static_cast<size_t>(out_dtype_size(d));
  std::vector<double> v(bytes.size() / es);
  for (size_t i = 0; i < v.size(); ++i) {
    if (d == OutDType::kFP32) {
      float f;
      std::memcpy(&f, &bytes[i * 4], 4);
      v[i] = f;
    } else {
      uint16_t h;
      std::memcpy(&h, &bytes[i * 2], 2);
      v[i] = d == OutDType::kBF16 ? bf16_to_f32(h) : fp16_to_f32(h);
    }
  }
  return v;
}

inline std::vector<double> contract_oracle(const MoeCase& c, OracleKind kind = OracleKind::kContract) {
  std::vector<double> out(static_cast<size_t>(c.m * c.p.shape.hidden), 0.0);
  const Status st = moe_oracle(c.p, c.wv(), c.iv(), kind, out);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return out;
}

// Metrics of FP32 values (held as doubles) against an FP64 reference: the library's comparison
// (k3/harness/moe_compare.hpp), so that the unit tests and `k3 validate` measure alike.
inline MoeMetrics diff(const std::vector<double>& got, const std::vector<double>& ref) {
  std::vector<uint8_t> bytes(got.size() * 4);
  for (size_t i = 0; i < got.size(); ++i) {
    const float f = static_cast<float>(got[i]);
    std::memcpy(&bytes[i * 4], &f, 4);
  }
  auto m = compare_moe_output(bytes, OutDType::kFP32, ref, {});
  EXPECT_TRUE(m.is_ok()) << m.status().to_string();
  return m.is_ok() ? m.value() : MoeMetrics{};
}

}  // namespace k3::test
