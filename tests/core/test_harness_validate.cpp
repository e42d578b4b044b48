// The correctness matrix as a library (k3/harness/validate.hpp): what `k3 validate` and
// k3.validate both call.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "k3/harness/validate.hpp"

namespace k3::harness {
namespace {

TEST(HarnessValidate, RefusesAnUnknownOpOrSuiteNamingTheKnownOnes) {
  ValidateOptions o;
  o.suite = "smoke";
  auto r = run_validation("nope", o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("--op nope is not known (known: formats kda linear moe, all)"), std::string::npos)
      << r.status().message();
  o.suite = "fast";
  r = run_validation("formats", o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("--suite 'fast' is an unknown suite"), std::string::npos);
}

TEST(HarnessValidate, OpsAreListedInRunOrderAndTheJsonHoldsEveryRow) {
  std::vector<std::string> names;
  for (const auto& op : validate_ops()) names.emplace_back(op.name);
  EXPECT_EQ(names, (std::vector<std::string>{"formats", "kda", "linear", "moe"}));
  ValidateOptions o;
  o.suite = "smoke";
  auto r = run_validation("formats", o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_FALSE(r->empty());
  const auto n = count_rows(r.value());
  EXPECT_EQ(n.checks, r->size());
  EXPECT_EQ(n.failed, 0u);
  const auto j = nlohmann::json::parse(validation_json(r.value(), o));
  ASSERT_EQ(j["records"].size(), r->size());
  EXPECT_EQ(j["suite"], "smoke");
  EXPECT_EQ(j["seed"], o.seed);
  EXPECT_EQ(j["records"][0]["case"], r->front().case_name);
  EXPECT_EQ(j["records"][0]["digest"], r->front().digest);
}

TEST(HarnessValidate, ProgressSeesEveryMoeCheckBeforeItRuns) {
  ValidateOptions o;
  o.suite = "smoke";
  o.backend = "cpu";
  o.recipe = "w4a16";
  o.activation = "silu";
  std::vector<std::string> seen;
  o.progress = [&](const std::string& what) { seen.push_back(what); };
  auto r = run_validation("moe", o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(count_rows(r.value()).failed, 0u);
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.front(), "moe: smoke m1 uniform w4a16 silu");
}

TEST(HarnessValidate, ABadBackendOptionIsOneFailNamedByTheExplainHook) {
  ValidateOptions o;
  o.suite = "smoke";
  o.backend = "cpu";
  o.recipe = "w4a16";
  o.activation = "silu";
  o.backend_options.threads = 100000;  // refused by the cpu backend
  o.explain = [](Status st, const BackendOptions& bo) {
    return st.is_ok() ? st : Status(st.code(), "[explained threads " + std::to_string(bo.threads) + "] " + st.message());
  };
  auto r = run_validation("moe", o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(r->size(), 1u);  // not a SKIP per case: one FAIL for the options
  const ValidateRow& row = r->front();
  EXPECT_FALSE(row.pass);
  EXPECT_FALSE(row.skipped);
  EXPECT_EQ(row.case_name, "backend cpu options");
  EXPECT_NE(row.note.find("[explained threads 100000] threads = 100000 must be in [0, 256]"), std::string::npos) << row.note;
}

TEST(HarnessValidate, TheKernelPathReachesOnlyTheCudaBackend) {
  ValidateOptions o;
  o.backend_options.path = "prefill";
  o.backend_options.threads = 3;
  EXPECT_EQ(o.options_for("cuda").path, "prefill");
  EXPECT_EQ(o.options_for("cpu").path, "");
  EXPECT_EQ(o.options_for("cpu").threads, 3);
}

}  // namespace
}  // namespace k3::harness
