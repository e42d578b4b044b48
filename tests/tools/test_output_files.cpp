// How the `k3` tool writes its outputs (k3/harness/atomic_file.hpp, docs/checkpoints.md "Output files"):
// an output that is an input or a checkpoint file is refused before anything is written, a
// planted `P.tmp` symlink redirects nothing, non-regular outputs and inputs (device nodes, FIFOs,
// directories) are refused promptly, concurrent writers never leave a mixed file, JSON outputs
// report write errors, and `checkpoint synth --force` only replaces its own files.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tools/cli_run.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "core/st_test_util.hpp"
#include "core/synth_test_util.hpp"
#include "k3/harness/checkpoint_synth.hpp"
#include "k3/safetensors.hpp"

namespace k3 {
namespace {

namespace fs = std::filesystem;
using k3::test::CliRun;
using k3::test::run_cli;
using k3::test::run_sh;
using k3::test::TempDir;

#define EXPECT_HAS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)

// run_sh (cli_run.hpp): `timeout` guards the tests of inputs that used to block (a FIFO opened for
// reading waits for a writer).
std::string k3_cmd(const std::string& args) { return "timeout 60 " + std::string(K3_CLI_PATH) + " " + args; }

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

template <typename T>
std::span<const uint8_t> bytes_of(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

// A `k3 kda run` input (T tokens, H 1, K = V = k, log-decay gate); `salt` changes the values.
void write_kda_input(const std::string& path, float salt, int64_t t = 3, int64_t k = 4) {
  const int64_t h = 1;
  std::vector<float> q(t * h * k), kk(t * h * k), v(t * h * k), g(t * h * k, -0.1f), beta(t * h, 0.5f);
  for (size_t i = 0; i < q.size(); ++i) {
    q[i] = 0.1f * static_cast<float>(i % 5) + salt;
    kk[i] = 0.2f - 0.05f * static_cast<float>(i % 3);
    v[i] = salt * static_cast<float>(i % 11 + 1);
  }
  st::Writer w;
  ASSERT_TRUE(w.add("q", st::DType::kF32, {t, h, k}, bytes_of(q)).is_ok());
  ASSERT_TRUE(w.add("k", st::DType::kF32, {t, h, k}, bytes_of(kk)).is_ok());
  ASSERT_TRUE(w.add("v", st::DType::kF32, {t, h, k}, bytes_of(v)).is_ok());
  ASSERT_TRUE(w.add("g", st::DType::kF32, {t, h, k}, bytes_of(g)).is_ok());
  ASSERT_TRUE(w.add("beta", st::DType::kF32, {t, h}, bytes_of(beta)).is_ok());
  ASSERT_TRUE(w.write(path).is_ok());
}

SynthOptions small_ckpt(const std::string& dir) { return test::small_synth_options(dir); }

void write_moe_input(const std::string& path) {
  const int64_t m = 2, k = 64;
  std::vector<float> x(m * k), logits(m * 8);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.01f * static_cast<float>(static_cast<int>(i % 17) - 8);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = 0.1f * static_cast<float>(i % 7);
  st::Writer w;
  ASSERT_TRUE(w.add("x", st::DType::kF32, {m, k}, bytes_of(x)).is_ok());
  ASSERT_TRUE(w.add("logits", st::DType::kF32, {m, 8}, bytes_of(logits)).is_ok());
  ASSERT_TRUE(w.write(path).is_ok());
}

std::vector<std::string> dir_entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// ---- 1. an output that is an input ------------------------------------------------------------

TEST(OutputFiles, KdaRunRefusesAnOutputThatIsTheInput) {
  TempDir dir("out_is_in_kda");
  const std::string in = dir.file("in.safetensors");
  write_kda_input(in, 0.5f);
  const std::string before = slurp(in);
  fs::create_symlink(in, dir.file("link.safetensors"));
  fs::create_hard_link(in, dir.file("hard.safetensors"));
  for (const std::string& out : {in, dir.file("link.safetensors"), dir.file("hard.safetensors"),
                                dir.str() + "/./sub/../in.safetensors"}) {
    if (out.find("/sub/") != std::string::npos) fs::create_directories(dir.file("sub"));
    const auto r = run_cli("kda run --input " + in + " --output " + out);
    EXPECT_NE(r.code, 0) << out << "\n" << r.out;
    EXPECT_HAS(r.out, "--output " + out + " is the same file as --input " + in);
    EXPECT_EQ(slurp(in), before) << "the input was modified through " << out;
  }
  // Nothing else was written (no temporary files either).
  EXPECT_EQ(dir_entries(dir.str()), (std::vector<std::string>{"hard.safetensors", "in.safetensors", "link.safetensors", "sub"}));
}

class MoeOutputFiles : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(write_synthetic_checkpoint(small_ckpt(ckpt_.str())).is_ok()); }
  std::string run_args(const std::string& in, const std::string& out) const {
    return "moe run --checkpoint " + ckpt_.str() + " --layer 1 --input " + in + " --output " + out +
           " --backend reference";
  }
  TempDir ckpt_{"out_ckpt"};
  TempDir io_{"out_ckpt_io"};
};

TEST_F(MoeOutputFiles, MoeRunRefusesAnOutputThatIsTheInputOrACheckpointFile) {
  const std::string in = io_.file("in.safetensors");
  write_moe_input(in);
  const std::string shard = ckpt_.file("model.safetensors"), config = ckpt_.file("config.json");
  const std::string in_before = slurp(in), shard_before = slurp(shard), config_before = slurp(config);
  fs::create_symlink(shard, io_.file("shard_link.safetensors"));

  auto r = run_cli(run_args(in, in));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_HAS(r.out, "--output " + in + " is the same file as --input " + in);
  for (const std::string& out : {shard, io_.file("shard_link.safetensors")}) {
    r = run_cli(run_args(in, out));
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_HAS(r.out, "--output " + out + " is the same file as --checkpoint file " + shard);
  }
  r = run_cli(run_args(in, config));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_HAS(r.out, "--output " + config + " is the same file as --checkpoint file " + config);
  EXPECT_EQ(slurp(in), in_before);
  EXPECT_EQ(slurp(shard), shard_before);
  EXPECT_EQ(slurp(config), config_before);
  EXPECT_EQ(dir_entries(ckpt_.str()), (std::vector<std::string>{"config.json", "model.safetensors"}));

  // A distinct output still works.
  r = run_cli(run_args(in, io_.file("out.safetensors")));
  EXPECT_EQ(r.code, 0) << r.out;
}

// ---- 2. a planted P.tmp symlink ---------------------------------------------------------------

TEST(OutputFiles, PlantedTmpSymlinkRedirectsNothing) {
  TempDir dir("out_symlink");
  const std::string in = dir.file("in.safetensors"), out = dir.file("out.safetensors");
  const std::string victim = dir.file("victim.txt");
  write_kda_input(in, 0.25f);
  test::write_text(victim, "precious\n");
  fs::create_symlink(victim, out + ".tmp");
  const auto r = run_cli("kda run --input " + in + " --output " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(slurp(victim), "precious\n");
  EXPECT_TRUE(fs::is_symlink(out + ".tmp"));
  EXPECT_FALSE(fs::is_symlink(out));
  auto f = st::File::open(out);
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_NE(f->find("o"), nullptr);
  EXPECT_EQ(dir_entries(dir.str()),
            (std::vector<std::string>{"in.safetensors", "out.safetensors", "out.safetensors.tmp", "victim.txt"}));
}

// ---- 3. non-regular, empty and directory-like output paths ------------------------------------

TEST(OutputFiles, NonRegularOutputsAreRefused) {
  TempDir dir("out_nonreg");
  const std::string in = dir.file("in.safetensors");
  write_kda_input(in, 0.5f);
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0644), 0);
  fs::create_directories(dir.file("d"));
  struct Case {
    std::string out, want;
  };
  const std::vector<Case> cases = {
      {"/dev/null", "--output /dev/null exists and is a character device, not a regular file"},
      {dir.file("fifo"), "--output " + dir.file("fifo") + " exists and is a FIFO (named pipe), not a regular file"},
      {dir.file("d"), "--output " + dir.file("d") + " exists and is a directory, not a regular file"},
      {"''", "--output: the path is empty"},
      {dir.file("d") + "/", "--output " + dir.file("d") + "/ ends in '/', which names a directory"},
      {dir.file("nope") + "/", "ends in '/'"},
      {dir.file("missing/o.safetensors"),
       "cannot create a file there: directory " + dir.file("missing") + ": No such file or directory"},
  };
  for (const auto& c : cases) {
    const auto r = run_sh(k3_cmd("kda run --input " + in + " --output " + c.out));
    EXPECT_NE(r.code, 0) << c.out << "\n" << r.out;
    EXPECT_HAS(r.out, c.want);
    EXPECT_EQ(r.out.find("Success"), std::string::npos) << r.out;
  }
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
  EXPECT_EQ(dir_entries(dir.str()), (std::vector<std::string>{"d", "fifo", "in.safetensors"}));
  EXPECT_TRUE(fs::is_empty(dir.file("d")));
}

