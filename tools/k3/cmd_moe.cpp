// `k3 moe run --checkpoint PATH --layer L --input FILE --output FILE [--backend B]
//             [--ep-size S --ep-rank R] [--recipe w4a8|w4a16] [--out-dtype bf16|fp16|fp32]`
//
// Runs one checkpoint layer's routed experts on tensors a user brings, so that k3 can be compared
// with another engine. Input safetensors: `x` BF16 or F32 [M, K] (F32 is rounded to BF16, RNE,
// exactly what the fused MoE consumes) and either `logits` F32 or BF16 [M, E] (routed here with the
// checkpoint's correction bias and config.json routing facts) or `topk_ids` I32 / I64 [M, k] with
// `topk_weights` F32 [M, k] (global expert ids, -1 masked, any k in [1, 32]). Output safetensors:
// `out` [M, K] in the output dtype, and the `topk_ids` I32 / `topk_weights` F32 that were used.
// See docs/moe.md.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "command.hpp"
#include "k3/harness/atomic_file.hpp"
#include "k3/checkpoint.hpp"
#include "k3/comm.hpp"
#include "k3/cpu_moe.hpp"
#include "k3/harness/digest.hpp"
#include "k3/ep.hpp"
#include "k3/expert_map.hpp"
#include "k3/formats.hpp"
#include "k3/harness/moe_io.hpp"
#include "k3/routing.hpp"
#include "backend_options.hpp"
#include "k3/harness/ep_flags.hpp"
#include "paths.hpp"

