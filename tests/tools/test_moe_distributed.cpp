// `mpirun -np R k3 moe run --distributed` end to end on a synthetic Kimi-format checkpoint: the
// output equals the single-process `k3 moe run` bit for bit at EP 2 to 9 (3, 5, 6 and 9 split the
// 64 experts unevenly), with random routing and with hot and empty experts; start-up refusals
// (world size, mismatched checkpoints) name the rank; a rank that dies or hangs fails the job
// within a bounded time with a message naming it.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/st_test_util.hpp"
#include "k3/harness/checkpoint_synth.hpp"
#include "k3/moe.hpp"
#include "k3/safetensors.hpp"
#include "tools/cli_run.hpp"

#ifdef K3_MPIEXEC
namespace k3 {
namespace {

using k3::test::run_cli;
using k3::test::run_sh;

// Under ASan the launched ranks run without leak checks: Open MPI's own allocations come from
// components it unloads at finalize, which LeakSanitizer reports as unknown modules.
#if defined(__SANITIZE_ADDRESS__)
constexpr const char* kLeakEnv = "ASAN_OPTIONS=detect_leaks=0 ";
#else
constexpr const char* kLeakEnv = "";
#endif

// Open MPI's consent for root, shared memory only, and a session directory of this test process's
// own: under `ctest -j` two mpiruns sharing /tmp/ompi.<host>.<uid> race (one removes it at exit
// while the other creates its pid.N inside: "orte_session_dir failed").
std::string mpi_env() {
  static const test::TempDir session{"ompi_session"};
  return "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader OMPI_MCA_orte_tmpdir_base=" +
         session.str() + " ";
}

std::string mpirun(int np, const std::string& args, const std::string& env = "") {
  return "env " + mpi_env() + "K3_NUM_THREADS=1 " + std::string(kLeakEnv) + env +
         " timeout 300 " + std::string(K3_MPIEXEC) + " --oversubscribe -np " + std::to_string(np) + " " +
         std::string(K3_CLI_PATH) + " " + args;
}

std::string sha_line(const std::string& out) {
  const auto p = out.find("out sha256 ");
  return p == std::string::npos ? "<none>" : out.substr(p + 11, 64);
}

// Kimi-format names and config; E 64, top-8, K 64, N 32, layer 1.
SynthOptions small_kimi(const std::string& dir) {
  SynthOptions o;
  o.output_dir = dir;
  o.hidden_size = 64;
  o.expert_hidden = 64;
  o.intermediate = 32;
  o.num_experts = 64;
  o.top_k = 8;
  o.layers = {1};
  o.seed = 9;
  return o;
}

class MoeDistributed : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(write_synthetic_checkpoint(small_kimi(ckpt_.str())).is_ok());
    const int64_t m = 37, k = 64, e = 64;
    std::mt19937_64 rng(4);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> x(m * k), logits(m * e);
    for (auto& v : x) v = nd(rng);
    for (auto& v : logits) v = nd(rng);
    st::Writer w;
    ASSERT_TRUE(w.add("x", st::DType::kF32, {m, k}, {reinterpret_cast<const uint8_t*>(x.data()), x.size() * 4}).is_ok());
    ASSERT_TRUE(w.add("logits", st::DType::kF32, {m, e}, {reinterpret_cast<const uint8_t*>(logits.data()), logits.size() * 4}).is_ok());
    ASSERT_TRUE(w.write(io_.file("in.safetensors")).is_ok());
    // Hot and empty experts: every token's logits favour experts 0-3 (rank 0's at every W) and
    // never pick 56-63 (at W = 9 the last rank's experts [57, 64) get no row).
    for (int64_t t = 0; t < m; ++t) {
      for (int64_t j = 0; j < e; ++j) logits[t * e + j] += j < 4 ? 6.0f : j >= 56 ? -30.0f : 0.0f;
    }
    st::Writer h;
    ASSERT_TRUE(h.add("x", st::DType::kF32, {m, k}, {reinterpret_cast<const uint8_t*>(x.data()), x.size() * 4}).is_ok());
    ASSERT_TRUE(h.add("logits", st::DType::kF32, {m, e}, {reinterpret_cast<const uint8_t*>(logits.data()), logits.size() * 4}).is_ok());
    ASSERT_TRUE(h.write(io_.file("hot.safetensors")).is_ok());
  }
  std::string args(const std::string& out, const std::string& extra = "", const std::string& in = "in") const {
    return "moe run --checkpoint " + ckpt_.str() + " --layer 1 --input " + io_.file(in + ".safetensors") + " --output " +
           io_.file(out) + " " + extra;
  }
  test::TempDir ckpt_{"dist_ckpt"};
  test::TempDir io_{"dist_io"};
};