// ---- 4. concurrent writers --------------------------------------------------------------------

TEST(OutputFiles, ConcurrentWritersNeverLeaveAMixedFile) {
  TempDir dir("out_concurrent");
  const std::string a = dir.file("a.safetensors"), b = dir.file("b.safetensors"), out = dir.file("out.safetensors");
  // Outputs of different sizes (about 64 KiB and 256 KiB: many write calls each), so that an
  // interleaving of the two writers would show as a mixed or truncated file.
  write_kda_input(a, 0.5f, 1024, 16);
  write_kda_input(b, -1.5f, 4096, 16);
  // The two complete outputs, written one at a time.
  ASSERT_EQ(run_cli("kda run --input " + a + " --output " + dir.file("ref_a.safetensors")).code, 0);
  ASSERT_EQ(run_cli("kda run --input " + b + " --output " + dir.file("ref_b.safetensors")).code, 0);
  const std::string ref_a = slurp(dir.file("ref_a.safetensors")), ref_b = slurp(dir.file("ref_b.safetensors"));
  ASSERT_NE(ref_a, ref_b);

  constexpr int kRounds = 40;
  auto loop = [&](const std::string& in) {
    return "(for i in $(seq " + std::to_string(kRounds) + "); do " + std::string(K3_CLI_PATH) + " kda run --input " +
           in + " --output " + out + " >/dev/null || echo WRITER_FAILED; done)";
  };
  const std::string script = dir.file("race.sh");
  test::write_text(script, loop(a) + " &\n" + loop(b) + " &\nwait\n");
  FILE* p = popen(("sh " + script + " 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string output;
  std::atomic<bool> done{false};
  std::thread reader([&] {  // the writers' messages, until both loops end
    std::array<char, 256> buf{};
    size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) output.append(buf.data(), n);
    done = true;
  });
  // While they race, every snapshot of the output is one of the two complete files.
  int snapshots = 0, bad = 0;
  while (!done) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    if (!fs::exists(out)) continue;
    const std::string snap = slurp(out);
    ++snapshots;
    if (snap != ref_a && snap != ref_b) ++bad;
  }
  reader.join();
  pclose(p);
  EXPECT_EQ(output.find("WRITER_FAILED"), std::string::npos) << output;
  EXPECT_GT(snapshots, 0);
  EXPECT_EQ(bad, 0) << "of " << snapshots << " snapshots";
  const std::string final_bytes = slurp(out);
  EXPECT_TRUE(final_bytes == ref_a || final_bytes == ref_b);
  auto f = st::File::open(out);
  EXPECT_TRUE(f.is_ok()) << f.status().to_string();
  // No temporary file is left behind.
  for (const auto& name : dir_entries(dir.str())) EXPECT_EQ(name.find("k3tmp"), std::string::npos) << name;
}

