// libFuzzer target for the input path of `k3 kda run`: a safetensors image -> k3::kda::
// load_input_file (tensor names, dtypes, shapes, cu_seqlens, sizes checked before allocating) ->
// the FP32 and FP64 references on the loaded tensors. Any byte string must give either tensors
// that the backends accept and run, or an error; never a crash, a hang, an out-of-bounds read
// (ASan) or undefined behaviour (UBSan). The image's "__metadata__" may set the `kda run` flags
// --gate and --layout (keys "gate", "layout"), so the fuzzer reaches the gated modes and both
// layouts. Run: scripts/fuzz.sh SECONDS kda_input
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "k3/kda.hpp"
#include "k3/kda_io.hpp"
#include "k3/safetensors.hpp"

namespace {

[[noreturn]] void violated(const char* what, const std::string& detail) {
  __builtin_printf("invariant violated: %s: %s\n", what, detail.c_str());
  std::abort();
}

// Runs the references when the problem is small enough to keep the fuzzer fast.
constexpr int64_t kMaxWork = int64_t{1} << 16;  // T * H * K * V
constexpr int64_t kMaxStates = int64_t{1} << 16;  // N * H * K * V

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
  // load_input_file promised tensors that every backend accepts: the references must run.
  std::vector<float> o(static_cast<size_t>(elems->o)), s(static_cast<size_t>(elems->final_state));
  if (k3::Status st = k3::kda::reference_fp32(c, in.inputs(), {o, s}); !st.is_ok()) {
    violated("reference_fp32 refused a loaded file", st.message());
  }
  std::vector<double> o64(o.size()), s64(s.size());
  if (k3::Status st = k3::kda::reference_fp64(c, in.inputs(), o64, s64); !st.is_ok()) {
    violated("reference_fp64 refused a loaded file", st.message());
  }
  return 0;
}