TEST_F(MoeDistributed, OutputIsBitIdenticalToTheSingleProcessRunAtEveryWorldSize) {
  for (const char* in : {"in", "hot"})
  for (const char* recipe : {"w4a8", "w4a16"}) {
    const std::string opts = std::string("--recipe ") + recipe + " --out-dtype fp32";
    const auto single = run_cli(args("single.safetensors", opts + " --backend cpu", in));
    ASSERT_EQ(single.code, 0) << single.out;
    // The hot input at every size of the issue; the random one at the even sizes too.
    const std::vector<int> sizes = std::string(in) == "hot" ? std::vector<int>{3, 5, 6, 9} : std::vector<int>{2, 3, 4, 5, 6, 8, 9};
    for (const int np : sizes) {
      SCOPED_TRACE(std::string(in) + " " + recipe + " np " + std::to_string(np));
      const auto r = run_sh(mpirun(np, args("dist" + std::to_string(np) + ".safetensors", opts + " --distributed", in)));
      ASSERT_EQ(r.code, 0) << r.out;
      EXPECT_NE(r.out.find("distributed over " + std::to_string(np) + " MPI ranks (EP" + std::to_string(np)), std::string::npos) << r.out;
      EXPECT_EQ(sha_line(r.out), sha_line(single.out)) << recipe << " np " << np << "\n" << r.out;
      // The file, not only the digest line: same `out` tensor bytes.
      auto a = st::File::open(io_.file("single.safetensors"));
      auto b = st::File::open(io_.file("dist" + std::to_string(np) + ".safetensors"));
      ASSERT_TRUE(a.is_ok() && b.is_ok());
      const auto ab = a->bytes(*a->find("out"));
      const auto bb = b->bytes(*b->find("out"));
      EXPECT_TRUE(std::equal(ab.begin(), ab.end(), bb.begin(), bb.end()));
      // Each rank loads only its experts (docs/distributed.md, "Expert partition"): the first
      // 64 mod W ranks hold one more.
      for (int q = 0; q < np; ++q) {
        const ExpertRange g = expert_range(64, np, q);
        EXPECT_NE(r.out.find("rank " + std::to_string(q) + ": experts [" + std::to_string(g.first) + ", " +
                             std::to_string(g.first + g.count) + ")"),
                  std::string::npos) << r.out;
      }
      if (std::string(in) == "hot" && np == 9) {  // the last rank computed nothing, and said so
        const auto at = r.out.find("rank 8: experts [57, 64)");
        ASSERT_NE(at, std::string::npos) << r.out;
        const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
        EXPECT_NE(line.find(", 0 rows received, 0 slots computed"), std::string::npos) << line;
      }
    }
  }
}