namespace k3::tool {
namespace {

struct MoeRunArgs {
  std::string checkpoint, input, output;
  int layer = 1;
  int ep_size = 1, ep_rank = 0;
  bool ep_flags_given = false;  // --ep-size or --ep-rank on the command line
  bool distributed = false;
  double comm_timeout = 120;
  std::string backend;  // "" = default (highest priority usable)
  std::string recipe = "w4a8";
  std::string out_dtype = "bf16";
};

Status run_moe(const MoeRunArgs& a) {
  // Paths first, before anything is loaded or written: the input must be a regular file (a FIFO
  // is refused, not waited on) and the output must not be the input or a checkpoint file.
  K3_RETURN_IF_ERROR(check_checkpoint_arg("--checkpoint", a.checkpoint));
  K3_RETURN_IF_ERROR(check_input_file("--input", a.input));
  K3_RETURN_IF_ERROR(check_output_path("--output", a.output));
  K3_RETURN_IF_ERROR(check_output_not_input("--output", a.output, "--input", a.input));
  K3_RETURN_IF_ERROR(check_output_not_checkpoint("--output", a.output, a.checkpoint));
  auto recipe = parse_recipe(a.recipe);
  if (!recipe.is_ok()) return recipe.status();
  auto dtype = parse_out_dtype(a.out_dtype);
  if (!dtype.is_ok()) return dtype.status();
  const MoeBackend* backend = &default_moe_backend();
  if (!a.backend.empty()) {
    auto b = find_moe_backend(a.backend);
    if (!b.is_ok()) return b.status();
    if (const Status av = b.value()->available(); !av.is_ok()) {
      return unavailable("backend '" + a.backend + "' is not usable here: " + av.message());
    }
    backend = b.value();
  }
  // config.json is read once: the flags are checked against it, then the layer is loaded with it
  // (flags out of range are named first, before any config problem, as before).
  K3_RETURN_IF_ERROR(check_ep_ranges(a.ep_size, a.ep_rank));
  auto cfg = load_model_config(a.checkpoint);
  if (!cfg.is_ok()) return cfg.status();
  K3_RETURN_IF_ERROR(check_ep_flags(a.ep_size, a.ep_rank, cfg.value()));
  auto layer = load_moe_layer(cfg.value(), a.checkpoint, a.layer, a.ep_size, a.ep_rank);
  if (!layer.is_ok()) return layer.status();
  auto in = load_moe_inputs(a.input, layer.value());
  if (!in.is_ok()) return in.status();
  // The input's slots per token (a topk_ids file may hold any top_k, not the config's).
  K3_ASSIGN_OR_RETURN(const MoeProblem p, moe_problem_from_layer(layer.value(), recipe.value(), dtype.value(), in->top_k));

  std::vector<uint8_t> out(in->m * p.shape.hidden * out_dtype_size(p.out_dtype));
  const MoeInputsView view = in->view();
  const auto t0 = std::chrono::steady_clock::now();
  const BackendOptions bo = backend_options(backend->name);
  K3_RETURN_IF_ERROR(
      with_path_source(with_thread_source(k3::run_moe(*backend, p, layer->view(), view, out, bo), bo.threads)));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  K3_RETURN_IF_ERROR(write_moe_output(a.output, "--output", p, in.value(), out,
                                      {backend->name, a.checkpoint, a.layer, a.ep_size, a.ep_rank}));
  std::printf("k3 moe run: layer %d EP%d rank %d, M %lld, top-%d, %s %s -> %s, backend %s, %.3f s\n", a.layer,
              a.ep_size, a.ep_rank, static_cast<long long>(in->m), in->top_k, recipe_name(p.recipe),
              activation_name(p.activation.kind), out_dtype_name(p.out_dtype), backend->name.c_str(), secs);
  if (auto map = map_expert_parallel(p.shape, in->m, in->topk_ids); map.is_ok()) {
    std::printf("%s\n", map->to_string().c_str());
  }
  std::printf("out sha256 %s -> %s\n", sha256_hex(out).c_str(), a.output.c_str());
  return Status::ok();
}

// ---- --distributed: one EP rank per MPI process (docs/distributed.md) --------------------------

// Test hook: K3_FAULT_INJECT=ACTION:RANK[:PHASE] makes rank RANK fail at PHASE (start, load, run
// (the default), finish, shutdown): ACTION kill (SIGKILL), exit (status 3), hang (sleeps forever) or stop
// (SIGSTOP: the process is stopped, as by a debugger or a suspended container).
void maybe_inject_fault(int rank, const char* phase) {
  const char* f = std::getenv("K3_FAULT_INJECT");
  if (f == nullptr) return;
  const std::string v(f);
  const auto colon = v.find(':');
  if (colon == std::string::npos || std::atoi(v.c_str() + colon + 1) != rank) return;
  const auto colon2 = v.find(':', colon + 1);
  const std::string at = colon2 == std::string::npos ? "run" : v.substr(colon2 + 1);
  if (at != phase) return;
  const std::string what = v.substr(0, colon);
  std::fprintf(stderr, "k3 moe run: rank %d: K3_FAULT_INJECT=%s\n", rank, f);
  std::fflush(stderr);
  if (what == "kill") raise(SIGKILL);
  if (what == "stop") raise(SIGSTOP);
  if (what == "exit") std::_Exit(3);
  if (what == "hang") {
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
}

// What every rank must agree on before loading anything: the checkpoint's config.json bytes,
// the layer, the recipe, the output dtype and the expert-parallel size.
std::string run_fingerprint(const MoeRunArgs& a, const MoeModelConfig& cfg, int world) {
  return "config.json sha256 " + (cfg.sha256.empty() ? std::string("(not read)") : cfg.sha256.substr(0, 16)) +
         ", layer " + std::to_string(a.layer) + ", " + a.recipe + " -> " + a.out_dtype + ", EP" + std::to_string(world);
}

// Threads per rank: K3_NUM_THREADS when set, else the CPUs shared by the ranks on this node.
int threads_per_rank() {
  if (const char* t = std::getenv("K3_NUM_THREADS"); t != nullptr && *t != '\0') return 0;
  int local = 1;
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"}) {
    if (const char* s = std::getenv(v); s != nullptr && std::atoi(s) > 0) {
      local = std::atoi(s);
      break;
    }
  }
  const int cpus = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, (cpus > 0 ? cpus : 1) / local);
}

Status run_moe_distributed(const MoeRunArgs& a) {
  auto made = comm::make_mpi_communicator({.timeout_s = a.comm_timeout});
  if (!made.is_ok()) return made.status();
  comm::Communicator& c = *made.value();
  const int rank = c.rank(), world = c.size();
  // Every step ends with agree_on_status: all ranks leave together with the same Status, rank 0 reports it.
  set_reports_errors(rank == 0);
  // A collective that fails (kUnavailable: a peer exited, crashed, was stopped or hangs past
  // --comm-timeout) leaves the communicator unusable and a later MPI_Finalize would wait for the
  // lost peer: this rank names itself and the phase, then aborts the job with exit code 2.
  const char* phase = "start-up";
  auto peer = [&](const Status& st) -> Status {
    if (st.code() != StatusCode::kUnavailable) return st;
    std::fprintf(stderr, "k3 moe run --distributed: rank %d of %d, phase %s: %s\n", rank, world, phase,
                 st.to_string().c_str());
    std::fflush(stderr);
    c.abort(2);
    return st;  // not reached with MPI
  };
  auto agree = [&](const Status& local) { return peer(comm::agree_on_status(c, local)); };
  maybe_inject_fault(rank, "start");

  Status st = check_checkpoint_arg("--checkpoint", a.checkpoint);
  if (st.is_ok() && rank == 0) {
    st = check_input_file("--input", a.input);
    if (st.is_ok()) st = check_output_path("--output", a.output);
    if (st.is_ok()) st = check_output_not_input("--output", a.output, "--input", a.input);
    if (st.is_ok()) st = check_output_not_checkpoint("--output", a.output, a.checkpoint);
  }
  if (st.is_ok() && a.ep_flags_given && (a.ep_size != world || a.ep_rank != rank)) {
    st = invalid_argument("--ep-size " + std::to_string(a.ep_size) + " --ep-rank " + std::to_string(a.ep_rank) +
                          " disagree with the MPI job (" + std::to_string(world) + " ranks, this is rank " +
                          std::to_string(rank) + "); with --distributed leave them out: the launcher sets them");
  }
  // The backend by name (default cpu: the one with the expert-parallel seam); whether it has the
  // seam is known once its layer is prepared.
  const std::string backend_name = a.backend.empty() ? "cpu" : a.backend;
  auto backend = find_moe_backend(backend_name);
  if (st.is_ok() && !backend.is_ok()) st = Status(backend.status().code(), "--backend: " + backend.status().message());
  auto recipe = parse_recipe(a.recipe);
  auto dtype = parse_out_dtype(a.out_dtype);
  if (st.is_ok() && !recipe.is_ok()) st = recipe.status();
  if (st.is_ok() && !dtype.is_ok()) st = dtype.status();
  // config.json is read once per rank: the EP check, the cross-rank fingerprint and the loader use it.
  MoeModelConfig cfg;
  if (st.is_ok()) {
    auto loaded = load_model_config(a.checkpoint);
    if (!loaded.is_ok()) st = loaded.status();
    else cfg = std::move(loaded).value();
  }
  if (st.is_ok()) {
    if (Status e = check_ep_flags(world, rank, cfg); !e.is_ok()) {
      st = Status(e.code(), "the MPI job's " + std::to_string(world) + " ranks are the EP size (" + e.message() + ")");
    }
  }
  K3_RETURN_IF_ERROR(agree(st));
  K3_RETURN_IF_ERROR(
      peer(comm::check_same_on_all_ranks(c, "checkpoint and run options", run_fingerprint(a, cfg, world))));

  // Each rank loads its experts only; rank 0 reads (and routes) the tokens.
  phase = "loading";
  const auto t_load = std::chrono::steady_clock::now();
  auto layer = load_moe_layer(cfg, a.checkpoint, a.layer, world, rank);
  maybe_inject_fault(rank, "load");
  K3_RETURN_IF_ERROR(agree(layer.status()));
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();
  MoeInputFile in;
  Status read_st = Status::ok();
  if (rank == 0) {
    auto r = load_moe_inputs(a.input, layer.value());
    if (r.is_ok()) in = std::move(r).value();
    else read_st = r.status();
  }
  K3_RETURN_IF_ERROR(agree(read_st));
  std::vector<int32_t> top_ks(static_cast<size_t>(world));
  const int32_t my_top_k = in.top_k;
  K3_RETURN_IF_ERROR(peer(c.allgather(&my_top_k, sizeof my_top_k, top_ks.data())));
  auto prob = moe_problem_from_layer(layer.value(), recipe.value(), dtype.value(), top_ks[0]);  // rank 0's file
  K3_RETURN_IF_ERROR(agree(prob.status()));
  const MoeProblem p = prob.value();
  BackendOptions bo = backend_options(backend_name);
  if (const int per_rank = threads_per_rank(); per_rank > 0) bo.threads = per_rank;
  auto prepared = prepare_moe(*backend.value(), p, layer->view(), bo);
  K3_RETURN_IF_ERROR(agree(with_path_source(with_thread_source(prepared.status(), bo.threads))));
  const PreparedMoe& moe = *prepared.value();
  if (Status seam = moe.expert_parallel(); !seam.is_ok()) {
    return agree(Status(seam.code(), "--backend " + backend_name + ": " + seam.message()));
  }
  K3_RETURN_IF_ERROR(agree(Status::ok()));  // every rank's backend has the seam
  std::vector<uint8_t> ws(static_cast<size_t>(moe.workspace_bytes()));
  std::vector<uint8_t> out(static_cast<size_t>(in.m * p.shape.hidden * out_dtype_size(p.out_dtype)));

  phase = "run";
  maybe_inject_fault(rank, "run");
  const MoeInputsView view = in.view();
  comm::EpRunStats stats;
  const auto t0 = std::chrono::steady_clock::now();
  Status run_st = peer(comm::ep_moe_run(c, moe, view, ws, out, &stats, {.threads = bo.threads}));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!run_st.is_ok()) return run_st;  // ep_moe_run agrees on its errors itself

