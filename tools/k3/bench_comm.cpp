// `k3 bench comm`: the multi-rank ops' data movement, next to the transport's own collectives
// measured in the same run (docs/distributed.md, "Benchmarks"). Run it under the launcher:
//   mpirun -np 8 k3 bench comm [--m 1,16,128] [--output comm.json]
// Without a launcher it runs as one rank (the numbers then show only k3's local overheads).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "backend_options.hpp"
#include "bench.hpp"
#include "k3/harness/bench.hpp"
#include "k3/harness/atomic_file.hpp"
#include "k3/comm.hpp"
#include "k3/harness/comm_bench.hpp"
#include "k3/harness/ep_bench.hpp"
#include "paths.hpp"

namespace k3::tool {
namespace {

struct Args {
  std::vector<int64_t> m = {1, 16, 128};
  int iters = 10;
  std::string recipe = "w4a8";
  bool bf16_wire = false;
  std::vector<int64_t> allreduce_kib = {8, 64, 512, 4096, 32768, 65536};
  std::vector<int64_t> allreduce_rows;                // given: rows x cols shapes instead of KiB sizes
  std::vector<int64_t> allreduce_cols = {7168, 3584};
  bool skip_ep = false, skip_allreduce = false;
  double timeout = 120;
  std::string output;
};

std::string fmt_bytes(double b) {
  char buf[32];
  if (b >= 1e6) std::snprintf(buf, sizeof buf, "%.2f MB", b / 1e6);
  else if (b >= 1e3) std::snprintf(buf, sizeof buf, "%.1f KB", b / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f B", b);
  return buf;
}

Status run(const Args& a) {
  std::unique_ptr<comm::Communicator> c;
  if (comm::mpi_available().is_ok()) {
    auto made = comm::make_mpi_communicator({.timeout_s = a.timeout});
    K3_ASSIGN_OR_RETURN(c, std::move(made));
  } else {
    std::fprintf(stderr, "k3 bench comm: %s; measuring one rank only\n", comm::mpi_available().message().c_str());
    c = comm::make_self_communicator();
  }
  const int rank = c->rank(), world = c->size();
  set_reports_errors(rank == 0);  // every rank returns the agreed error; rank 0 prints it
  Status ok = Status::ok();
  if (rank == 0 && !a.output.empty()) ok = check_output_path("--output", a.output);
  auto recipe = parse_recipe(a.recipe);
  if (ok.is_ok() && !recipe.is_ok()) ok = recipe.status();
  K3_RETURN_IF_ERROR(comm::agree_on_status(*c, ok));

  MoeProblem p;  // Kimi-K3: K 3584, N 3072, E 896, top-16; any world size up to 896 (uneven partitions)
  p.recipe = recipe.value();
  p.shape.ep_size = world;
  p.shape.ep_rank = rank;
  Result<std::vector<comm::EpBenchRecord>> ep = std::vector<comm::EpBenchRecord>{};
  if (!a.skip_ep) {  // --skip-ep: no expert partition is needed at all
    ep = comm::bench_ep(*c, p, a.m, a.iters, !a.bf16_wire, 1);
  }
  K3_RETURN_IF_ERROR(ep.status());

  std::vector<comm::AllreduceBenchRecord> ar_records;
  if (rank == 0 && !a.skip_ep) {
    const bool mx = !ep->empty() && ep->front().mxfp8_wire;
    std::printf("EP dispatch / combine: %d %s rank%s (EP%d), K %lld, E %d, top-%d, %s, rows as %s; median of %d, max over ranks\n",
                world, c->transport(), world == 1 ? "" : "s", world, static_cast<long long>(p.shape.hidden),
                p.shape.num_experts, p.shape.top_k, recipe_name(p.recipe), mx ? "MXFP8 codes + scales" : "BF16", a.iters);
    std::printf("%8s %12s %12s %14s %12s %12s %14s\n", "M/rank", "dispatch", "k3 us", "alltoallv us", "combine",
                "k3 us", "alltoallv us");
    for (const auto& r : ep.value()) {
      std::printf("%8lld %12s %12.1f %14.1f %12s %12.1f %14.1f\n", static_cast<long long>(r.m),
                  fmt_bytes(static_cast<double>(r.dispatch_bytes)).c_str(), r.dispatch_us, r.native_dispatch_us,
                  fmt_bytes(static_cast<double>(r.combine_bytes)).c_str(), r.combine_us, r.native_combine_us);
    }
    std::fflush(stdout);
  }
  if (!a.skip_allreduce) {
    Result<std::vector<comm::AllreduceBenchRecord>> ar = std::vector<comm::AllreduceBenchRecord>{};
    if (a.allreduce_rows.empty()) {
      std::vector<int64_t> sizes;
      for (const int64_t kib : a.allreduce_kib) sizes.push_back(kib * 1024);
      ar = comm::bench_allreduce(*c, sizes, a.iters, 1);
    } else {
      std::vector<comm::AllreduceShape> shapes;
      for (const int64_t cols : a.allreduce_cols) {
        for (const int64_t rows : a.allreduce_rows) shapes.push_back({rows, cols});
      }
      ar = comm::bench_allreduce_shapes(*c, shapes, a.iters, 1);
    }
    K3_RETURN_IF_ERROR(ar.status());
    ar_records = ar.value();
    if (rank == 0) {
      std::printf("\nTP all-reduce (BF16 in/out, exact sum rounded once to FP32; same bits for every world size): %d %s rank%s, "
                  "median of %d, max over ranks; bus bandwidth 2(W-1)/W x bytes / time\n",
                  world, c->transport(), world == 1 ? "" : "s", a.iters);
      std::printf("%10s %6s %6s %12s %14s %16s %12s %14s\n", "bytes", "rows", "cols", "k3 us", "k3 GB/s", "k3+RMSNorm us",
                  "native us", "native GB/s");
      for (const auto& r : ar.value()) {
        std::printf("%10s %6lld %6lld %12.1f %14.2f %16.1f %12.1f %14.2f\n", fmt_bytes(static_cast<double>(r.bytes)).c_str(),
                    static_cast<long long>(r.rows), static_cast<long long>(r.cols), r.k3_us, r.k3_busbw_gbs,
                    r.k3_rmsnorm_us, r.native_us, r.native_busbw_gbs);
      }
      std::printf("(native: %s's own all-reduce of bytes/4 FP32 values, MPI_Allreduce; its bits depend on the reduction order)\n",
                  c->transport());
    }
  }
  if (rank == 0 && !a.output.empty()) {
    const std::string doc = harness::comm_bench_json(a.skip_ep ? std::vector<comm::EpBenchRecord>{} : ep.value(),
                                                     ar_records, world, c->transport(), env_isa_level());
    K3_RETURN_IF_ERROR(write_file_atomic(a.output, doc, "--output"));
    std::printf("wrote %s\n", a.output.c_str());
  }
  return Status::ok();
}

const BenchRegistration kComm("comm", [](CLI::App& bench) -> CommandRun {
  auto* cmd = bench.add_subcommand("comm", "Multi-rank data movement (run under mpirun): EP dispatch/combine, all-reduce");
  auto a = std::make_shared<Args>();
  cmd->add_option("--m", a->m, "Tokens per rank for dispatch / combine")->delimiter(',')->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--iters", a->iters, "Timed iterations per point")->check(CLI::Range(1, 100000))->capture_default_str();
  cmd->add_option("--recipe", a->recipe, "w4a8 (rows sent as MXFP8) or w4a16 (BF16)")->capture_default_str();
  cmd->add_flag("--bf16-wire", a->bf16_wire, "W4A8: send BF16 rows instead of MXFP8 codes + scales");
  cmd->add_option("--comm-timeout", a->timeout, "Seconds a collective may wait for a peer")->capture_default_str();
  cmd->add_option("--allreduce-kib", a->allreduce_kib, "All-reduce message sizes in KiB")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--allreduce-rows", a->allreduce_rows,
                  "All-reduce on rows x cols shapes instead of --allreduce-kib sizes (the seed's T: 1,2,4,8,9,16,32)")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  cmd->add_option("--allreduce-cols", a->allreduce_cols, "Columns for --allreduce-rows")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  cmd->add_flag("--skip-ep", a->skip_ep, "Leave out the dispatch / combine table (needs no expert partition)");
  cmd->add_flag("--skip-allreduce", a->skip_allreduce, "Leave out the all-reduce table");
  cmd->add_option("--output", a->output, "Write JSON to this file (rank 0)");
  return [a]() { return run(*a); };
});

}  // namespace
}  // namespace k3::tool
