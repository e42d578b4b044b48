// The output comparison and tolerances of k3/harness/moe_compare.hpp on hand-made outputs.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "k3/formats.hpp"
#include "k3/harness/moe_compare.hpp"
#include "k3/moe_ref.hpp"

namespace k3 {
namespace {

std::vector<uint8_t> rounded(const std::vector<double>& v, OutDType d) {
  std::vector<uint8_t> b(v.size() * out_dtype_size(d));
  round_output(v, d, b);
  return b;
}

TEST(MoeCompare, RoundedOracleIsExactAndPasses) {
  std::vector<double> ref;
  for (int i = 0; i < 300; ++i) ref.push_back(std::sin(i * 0.37) * 3.0);
  for (OutDType d : {OutDType::kBF16, OutDType::kFP16, OutDType::kFP32}) {
    const MoeMetrics m = compare_moe_output(rounded(ref, d), d, ref, {}).value();
    EXPECT_EQ(m.exact, 300);
    EXPECT_EQ(m.total, 300);
    EXPECT_GT(m.cosine, 0.99999);
    EXPECT_LT(m.nrmse, d == OutDType::kBF16 ? 3e-3 : 3e-4);
    std::string why;
    EXPECT_TRUE(within(m, contract_tolerance(d), &why)) << why;
    EXPECT_EQ(m.summary(), "exact 100.0%, nonfinite 0");
  }
}

TEST(MoeCompare, EachBoundCatchesItsViolation) {
  std::vector<double> ref;
  for (int i = 0; i < 256; ++i) ref.push_back(1.0 + (i % 7));
  // A 3 % error everywhere (a missing rounding point): NRMSE.
  std::vector<double> off = ref;
  for (double& v : off) v *= 1.03;
  std::string why;
  EXPECT_FALSE(within(compare_moe_output(rounded(off, OutDType::kFP32), OutDType::kFP32, ref, {}).value(),
                      contract_tolerance(OutDType::kFP32), &why));
  EXPECT_NE(why.find("contract-fp32: nrmse"), std::string::npos) << why;
  // One element off by 0.5 (max|ref| = 7): max abs, while NRMSE stays small.
  off = ref;
  off[10] += 0.5;
  std::vector<double> big(ref.size() * 40);
  for (size_t i = 0; i < big.size(); ++i) big[i] = ref[i % ref.size()];
  std::vector<double> big_off = big;
  big_off[10] += 0.5;
  const MoeMetrics m = compare_moe_output(rounded(big_off, OutDType::kFP32), OutDType::kFP32, big, {}).value();
  EXPECT_LT(m.nrmse, 2e-3);
  EXPECT_FALSE(within(m, contract_tolerance(OutDType::kFP32), &why));
  EXPECT_NE(why.find("max abs"), std::string::npos) << why;
  // NaN where the oracle is finite: class mismatch.
  off = ref;
  off[3] = NAN;
  const MoeMetrics n = compare_moe_output(rounded(off, OutDType::kBF16), OutDType::kBF16, ref, {}).value();
  EXPECT_EQ(n.nonfinite, 1);
  EXPECT_EQ(n.nonfinite_mismatch, 1);
  EXPECT_FALSE(within(n, contract_tolerance(OutDType::kBF16), &why));
  EXPECT_NE(why.find("NaN/Inf class"), std::string::npos) << why;
  // Matching NaN / Inf classes are fine and excluded from the metrics.
  std::vector<double> ref2 = ref;
  ref2[3] = NAN;
  ref2[4] = -INFINITY;
  const MoeMetrics ok = compare_moe_output(rounded(ref2, OutDType::kBF16), OutDType::kBF16, ref2, {}).value();
  EXPECT_EQ(ok.nonfinite_mismatch, 0);
  EXPECT_TRUE(within(ok, contract_tolerance(OutDType::kBF16), &why)) << why;
}

TEST(MoeCompare, ZeroRowsMustBePositiveZeroBitForBit) {
  const std::vector<double> ref = {0.0, 0.0, 1.0, 2.0};  // 2 rows of K = 2; row 0 has no local slot
  std::vector<uint8_t> out = rounded(ref, OutDType::kBF16);
  const std::vector<bool> zero_rows = {true, false};
  EXPECT_EQ(compare_moe_output(out, OutDType::kBF16, ref, zero_rows).value().zero_row_violations, 0);
  out[1] = 0x80;  // -0.0: numerically equal, but not what the contract writes
  const MoeMetrics m = compare_moe_output(out, OutDType::kBF16, ref, zero_rows).value();
  EXPECT_EQ(m.zero_row_violations, 1);
  std::string why;
  EXPECT_FALSE(within(m, contract_tolerance(OutDType::kBF16), &why));
  EXPECT_NE(why.find("not +0.0"), std::string::npos) << why;
}

// Rows the oracle marked beyond FP32 range are not compared: a NaN where the oracle is finite
// fails in an unmarked row and is skipped, and counted, in a marked one.
TEST(MoeCompare, RowsBeyondFp32RangeAreSkippedAndCounted) {
  const std::vector<double> ref = {1.0, 2.0, 3.0, 4.0};  // 2 rows of K = 2
  std::vector<uint8_t> out = rounded(ref, OutDType::kBF16);
  out[4] = 0xC0, out[5] = 0x7F;  // row 1, element 0: NaN (0x7FC0)
  const MoeMetrics plain = compare_moe_output(out, OutDType::kBF16, ref, {}).value();
  EXPECT_EQ(plain.nonfinite_mismatch, 1);
  std::string why;
  EXPECT_FALSE(within(plain, contract_tolerance(OutDType::kBF16), &why));
  const MoeMetrics marked = compare_moe_output(out, OutDType::kBF16, ref, {}, {false, true}).value();
  EXPECT_EQ(marked.nonfinite_mismatch, 0);
  EXPECT_EQ(marked.rows_beyond_fp32, 1);
  EXPECT_EQ(marked.total, 2);
  EXPECT_EQ(marked.exact, 2);
  EXPECT_TRUE(within(marked, contract_tolerance(OutDType::kBF16), &why)) << why;
  EXPECT_NE(marked.summary().find("1 row beyond FP32 range not compared"), std::string::npos) << marked.summary();
  // The mark does not hide a mismatch in another row.
  EXPECT_EQ(compare_moe_output(out, OutDType::kBF16, ref, {}, {true, false}).value().nonfinite_mismatch, 1);
  EXPECT_NE(compare_moe_output(out, OutDType::kBF16, ref, {}, std::vector<bool>(3))
                .status()
                .message()
                .find("do not split into 3 rows (rows_beyond_fp32)"),
            std::string::npos);
}

TEST(MoeCompare, SizeErrors) {
  const std::vector<double> ref(6, 1.0);
  const std::vector<uint8_t> out(11);
  EXPECT_NE(compare_moe_output(out, OutDType::kBF16, ref, {}).status().message().find("out has 11 bytes, expected 6"),
            std::string::npos);
  EXPECT_NE(compare_moe_output(std::vector<uint8_t>(12), OutDType::kBF16, ref, std::vector<bool>(4))
                .status()
                .message()
                .find("6 values do not split into 4 rows"),
            std::string::npos);
}

TEST(MoeCompare, RowsWithoutLocalSlot) {
  MoeShape sh{64, 32, 6, 2, 2, 1};  // rank 1: experts 3..5
  const std::vector<int32_t> ids = {0, 1, 3, -1, -1, -1, 2, 5};
  const std::vector<uint16_t> x(4 * 64);
  const std::vector<float> w(8);
  EXPECT_EQ(rows_without_local_slot(sh, {4, x, ids, w}), (std::vector<bool>{true, false, true, false}));
}

TEST(MoeCompare, SeedTolerancesAreLooserThanTheContract) {
  for (Recipe r : {Recipe::kW4A8, Recipe::kW4A16}) {
    EXPECT_GT(seed_tolerance(r).max_nrmse, contract_tolerance(OutDType::kBF16).max_nrmse);
  }
  // The seed figures (cosine 0.99962, NRMSE 2.75 %) pass the W4A8 bound.
  MoeMetrics m;
  m.cosine = 0.99962;
  m.nrmse = 0.0275;
  m.max_abs = 0.1;
  m.ref_max = 1.0;
  EXPECT_TRUE(within(m, seed_tolerance(Recipe::kW4A8), nullptr));
}

}  // namespace
}  // namespace k3