  phase = "finish";
  maybe_inject_fault(rank, "finish");

  // Per-rank figures to rank 0: rows received, slots computed, bytes sent (dispatch + combine).
  const int64_t mine[4] = {stats.rows_received, stats.slots_computed, stats.dispatch_bytes_sent + stats.combine_bytes_sent,
                           static_cast<int64_t>(load_s * 1e3)};
  std::vector<int64_t> all(static_cast<size_t>(4 * world));
  K3_RETURN_IF_ERROR(peer(c.allgather(mine, sizeof mine, all.data())));
  Status write_st = Status::ok();
  if (rank == 0) {
    write_st = write_moe_output(a.output, "--output", p, in, out, {backend_name + " (distributed, mpi)", a.checkpoint, a.layer, world, -1});
  }
  K3_RETURN_IF_ERROR(agree(write_st));
  if (rank == 0) {
    std::printf("k3 moe run: layer %d, distributed over %d MPI ranks (EP%d, %d threads each), M %lld, top-%d, %s %s -> %s, "
                "backend %s, %.3f s (dispatch %.3f, experts %.3f, combine %.3f on rank 0)\n",
                a.layer, world, world, bo.threads > 0 ? bo.threads : hardware_thread_count(), static_cast<long long>(in.m),
                in.top_k, recipe_name(p.recipe), activation_name(p.activation.kind), out_dtype_name(p.out_dtype),
                backend_name.c_str(), secs, stats.dispatch_s, stats.experts_s,
                stats.combine_s);
    for (int q = 0; q < world; ++q) {
      const int64_t* v = all.data() + 4 * q;
      const ExpertRange held = expert_range(p.shape.num_experts, world, q);
      std::printf("  rank %d: experts [%d, %d), loaded in %lld ms, %lld rows received, %lld slots computed, %lld bytes sent\n",
                  q, held.first, held.first + held.count, static_cast<long long>(v[3]),
                  static_cast<long long>(v[0]), static_cast<long long>(v[1]), static_cast<long long>(v[2]));
    }
    std::printf("out sha256 %s -> %s\n", sha256_hex(out).c_str(), a.output.c_str());
    std::fflush(stdout);
  }
  // Shutdown: one last bounded collective, so that a peer lost now aborts the job here instead of
  // holding every rank in MPI_Finalize.
  phase = "shutdown";
  maybe_inject_fault(rank, "shutdown");
  K3_RETURN_IF_ERROR(peer(c.barrier()));
  return Status::ok();
}