TEST_F(MoeDistributed, StartUpRefusalsNameTheRank) {
  auto r = run_sh(mpirun(2, args("o.safetensors", "--distributed --ep-size 4")));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("rank 0 of 2: --ep-size 4 --ep-rank 0 disagree with the MPI job (2 ranks, this is rank 0)"),
            std::string::npos) << r.out;
  // A rank pointed at another checkpoint (same shapes, other config): refused before loading.
  test::TempDir other{"dist_other"};
  SynthOptions o = small_kimi(other.str());
  o.num_hidden_layers = 61;  // same shapes, another config.json
  ASSERT_TRUE(write_synthetic_checkpoint(o).is_ok());
  std::string bad_other = args("o.safetensors", "--distributed");
  bad_other.replace(bad_other.find(ckpt_.str()), ckpt_.str().size(), other.str());
  const std::string mpmd = "env " + mpi_env() + std::string(kLeakEnv) + "timeout 300 " +
                           std::string(K3_MPIEXEC) + " --oversubscribe -np 3 " + K3_CLI_PATH + " " +
                           args("o.safetensors", "--distributed") + " : -np 1 " + K3_CLI_PATH + " " + bad_other;
  r = run_sh(mpmd);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("checkpoint and run options differs between ranks: rank 3 has 'config.json sha256"), std::string::npos)
      << r.out;
  // Another backend has no multi-rank path: said, not attempted.
  r = run_sh(mpirun(2, args("o.safetensors", "--distributed --backend reference")));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--backend reference: the moe backend 'reference' has no expert-parallel entry points"), std::string::npos)
      << r.out;
  // Bad input on rank 0: every rank leaves, rank 0 says why.
  r = run_sh(mpirun(4, "moe run --checkpoint " + ckpt_.str() + " --layer 1 --input " + io_.file("missing.safetensors") +
                           " --output " + io_.file("o.safetensors") + " --distributed"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("rank 0 of 4: --input " + io_.file("missing.safetensors") + ": cannot open"), std::string::npos) << r.out;
  // More ranks than experts: refused on every rank, naming the value.
  test::TempDir few{"dist_few"};
  SynthOptions f = small_kimi(few.str());
  f.num_experts = 4;
  f.top_k = 2;
  ASSERT_TRUE(write_synthetic_checkpoint(f).is_ok());
  std::string few_args = args("o.safetensors", "--distributed");
  few_args.replace(few_args.find(ckpt_.str()), ckpt_.str().size(), few.str());
  r = run_sh(mpirun(5, few_args));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("rank 0 of 5: the MPI job's 5 ranks are the EP size (--ep-size 5 --ep-rank 0: --ep-size must be "
                       "at most the checkpoint's 4 experts"),
            std::string::npos) << r.out;
}

TEST_F(MoeDistributed, ADeadOrHungRankFailsTheJobWithinBoundedTime) {
  struct Fault {
    const char* inject;
    const char* expect;
  };
  for (const Fault f : {Fault{"hang:1", "did not complete within the timeout of 3 s: a peer rank has exited, crashed or hangs"},
                        Fault{"kill:1", "rank 1"}, Fault{"exit:2", "rank 2"}}) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = run_sh(mpirun(4, args("o.safetensors", "--distributed --comm-timeout 3"), std::string("K3_FAULT_INJECT=") + f.inject));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(r.code, 0) << f.inject << "\n" << r.out;
    EXPECT_NE(r.code, 124) << f.inject << ": the job hung until the test's 300 s timeout\n" << r.out;
    EXPECT_LT(s, 60) << f.inject;
    EXPECT_NE(r.out.find(f.expect), std::string::npos) << f.inject << "\n" << r.out;
    EXPECT_NE(r.out.find(std::string("K3_FAULT_INJECT=") + f.inject), std::string::npos) << r.out;
  }
}

// Every phase of a distributed run (start-up, loading, the run, the finish and the shutdown) ends
// within --comm-timeout plus a margin when a peer hangs, is stopped (SIGSTOP) or dies: the ranks
// that see it name themselves and the phase and abort the job with exit code 2; nobody is left
// in MPI_Finalize; the output file is not written before the run has finished.
TEST_F(MoeDistributed, EveryPhaseFailsBoundedWhenAPeerHangsStopsOrDies) {
  const char* phases[] = {"start", "load", "run", "finish", "shutdown"};
  const char* names[] = {"start-up", "loading", "run", "finish", "shutdown"};
  for (int ph = 0; ph < 5; ++ph) {
    for (const char* action : {"hang", "stop", "kill"}) {
      const std::string inject = std::string(action) + ":1:" + phases[ph];
      const std::string out = "fault_" + std::string(action) + "_" + phases[ph] + ".safetensors";
      const auto t0 = std::chrono::steady_clock::now();
      const auto r = run_sh(mpirun(2, args(out, "--distributed --comm-timeout 3"), "K3_FAULT_INJECT=" + inject));
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_NE(r.code, 0) << inject << "\n" << r.out;
      EXPECT_NE(r.code, 124) << inject << ": the job hung until the test's 300 s timeout\n" << r.out;
      EXPECT_LT(s, 60) << inject;
      EXPECT_NE(r.out.find("K3_FAULT_INJECT=" + inject), std::string::npos) << r.out;
      if (std::string(action) != "kill") {  // a killed rank ends the job through the launcher itself
        EXPECT_EQ(r.code, 2) << inject << "\n" << r.out;
        EXPECT_NE(r.out.find(std::string("rank 0 of 2, phase ") + names[ph] + ":"), std::string::npos)
            << inject << "\n" << r.out;
        EXPECT_NE(r.out.find("did not complete within the timeout of 3 s"), std::string::npos) << inject << "\n" << r.out;
      }
      const bool written = std::filesystem::exists(io_.file(out));
      if (ph < 4) {
        EXPECT_FALSE(written) << inject << ": the output was written before the run finished";
      }
    }
  }
}

