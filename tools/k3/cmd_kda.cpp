// `k3 kda run --input FILE --output FILE`: runs the KDA core on tensors a user brings in a
// safetensors file and writes `o` and `final_state`, so results can be compared with another
// engine. The file is read and checked by kda::load_input_file (k3/kda_io.hpp lists the tensor
// names and shapes).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "command.hpp"
#include "k3/atomic_file.hpp"
#include "k3/build_info.hpp"
#include "k3/kda.hpp"
#include "k3/kda_io.hpp"
#include "k3/safetensors.hpp"

namespace k3::tool {
namespace {

struct RunArgs {
  std::string input, output;
  std::string gate;  // "" = from the tensors present
  std::string layout = "k_first";
  std::string backend = "cpu";  // cpu | fp32-reference | fp64-reference
  std::string algorithm = "auto";
  float scale = 0.0f;
  float lower_bound = -5.0f;
  bool no_l2norm = false;
  int threads = 0;
};

int fail(const Status& st) {
  std::fprintf(stderr, "k3 kda run: %s\n", st.to_string().c_str());
  return 2;
}

#define K3_RETURN_IF_ERROR_INT(expr)              \
  do {                                            \
    const ::k3::Status k3_st_ = (expr);           \
    if (!k3_st_.is_ok()) return fail(k3_st_);     \
  } while (0)

template <typename T>
std::span<const uint8_t> as_bytes(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

int run(const RunArgs& a) {
  // Paths first: the input must be a regular file (a FIFO is refused, not waited on) and the
  // output must not be the input.
  K3_RETURN_IF_ERROR_INT(check_input_file("--input", a.input));
  K3_RETURN_IF_ERROR_INT(check_output_path("--output", a.output));
  K3_RETURN_IF_ERROR_INT(check_output_not_input("--output", a.output, "--input", a.input));
  auto file = st::File::open(a.input);
  if (!file.is_ok()) return fail(file.status());
  kda::InputFileOptions read_opt;
  read_opt.gate = a.gate;
  read_opt.layout = a.layout;
  read_opt.scale = a.scale;
  read_opt.lower_bound = a.lower_bound;
  read_opt.l2norm_qk = !a.no_l2norm;
  auto loaded = kda::load_input_file(file.value(), read_opt);
  if (!loaded.is_ok()) return fail(loaded.status());
  const kda::InputFile& L = loaded.value();
  const kda::KdaInputs in = L.inputs();
  const auto& c = L.cfg;
  // Output sizes come from the file's shapes (N from cu_seqlens): checked before allocating.
  auto elems = kda::output_elements(L, a.backend == "fp64-reference" ? 8 : 4);
  if (!elems.is_ok()) return fail(elems.status());
  const int64_t o_size = elems->o, s_size = elems->final_state;
  const bool kf = c.layout == kda::StateLayout::kKFirst;
  const std::vector<int64_t> o_shape = {L.tokens, c.num_heads, c.head_v};
  const std::vector<int64_t> s_shape = {L.seqs, c.num_heads, kf ? c.head_k : c.head_v, kf ? c.head_v : c.head_k};
  st::Writer w;
  std::string algo = a.algorithm;
  if (a.backend == "fp64-reference") {
    std::vector<double> o(static_cast<size_t>(o_size)), s(static_cast<size_t>(s_size));
    if (Status st = kda::reference_fp64(c, in, o, s); !st.is_ok()) return fail(st);
    K3_RETURN_IF_ERROR_INT(w.add("o", st::DType::kF64, o_shape, as_bytes(o)));
    K3_RETURN_IF_ERROR_INT(w.add("final_state", st::DType::kF64, s_shape, as_bytes(s)));
    algo = "recurrent";
  } else {
    std::vector<float> o(static_cast<size_t>(o_size)), s(static_cast<size_t>(s_size));
    if (a.backend == "fp32-reference") {
      if (Status st = kda::reference_fp32(c, in, {o, s}); !st.is_ok()) return fail(st);
      algo = "recurrent";
    } else if (a.backend == "cpu") {
      auto alg = kda::parse_algorithm(a.algorithm);
      if (!alg.is_ok()) return fail(alg.status());
      kda::CpuOptions opt;
      opt.threads = a.threads;
      opt.algorithm = alg.value();
      if (Status st = kda::prefill(c, in, {o, s}, opt); !st.is_ok()) return fail(st);
    } else {
      return fail(invalid_argument("--backend " + a.backend + " is unknown (expected cpu, fp32-reference or fp64-reference)"));
    }
    K3_RETURN_IF_ERROR_INT(w.add("o", st::DType::kF32, o_shape, as_bytes(o)));
    K3_RETURN_IF_ERROR_INT(w.add("final_state", st::DType::kF32, s_shape, as_bytes(s)));
  }
  w.set_metadata({{"k3_version", build::kVersion},
                  {"backend", a.backend},
                  {"algorithm", algo},
                  {"gate", kda::gate_mode_name(c.gate)},
                  {"state_layout", kda::state_layout_name(c.layout)},
                  {"beta", c.beta_logits ? "logits" : "given"},
                  {"scale", std::to_string(c.effective_scale())}});
  if (Status st = w.write(a.output, "--output"); !st.is_ok()) return fail(st);
  std::printf("k3 kda run: T = %lld, N = %lld, H = %lld, K = %lld, V = %lld, gate %s, %s state, backend %s (%s) -> %s\n",
              static_cast<long long>(L.tokens), static_cast<long long>(L.seqs), static_cast<long long>(c.num_heads),
              static_cast<long long>(c.head_k), static_cast<long long>(c.head_v), kda::gate_mode_name(c.gate),
              kda::state_layout_name(c.layout), a.backend.c_str(), algo.c_str(), a.output.c_str());
  return 0;
}

const CommandRegistration kRegistration("kda", 30, [](CLI::App& app) -> std::function<int()> {
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
  r->add_option("--backend", a->backend, "cpu | fp32-reference | fp64-reference")->capture_default_str();
  r->add_option("--algorithm", a->algorithm, "CPU: auto | recurrent | chunked")->capture_default_str();
  r->add_option("--scale", a->scale, "Output scale (0: K^-0.5)")->capture_default_str();
  r->add_option("--lower-bound", a->lower_bound, "lb of the safe gate")->capture_default_str();
  r->add_flag("--no-l2norm", a->no_l2norm, "q and k are already normalized (no L2 norm inside)");
  r->add_option("--threads", a->threads, "CPU threads (default: K3_NUM_THREADS or all CPUs)");
  return [a]() { return run(*a); };
});

}  // namespace
}  // namespace k3::tool