const CommandRegistration kRegistration("moe", 30, [](CLI::App& app) -> CommandRun {
  auto* cmd = app.add_subcommand("moe", "Run a checkpoint's fused-MoE layer on your own tensors");
  cmd->require_subcommand(1);
  auto* run = cmd->add_subcommand("run", "Routed experts of one layer: input x + logits or topk ids/weights -> out");
  auto a = std::make_shared<MoeRunArgs>();
  run->add_option("--checkpoint", a->checkpoint, "Checkpoint directory (config.json + safetensors)")->required();
  run->add_option("--layer", a->layer, "MoE layer")->required();
  run->add_option("--input", a->input, "safetensors with x [M, K] and logits [M, E] or topk_ids + topk_weights")
      ->required();
  run->add_option("--output", a->output, "safetensors to write: out, topk_ids, topk_weights")->required();
  run->add_option("--backend", a->backend, "Backend (default: the fastest usable one)");
  auto* ep_size = run->add_option("--ep-size", a->ep_size, "Expert-parallel ranks")->capture_default_str();
  auto* ep_rank = run->add_option("--ep-rank", a->ep_rank, "This rank (its experts only; other slots contribute zero)")
      ->capture_default_str();
  run->add_flag("--distributed", a->distributed,
                "Under mpirun: one EP rank per process; each loads its experts, rank 0 reads --input and writes --output");
  run->add_option("--comm-timeout", a->comm_timeout, "--distributed: seconds a collective may wait for a peer")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 86400.0));
  run->add_option("--recipe", a->recipe, "w4a8 (MXFP8 x MXFP4) or w4a16 (BF16 x MXFP4)")->capture_default_str();
  run->add_option("--out-dtype", a->out_dtype, "bf16, fp16 or fp32")->capture_default_str();
  return [a, ep_size, ep_rank]() {
    a->ep_flags_given = ep_size->count() > 0 || ep_rank->count() > 0;
    return a->distributed ? run_moe_distributed(*a) : run_moe(*a);
  };
});

}  // namespace
}  // namespace k3::tool