// ---- 5. JSON outputs --------------------------------------------------------------------------

TEST(OutputFiles, ValidateJsonOutputGoesThroughTheSameRules) {
  TempDir dir("out_json");
  // A path in a directory that does not exist: refused before the run, non-zero exit.
  auto r = run_cli("validate --op formats --suite smoke --output " + dir.file("no/such/dir/r.json"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_HAS(r.out, "--output " + dir.file("no/such/dir/r.json") + ": cannot create a file there: directory " +
                        dir.file("no/such/dir") + ": No such file or directory");
  r = run_cli("validate --op formats --suite smoke --output /dev/null");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_HAS(r.out, "--output /dev/null exists and is a character device");
  if (::access("/dev/full", W_OK) == 0) {
    r = run_cli("validate --op formats --suite smoke --output /dev/full");
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_HAS(r.out, "--output /dev/full exists and is a character device");
  }
  // A planted temp-name symlink is ignored, and the JSON is complete.
  const std::string out = dir.file("r.json"), victim = dir.file("victim.txt");
  test::write_text(victim, "keep\n");
  fs::create_symlink(victim, out + ".tmp");
  r = run_cli("validate --op formats --suite smoke --output " + out);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(slurp(victim), "keep\n");
  const auto j = nlohmann::json::parse(slurp(out), nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  EXPECT_FALSE(j["records"].empty());
}

// ---- 6. checkpoint synth --force --------------------------------------------------------------

TEST(OutputFiles, SynthForceOnlyReplacesItsOwnFiles) {
  TempDir dir("out_synth_force");
  ASSERT_TRUE(write_synthetic_checkpoint(small_ckpt(dir.str())).is_ok());
  // An unrelated safetensors file the user keeps in the same folder.
  st::Writer w;
  const std::vector<uint8_t> keep = {1, 2, 3, 4};
  ASSERT_TRUE(w.add("user.tensor", st::DType::kU8, {4}, keep).is_ok());
  ASSERT_TRUE(w.write(dir.file("mine.safetensors")).is_ok());
  const std::string mine_before = slurp(dir.file("mine.safetensors"));

  const std::string synth = "checkpoint synth --output " + dir.str() +
                            " --hidden 96 --expert-hidden 64 --intermediate 32 --num-experts 8 --top-k 3 --seed 4";
  auto r = run_cli(synth);
  EXPECT_NE(r.code, 0) << r.out;  // without --force: refused
  EXPECT_HAS(r.out, "--force");
  r = run_cli(synth + " --force");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_HAS(r.out, "left in place, not written by this run: mine.safetensors");
  EXPECT_EQ(slurp(dir.file("mine.safetensors")), mine_before);
  EXPECT_EQ(dir_entries(dir.str()), (std::vector<std::string>{"config.json", "mine.safetensors", "model.safetensors"}));
  EXPECT_HAS(slurp(dir.file("config.json")), "\"seed\": 4");

  // Sharded over the single file: the shards and the index are written, model.safetensors and
  // mine.safetensors stay (the index decides what readers use).
  r = run_cli(synth + " --force --shard-size 10KB");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(slurp(dir.file("mine.safetensors")), mine_before);
  EXPECT_TRUE(fs::exists(dir.file("model.safetensors.index.json")));
  EXPECT_TRUE(fs::exists(dir.file("model.safetensors")));
  auto ck = st::Checkpoint::open(dir.str());
  ASSERT_TRUE(ck.is_ok()) << ck.status().to_string();
  EXPECT_FALSE(ck->contains("user.tensor"));
  // Back to one file: the stale index (which would hide model.safetensors) is removed.
  r = run_cli(synth + " --force");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_HAS(r.out, "removed the stale model.safetensors.index.json");
  EXPECT_FALSE(fs::exists(dir.file("model.safetensors.index.json")));
  EXPECT_EQ(slurp(dir.file("mine.safetensors")), mine_before);
}

// ---- 7. non-regular inputs --------------------------------------------------------------------

TEST(OutputFiles, FifoInputsAreRefusedPromptly) {
  TempDir dir("in_fifo");
  const std::string fifo = dir.file("in.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_sh(k3_cmd("kda run --input " + fifo + " --output " + dir.file("o.safetensors")));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.code, 124) << "k3 kda run blocked on the FIFO";
  EXPECT_HAS(r.out, "--input " + fifo + " is a FIFO (named pipe), not a regular file");

  TempDir ck("in_fifo_ckpt");
  ASSERT_TRUE(write_synthetic_checkpoint(small_ckpt(ck.str())).is_ok());
  r = run_sh(k3_cmd("moe run --checkpoint " + ck.str() + " --layer 1 --input " + fifo + " --output " +
                    dir.file("o.safetensors")));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.code, 124) << "k3 moe run blocked on the FIFO";
  EXPECT_HAS(r.out, "--input " + fifo + " is a FIFO (named pipe), not a regular file");
  // A FIFO as the checkpoint file itself, or as its config.json.
  const std::string real_in = dir.file("real.safetensors");
  write_moe_input(real_in);
  r = run_sh(k3_cmd("moe run --checkpoint " + fifo + " --layer 1 --input " + real_in + " --output " +
                    dir.file("o.safetensors")));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.code, 124) << r.out;
  EXPECT_HAS(r.out, "--checkpoint " + fifo + " is a FIFO (named pipe), neither a safetensors file nor a checkpoint directory");
  fs::remove(ck.file("config.json"));
  ASSERT_EQ(::mkfifo(ck.file("config.json").c_str(), 0644), 0);
  r = run_sh(k3_cmd("moe run --checkpoint " + ck.str() + " --layer 1 --input " + real_in + " --output " +
                    dir.file("o.safetensors")));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.code, 124) << r.out;
  EXPECT_HAS(r.out, ck.file("config.json") + ": is a FIFO (named pipe), not a regular file");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(50));
  EXPECT_FALSE(fs::exists(dir.file("o.safetensors")));
}

