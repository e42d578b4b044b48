// `k3 kda run --input FILE --output FILE [--backend NAME]`: runs the KDA core on tensors a user
// brings in a safetensors file and writes `o` and `final_state`, so results can be compared with
// another engine. The backend comes from the library's registry (k3/backend.hpp); the exact FP64
// oracle is the one name outside it. The file is read and checked by kda::load_input_file
// (k3/harness/kda_io.hpp lists the tensor names and shapes).
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend_options.hpp"
#include "command.hpp"
#include "k3/harness/atomic_file.hpp"
#include "k3/backend.hpp"
#include "k3/build_info.hpp"
#include "k3/kda.hpp"
#include "k3/harness/kda_io.hpp"
#include "k3/safetensors.hpp"
#include "k3/system.hpp"

namespace k3::tool {
namespace {

struct RunArgs {
  std::string input, output;
  std::string gate;  // "" = from the tensors present
  std::string layout = "k_first";
  std::string backend;  // "" = default_kda_backend(); a registry name, fp32-reference or fp64-reference
  std::string algorithm = "auto";
  float scale = 0.0f;
  float lower_bound = -5.0f;
  bool no_l2norm = false;
  int threads = 0;
};

template <typename T>
std::span<const uint8_t> as_bytes(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

// --backend: a KDA backend of the registry (k3/backend.hpp), "fp32-reference" (the older name of
// "reference", still accepted) or "fp64-reference", the exact FP64 oracle, which is not a
// backend: no other backend is held to it bit for bit, it is what they are measured against.
struct Choice {
  const KdaBackend* backend = nullptr;  // null: fp64-reference
  std::string name;
};

std::string backend_choices() {
  std::string s;
  for (const auto& b : kda_backends()) s += b.name + ", ";
  return s + "fp32-reference (= reference), fp64-reference";
}

Result<Choice> choose_backend(const std::string& name) {
  if (name == "fp64-reference") return Choice{nullptr, name};
  if (name.empty()) return Choice{&default_kda_backend(), default_kda_backend().name};
  auto b = find_kda_backend(name == "fp32-reference" ? "reference" : name);
  if (!b.is_ok()) return invalid_argument("--backend " + name + " is unknown (known: " + backend_choices() + ")");
  if (Status st = b.value()->available(); !st.is_ok()) {
    return Status(st.code(), "--backend " + name + " is not usable here: " + st.message());
  }
  return Choice{b.value(), b.value()->name};
}

Status run(const RunArgs& a) {
  // Paths first: the input must be a regular file (a FIFO is refused, not waited on) and the
  // output must not be the input.
  K3_RETURN_IF_ERROR(check_input_file("--input", a.input));
  K3_RETURN_IF_ERROR(check_output_path("--output", a.output));
  K3_RETURN_IF_ERROR(check_output_not_input("--output", a.output, "--input", a.input));
  auto choice = choose_backend(a.backend);
  if (!choice.is_ok()) return choice.status();
  const Choice& ch = choice.value();
  auto alg = kda::parse_algorithm(a.algorithm);
  if (!alg.is_ok()) return alg.status();
  if (ch.backend == nullptr && alg.value() == kda::Algorithm::kChunked) {
    return invalid_argument("--algorithm chunked: fp64-reference is token-recurrent only (auto or recurrent)");
  }
  // The tool's options (K3_NUM_THREADS, K3_ISA), --threads over the environment's count.
  BackendOptions bo = backend_options();
  if (a.threads != 0) bo.threads = a.threads;
  bo.kda_algorithm = alg.value();
  auto explain = [&](const Status& st) { return a.threads != 0 ? st : with_thread_source(st, bo.threads); };
  auto file = st::File::open(a.input);
  if (!file.is_ok()) return file.status();
  kda::InputFileOptions read_opt;
  read_opt.gate = a.gate;
  read_opt.layout = a.layout;
  read_opt.scale = a.scale;
  read_opt.lower_bound = a.lower_bound;
  read_opt.l2norm_qk = !a.no_l2norm;
  auto loaded = kda::load_input_file(file.value(), read_opt);
  if (!loaded.is_ok()) return loaded.status();
  const kda::InputFile& L = loaded.value();
  const kda::KdaInputs in = L.inputs();
  const auto& c = L.cfg;
  // Output sizes come from the file's shapes (N from cu_seqlens): checked before allocating.
  auto elems = kda::output_elements(L, ch.backend == nullptr ? 8 : 4);
  if (!elems.is_ok()) return elems.status();
  const int64_t o_size = elems->o, s_size = elems->final_state;
  const bool kf = c.layout == kda::StateLayout::kKFirst;
  const std::vector<int64_t> o_shape = {L.tokens, c.num_heads, c.head_v};
  const std::vector<int64_t> s_shape = {L.seqs, c.num_heads, kf ? c.head_k : c.head_v, kf ? c.head_v : c.head_k};
  st::Writer w;
  // What ran: the references are token-recurrent whatever --algorithm says (auto / recurrent).
  const bool recurrent_only = ch.backend == nullptr || ch.name == "reference";
  const std::string algo = recurrent_only ? "recurrent" : kda::algorithm_name(alg.value());
  if (ch.backend == nullptr) {
    std::vector<double> o(static_cast<size_t>(o_size)), s(static_cast<size_t>(s_size));
    K3_RETURN_IF_ERROR(explain(kda::reference_fp64(c, in, o, s, bo.threads)));
    K3_RETURN_IF_ERROR(w.add("o", st::DType::kF64, o_shape, as_bytes(o)));
    K3_RETURN_IF_ERROR(w.add("final_state", st::DType::kF64, s_shape, as_bytes(s)));
  } else {
    std::vector<float> o(static_cast<size_t>(o_size)), s(static_cast<size_t>(s_size));
    K3_RETURN_IF_ERROR(explain(run_kda_prefill(*ch.backend, c, in, {o, s}, bo)));
    K3_RETURN_IF_ERROR(w.add("o", st::DType::kF32, o_shape, as_bytes(o)));
    K3_RETURN_IF_ERROR(w.add("final_state", st::DType::kF32, s_shape, as_bytes(s)));
  }
  std::map<std::string, std::string> meta = {{"k3_version", build::kVersion},
                                              {"backend", ch.name},
                                              {"algorithm", algo},
                                              {"gate", kda::gate_mode_name(c.gate)},
                                              {"state_layout", kda::state_layout_name(c.layout)},
                                              {"beta", c.beta_logits ? "logits" : "given"},
                                              {"scale", std::to_string(c.effective_scale())}};
  // The SIMD level passed to the backend (K3_ISA or the best one); the references have none.
  const std::string isa = recurrent_only ? "" : isa_level_name(bo.isa.value_or(best_isa_level()));
  if (!isa.empty()) meta["isa"] = isa;
  w.set_metadata(std::move(meta));
  K3_RETURN_IF_ERROR(w.write(a.output, "--output"));
  std::printf("k3 kda run: T = %lld, N = %lld, H = %lld, K = %lld, V = %lld, gate %s, %s state, backend %s (%s%s) -> %s\n",
              static_cast<long long>(L.tokens), static_cast<long long>(L.seqs), static_cast<long long>(c.num_heads),
              static_cast<long long>(c.head_k), static_cast<long long>(c.head_v), kda::gate_mode_name(c.gate),
              kda::state_layout_name(c.layout), ch.name.c_str(), algo.c_str(), isa.empty() ? "" : (", isa " + isa).c_str(),
              a.output.c_str());
  return Status::ok();
}

const CommandRegistration kRegistration("kda", 30, [](CLI::App& app) -> CommandRun {
  auto* cmd = app.add_subcommand("kda", "Kimi Delta Attention on user tensors");
  cmd->require_subcommand(1);
  auto* r = cmd->add_subcommand("run", "Run the KDA core on a safetensors file; writes o and final_state");
  auto a = std::make_shared<RunArgs>();
  r->add_option("--input", a->input, "safetensors file with q, k, v, g, beta | beta_logits [, A_log, dt_bias, "
                                     "cu_seqlens, initial_state]")
      ->required();
  r->add_option("--output", a->output, "safetensors file to write (o, final_state)")->required();
  r->add_option("--gate", a->gate, "log_decay | safe | softplus (default: safe if A_log is present, else log_decay)");
  r->add_option("--layout", a->layout, "State layout: k_first [N,H,K,V] or v_first [N,H,V,K]")->capture_default_str();
  r->add_option("--backend", a->backend,
                "KDA backend: " + backend_choices() + " (default: the usable one of highest priority, " +
                    default_kda_backend().name + ")");
  r->add_option("--algorithm", a->algorithm, "auto | recurrent | chunked (the references: recurrent only)")
      ->capture_default_str();
  r->add_option("--scale", a->scale, "Output scale (0: K^-0.5)")->capture_default_str();
  r->add_option("--lower-bound", a->lower_bound, "lb of the safe gate")->capture_default_str();
  r->add_flag("--no-l2norm", a->no_l2norm, "q and k are already normalized (no L2 norm inside)");
  r->add_option("--threads", a->threads, "CPU threads (default: K3_NUM_THREADS or all CPUs)")
      ->check(CLI::Range(0, k3::kMaxThreadCount));
  return [a]() { return run(*a); };
});

}  // namespace
}  // namespace k3::tool