TEST(BenchComm, TableAndJsonUnderMpirunAndClearErrors) {
  test::TempDir io{"bench_comm"};
  const std::string json = io.file("comm.json");
  auto r = run_sh(mpirun(2, "bench comm --m 1,4 --iters 2 --allreduce-kib 8,64 --output " + json));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("EP dispatch / combine: 2 mpi ranks (EP2), K 3584, E 896, top-16, w4a8, rows as MXFP8 codes + scales"),
            std::string::npos) << r.out;
  std::ifstream f(json);
  const auto j = nlohmann::json::parse(f);
  ASSERT_EQ(j.at("ep").size(), 2u);
  EXPECT_EQ(j.at("world_size"), 2);
  EXPECT_EQ(j.at("ep")[1].at("m_per_rank"), 4);
  // 4 tokens x 16 slots, each on one of 2 ranks: every token reaches both ranks or one; the
  // MXFP8 record is 64 + 3584 + 112 bytes.
  const int64_t db = j.at("ep")[1].at("dispatch_bytes_per_rank");
  EXPECT_EQ(db % (64 + 3584 + 112), 0) << db;
  EXPECT_GT(j.at("ep")[1].at("k3_dispatch_us").get<double>(), 0.0);
  ASSERT_EQ(j.at("allreduce").size(), 2u);
  EXPECT_EQ(j.at("allreduce")[1].at("bytes"), 64 * 1024 / 7168 * 7168);
  EXPECT_GT(j.at("allreduce")[1].at("native_allreduce_f32_us").get<double>(), 0.0);
  EXPECT_NE(r.out.find("TP all-reduce (BF16 in/out, exact sum"), std::string::npos) << r.out;
  // Nine ranks (896 experts split 100 x 5 + 99 x 4): the EP table, and the all-reduce on the
  // seed's payload shapes; with --skip-ep no expert partition is made at all.
  r = run_sh(mpirun(9, "bench comm --m 1 --iters 2 --allreduce-rows 1,9 --allreduce-cols 7168,1030 --output " + json));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("EP dispatch / combine: 9 mpi ranks (EP9), K 3584, E 896"), std::string::npos) << r.out;
  {
    std::ifstream f9(json);
    const auto j9 = nlohmann::json::parse(f9);
    EXPECT_EQ(j9.at("world_size"), 9);
    ASSERT_EQ(j9.at("allreduce").size(), 4u);
    EXPECT_EQ(j9.at("allreduce")[1].at("rows"), 9);
    EXPECT_EQ(j9.at("allreduce")[1].at("cols"), 7168);
    EXPECT_EQ(j9.at("allreduce")[2].at("cols"), 1030);
    EXPECT_EQ(j9.at("allreduce")[2].at("bytes"), 2060);
    EXPECT_GT(j9.at("allreduce")[3].at("k3_us").get<double>(), 0.0);
  }
  r = run_sh(mpirun(9, "bench comm --skip-ep --iters 2 --allreduce-kib 14,57"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("EP dispatch"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("9 mpi ranks, median of 2"), std::string::npos) << r.out;
  r = run_sh(mpirun(2, "bench comm --skip-ep --iters 2 --allreduce-rows 0"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--allreduce-rows"), std::string::npos) << r.out;
  r = run_sh(mpirun(2, "bench comm --recipe w8a8 --m 1"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("rank 0 of 2: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("w8a8"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace k3
#endif  // K3_MPIEXEC