// ---- K3_NUM_THREADS ---------------------------------------------------------------------------

TEST_F(MoeOutputFiles, ThreadCountFromTheEnvironmentIsReportedAsGiven) {
  const std::string in = io_.file("in.safetensors");
  write_moe_input(in);
  const auto r = run_cli("moe run --checkpoint " + ckpt_.str() + " --layer 1 --input " + in + " --output " +
                         io_.file("o.safetensors") + " --backend cpu");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto bad = run_sh("K3_NUM_THREADS=1000 " + k3_cmd("moe run --checkpoint " + ckpt_.str() + " --layer 1 --input " +
                                                        in + " --output " + io_.file("o2.safetensors") +
                                                        " --backend cpu"));
  EXPECT_NE(bad.code, 0) << bad.out;
  EXPECT_HAS(bad.out, "threads = 1000 (from K3_NUM_THREADS=1000) must be in [0, 256]");
  EXPECT_FALSE(fs::exists(io_.file("o2.safetensors")));
  // `k3 validate`: a refused count is one FAIL naming the variable, not a SKIP on every case.
  const auto v = run_sh("K3_NUM_THREADS=1000 " + k3_cmd("validate --op moe --suite smoke --backend cpu --recipe w4a16 "
                                                      "--activation silu"));
  EXPECT_EQ(v.code, 1) << v.out;
  EXPECT_HAS(v.out, "backend cpu options");
  EXPECT_HAS(v.out, "threads = 1000 (from K3_NUM_THREADS=1000) must be in [0, 256]");
  EXPECT_HAS(v.out, "1 checks, 1 failed");
}

}  // namespace
}  // namespace k3
