// Replays the `k3 kda run` input corpus (tests/data/kda_input_corpus, written by
// scripts/make_fuzz_corpus.py, plus any crashers of fuzz/fuzz_kda_input.cpp added after a fuzzing
// run) through kda::load_input_file exactly as the fuzz target does: valid_* files load and the
// references run on them, bad_* files give the expected error, nothing crashes (this test also
// runs under ASan + UBSan). Also: st::File::view, the in-memory File the fuzz target uses.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/st_test_util.hpp"
#include "k3/cpu_kda.hpp"
#include "k3/kda.hpp"
#include "k3/harness/kda_io.hpp"
#include "k3/safetensors.hpp"

namespace k3::kda {
namespace {

// What the error of each bad_* file must say.
const std::map<std::string, std::string> kExpected = {
    {"bad_missing_q", "bad_missing_q.safetensors: tensor 'q' is missing"},
    {"bad_q_rank", "tensor 'q' has shape [2, 2], expected [T, H, K]"},
    {"bad_v_tokens", "tensor 'v' has shape [3, 1, 3], expected [T, H, V] with T = 2, H = 1"},
    {"bad_k_shape", "tensor 'k' has shape [2, 1, 3], expected [2, 1, 2] ([T, H, K] like q)"},
    {"bad_q_dtype", "tensor 'q' has dtype I32, expected F32, F64, BF16 or F16"},
    {"bad_beta_both", "give exactly one of 'beta' (beta itself) and 'beta_logits'"},
    {"bad_beta_missing", "give exactly one of 'beta' (beta itself) and 'beta_logits'"},
    {"bad_beta_shape", "tensor 'beta' has shape [1, 2], expected [2, 1] ([T, H])"},
    {"bad_gate_unknown", "gate 'sigmoid' is unknown (expected log_decay, safe or softplus)"},
    {"bad_layout_unknown", "state layout 'h_first' is unknown (expected k_first or v_first)"},
    {"bad_safe_without_a_log", "--gate safe needs the tensor 'A_log'"},
    {"bad_a_log_with_log_decay", "the file holds A_log / dt_bias but --gate log_decay uses g as the decay directly"},
    {"bad_a_log_short", "tensor 'A_log' has shape [1], expected at least H = 2 elements (the first H are used)"},
    {"bad_a_log_range", "a_log[0] = 100 is outside [-87, 88] (exp(a_log) must be a normal FP32 number; gate = safe)"},
    {"bad_a_log_nan", "a_log[0] = nan is outside [-87, 88]"},
    {"bad_dt_bias_shape", "tensor 'dt_bias' has shape [3], expected [H, K] = [1, 2] or [H * K]"},
    {"bad_cu_seqlens_decreasing", "tensor cu_seqlens[2] = 1 is below cu_seqlens[1] = 2 (must be non-decreasing)"},
    {"bad_cu_seqlens_last", "cu_seqlens[1] (the last entry) = 3 must equal the token count T = 2"},
    {"bad_cu_seqlens_empty", "tensor cu_seqlens has 0 entries, needs at least 2"},
    {"bad_cu_seqlens_dtype", "tensor 'cu_seqlens' has dtype U8, expected I64 or I32"},
    {"bad_initial_state_shape", "tensor 'initial_state' has shape [1, 1, 3, 2], expected [1, 1, 2, 3]"},
    {"bad_too_many_heads", "num_heads = 2000 must be in [1, 1024]"},
    {"bad_final_state_too_big", "output 'final_state' [N, H, K, V] = [299, 1024, 512, 512] needs 321048805376 bytes"},
};

std::vector<uint8_t> read_all(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The fuzz target's steps: File::view, options from "__metadata__", load, references.
Status load_and_run(const std::vector<uint8_t>& bytes, const std::string& source) {
  auto f = st::File::view(bytes, source);
  if (!f.is_ok()) return f.status();
  InputFileOptions opt;
  if (auto it = f->metadata().find("gate"); it != f->metadata().end()) opt.gate = it->second;
  if (auto it = f->metadata().find("layout"); it != f->metadata().end()) opt.layout = it->second;
  auto in = load_input_file(f.value(), opt);
  if (!in.is_ok()) return in.status();
  auto n = output_elements(in.value(), 8);
  if (!n.is_ok()) return n.status();
  const KdaConfig& c = in->cfg;
  if (n->o * c.head_k > (int64_t{1} << 16) || n->final_state > (int64_t{1} << 16)) return Status::ok();  // as the target
  std::vector<float> o(static_cast<size_t>(n->o)), s(static_cast<size_t>(n->final_state));
  K3_RETURN_IF_ERROR(reference_fp32(in->cfg, in->inputs(), {o, s}));
  std::vector<double> o64(o.size()), s64(s.size());
  K3_RETURN_IF_ERROR(reference_fp64(in->cfg, in->inputs(), o64, s64));
  K3_RETURN_IF_ERROR(k3::cpu::prefill(in->cfg, in->inputs(), {o, s}));
  return Status::ok();
}

TEST(KdaInputCorpus, ReplaysEveryFile) {
  const std::filesystem::path dir = std::filesystem::path(K3_TEST_DATA_DIR) / "kda_input_corpus";
  ASSERT_TRUE(std::filesystem::is_directory(dir)) << dir;
  int valid = 0, bad = 0;
  std::set<std::string> seen;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string stem = entry.path().stem().string(), source = entry.path().filename().string();
    const Status st = load_and_run(read_all(entry.path()), source);
    if (stem.rfind("valid_", 0) == 0) {
      ++valid;
      EXPECT_TRUE(st.is_ok()) << source << ": " << st.to_string();
    } else {
      ++bad;
      ASSERT_FALSE(st.is_ok()) << source << " loaded";
      if (auto it = kExpected.find(stem); it != kExpected.end()) {
        seen.insert(stem);
        EXPECT_NE(st.message().find(it->second), std::string::npos) << source << ": " << st.message();
      }
    }
  }
  EXPECT_GE(valid, 6);
  EXPECT_GE(bad, static_cast<int>(kExpected.size()));
  EXPECT_EQ(seen.size(), kExpected.size()) << "a generated bad_* file is missing";
}

// The committed fuzzer corpus (fuzz/corpus/kda_input) replays without a crash; it holds valid and
// invalid inputs alike, so only "no crash" is checked.
TEST(KdaInputCorpus, ReplaysTheFuzzerCorpus) {
  const std::filesystem::path dir = std::filesystem::path(K3_TEST_DATA_DIR) / ".." / ".." / "fuzz" / "corpus" / "kda_input";
  if (!std::filesystem::is_directory(dir)) GTEST_SKIP() << "no " << dir;
  int n = 0, ok = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    ok += load_and_run(read_all(entry.path()), entry.path().filename().string()).is_ok();
    ++n;
  }
  EXPECT_GT(n, 0);
  std::printf("fuzz/corpus/kda_input: %d files, %d load and run\n", n, ok);
}

TEST(SafetensorsView, ViewsAnImageWithoutCopyingAndChecksItLikeOpen) {
  const std::vector<uint8_t> img = test::st_image(R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", {5, 6});
  auto f = st::File::view(img, "mem.safetensors");
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  ASSERT_NE(f->find("w"), nullptr);
  EXPECT_EQ(f->bytes(*f->find("w")).data(), img.data() + img.size() - 2);  // a view, not a copy
  st::File moved = std::move(f.value());  // moving keeps the view (nothing to unmap)
  EXPECT_EQ(moved.bytes(*moved.find("w"))[1], 6);
  EXPECT_EQ(moved.path(), "mem.safetensors");
  const std::vector<uint8_t> shorty = {1, 2, 3};
  auto bad = st::File::view(shorty, "mem.safetensors");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("mem.safetensors: file is 3 bytes, too short"), std::string::npos);
  const std::vector<uint8_t> cut(img.begin(), img.end() - 1);
  auto trunc = st::File::view(cut, "mem.safetensors");
  EXPECT_FALSE(trunc.is_ok());
}

}  // namespace
}  // namespace k3::kda
