// libFuzzer target for the input path of `k3 kda run`: a safetensors image -> k3::kda::
// load_input_file (tensor names, dtypes, shapes, cu_seqlens, sizes checked before allocating) ->
// the FP32 and FP64 references and the CPU backend (scalar level, recurrent and chunked) on the
// loaded tensors. Any byte string must give either tensors that every backend accepts and runs,
// or an error; never a crash, a hang, an out-of-bounds read (ASan) or undefined behaviour (UBSan).
// On inputs whose finite values cannot overflow FP32 (below), every backend must also give the
// same NaN / Inf class for every output and state element (docs/kda.md, "Non-finite values"),
// and no output may be +-Inf. The image's "__metadata__" may set the `kda run` flags --gate and
// --layout (keys "gate", "layout"), so the fuzzer reaches the gated modes and both layouts.
// Run: scripts/fuzz.sh SECONDS kda_input
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "k3/formats.hpp"
#include "k3/cpu_kda.hpp"
#include "k3/kda.hpp"
#include "k3/harness/kda_io.hpp"
#include "k3/safetensors.hpp"
#include "k3/system.hpp"

namespace {

[[noreturn]] void violated(const char* what, const std::string& detail) {
  __builtin_printf("invariant violated: %s: %s\n", what, detail.c_str());
  std::abort();
}

// Runs the backends when the problem is small enough to keep the fuzzer fast.
constexpr int64_t kMaxWork = int64_t{1} << 16;    // T * H * K * V
constexpr int64_t kMaxStates = int64_t{1} << 16;  // N * H * K * V

// Finite values small enough that no backend overflows FP32: |v|, |initial_state| <= 1e4, beta
// in [0, 1] when given (logits are squashed), log decays <= 0 (the gated modes always are), the
// default scale and lower bound. Non-finite values are allowed anywhere: the policy covers them.
bool tame(const k3::kda::InputFile& in) {
  auto small = [](const std::vector<float>& x, float lo, float hi) {
    for (const float y : x) {
      if (std::isfinite(y) && (y < lo || y > hi)) return false;
    }
    return true;
  };
  const auto& c = in.cfg;
  std::vector<float> v = in.v32;
  for (const uint16_t b : in.v16) v.push_back(k3::bf16_to_f32(b));
  return small(v, -1e4f, 1e4f) && small(in.initial_state, -1e4f, 1e4f) &&
         (c.beta_logits || small(in.beta, 0.0f, 1.0f)) &&
         (c.gate != k3::kda::GateMode::kLogDecay || small(in.g, -INFINITY, 0.0f));
}

int cls(double x) { return std::isnan(x) ? 1 : (std::isinf(x) ? 2 : 0); }

template <typename A, typename B>
void same_classes(const char* what, const std::vector<A>& a, const std::vector<B>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (cls(static_cast<double>(a[i])) != cls(static_cast<double>(b[i]))) {
      violated("backends disagree on the NaN / Inf class", std::string(what) + " element " + std::to_string(i) +
                                                              ": " + std::to_string(static_cast<double>(a[i])) +
                                                              " vs " + std::to_string(static_cast<double>(b[i])));
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = k3::st::File::view(std::span<const uint8_t>(data, size), "fuzz.safetensors");
  if (!file) return 0;  // the safetensors parser has its own target (fuzz_safetensors)
  const k3::st::File& f = file.value();
  k3::kda::InputFileOptions opt;
  if (auto it = f.metadata().find("gate"); it != f.metadata().end()) opt.gate = it->second;
  if (auto it = f.metadata().find("layout"); it != f.metadata().end()) opt.layout = it->second;
  auto loaded = k3::kda::load_input_file(f, opt);
  if (!loaded) {
    if (loaded.status().message().empty()) violated("an error without a message", "");
    return 0;
  }
  const k3::kda::InputFile& in = loaded.value();
  auto elems = k3::kda::output_elements(in, 8);
  if (!elems) return 0;  // the FP64 outputs may exceed the memory limit where FP32 ones do not
  const auto& c = in.cfg;
  int64_t work = 0, states = 0;
  if (__builtin_mul_overflow(in.tokens, c.num_heads * c.head_k * c.head_v, &work) ||
      __builtin_mul_overflow(in.seqs, c.num_heads * c.head_k * c.head_v, &states) || work > kMaxWork ||
      states > kMaxStates) {
    return 0;
  }
  // load_input_file promised tensors that every backend accepts: they must all run.
  const auto inputs = in.inputs();
  std::vector<double> o64(static_cast<size_t>(elems->o)), s64(static_cast<size_t>(elems->final_state));
  if (k3::Status st = k3::kda::reference_fp64(c, inputs, o64, s64); !st.is_ok()) {
    violated("reference_fp64 refused a loaded file", st.message());
  }
  std::vector<float> o(o64.size()), s(s64.size());
  if (k3::Status st = k3::kda::reference_fp32(c, inputs, {o, s}); !st.is_ok()) {
    violated("reference_fp32 refused a loaded file", st.message());
  }
  const bool check = tame(in);
  if (check) {
    for (const double x : o64) {
      if (std::isinf(x)) violated("an output is +-Inf", "fp64-reference");
    }
    same_classes("fp32-reference o", o, o64);
    same_classes("fp32-reference final_state", s, s64);
  }
  for (const auto algo : {k3::kda::Algorithm::kRecurrent, k3::kda::Algorithm::kChunked}) {
    k3::cpu::KdaOptions co;
    co.threads = 1;
    co.algorithm = algo;
    co.isa = k3::IsaLevel::kScalar;
    std::vector<float> oc(o.size()), sc(s.size());
    if (k3::Status st = k3::cpu::prefill(c, inputs, {oc, sc}, co); !st.is_ok()) {
      violated("the CPU backend refused a loaded file", st.message());
    }
    if (check) {
      same_classes(algo == k3::kda::Algorithm::kChunked ? "cpu chunked o" : "cpu recurrent o", oc, o64);
      same_classes(algo == k3::kda::Algorithm::kChunked ? "cpu chunked final_state" : "cpu recurrent final_state", sc,
                   s64);
    }
  }
  return 0;
}
