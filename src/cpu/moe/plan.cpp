// plan(): checks the problem and the capabilities, fixes the blocking, sizes the workspace.
#include <algorithm>
#include <string>

#include "cpu/moe/layout.hpp"
#include "cpu/moe/workspace.hpp"
#include "k3/cpu_moe.hpp"
#include "k3/system.hpp"

namespace k3::cpu {
namespace detail {
namespace {
int64_t align64(int64_t v) { return (v + 63) & ~int64_t{63}; }
}  // namespace

WorkspaceLayout workspace_layout(const MoeProblem& p, IsaLevel isa, int threads, int64_t chunk_tokens) {
  WorkspaceLayout w;
  const int64_t c = chunk_tokens, topk = p.shape.top_k, s = c * topk;
  const int64_t k = p.shape.hidden, n = p.shape.intermediate, e = p.shape.local_experts();
  const int64_t ob = operand_bytes(isa);
  w.chunk_tokens = c;
  w.slot_rows = s;
  int64_t at = 0;
  auto take = [&at](int64_t bytes) {
    const int64_t o = at;
    at += align64(bytes);
    return o;
  };
  w.slot_row = take(s * 4);
  w.row_token = take(s * 4);
  w.expert_offset = take((e + 1) * 8);
  w.used_experts = take(e * 4);
  w.x_op = take(c * k * ob);
  w.x_shift = take(c * 4);
  const bool views = uses_int_views(isa);
  w.x_view = take(views ? c * int_view_bytes(k) : 0);
  const bool w4a8 = p.recipe == Recipe::kW4A8;
  w.h_q = take(w4a8 ? s * n : 0);
  w.h_s = take(w4a8 ? s * (n / kBlock) : 0);
  w.h_op = take(s * n * ob);
  w.h_shift = take(s * 4);
  w.h_view = take(views ? s * int_view_bytes(n) : 0);
  w.y = take(s * k * 4);
  w.per_thread = at;
  int64_t pt = 0;
  auto take_pt = [&pt](int64_t bytes) {
    const int64_t o = pt;
    pt += align64(bytes);
    return o;
  };
  const int64_t kn = std::max(k, n);
  w.pt_totals = take_pt(int64_t{kRowGroup} * kFc1Groups * kLanes * 4);
  w.pt_panel = take_pt(kPanelScratchBytes);
  w.pt_rows = take_pt(int64_t{kRowGroup} * static_cast<int64_t>(sizeof(void*)));
  w.pt_views = take_pt(int64_t{kRowGroup} * static_cast<int64_t>(sizeof(void*)));
  w.pt_acc = take_pt(std::max<int64_t>(k, 3 * kBlock) * 4);
  w.pt_codes = take_pt(kn + kn / kBlock);
  w.per_thread_bytes = pt;
  w.total = at + pt * threads + 64;
  return w;
}
}  // namespace detail

std::string MoePlan::describe() const {
  return std::string("cpu moe: ") + recipe_name(problem.recipe) + " " + activation_name(problem.activation.kind) +
         " -> " + out_dtype_name(problem.out_dtype) + ", isa " + isa_level_name(isa) + " (kernel " + blocking.kernel + "), " +
         std::to_string(threads) +
         " thread(s), K " + std::to_string(problem.shape.hidden) + " N " + std::to_string(problem.shape.intermediate) +
         " E_local " + std::to_string(problem.shape.local_experts()) + " top-" + std::to_string(problem.shape.top_k) +
         ", chunk " + std::to_string(chunk_tokens) + " tokens (max " + std::to_string(max_tokens) + "), tiles " +
         std::to_string(blocking.gemm1_tiles) + "x64 rows (FC1) / " + std::to_string(blocking.gemm2_tiles) +
         "x32 rows (FC2), direct <= " + std::to_string(blocking.direct_max_rows) + " rows, panel " +
         std::to_string(blocking.panel_blocks) + " blocks x " + blocking.register_tile + " register tiles, workspace " +
         std::to_string(workspace_bytes >> 10) + " KiB";
}

Result<MoePlan> plan(const MoeProblem& problem, const MoeOptions& options) {
  K3_RETURN_IF_ERROR(validate_moe_shape(problem.shape));
  IsaLevel isa;
  if (options.isa.has_value()) {
    isa = *options.isa;
    if (static_cast<int>(isa) > static_cast<int>(best_isa_level())) {
      return unsupported(std::string("isa = ") + isa_level_name(isa) + " is not supported by this CPU (best: " +
                         isa_level_name(best_isa_level()) + ")");
    }
  } else {
    isa = best_isa_level();  // a hardware fact: the library reads no K3_ISA (tools pass it in)
  }
  if (options.threads < 0 || options.threads > kMaxThreads) {
    return invalid_argument("threads = " + std::to_string(options.threads) + " must be in [0, " +
                            std::to_string(kMaxThreads) + "] (0 = all logical CPUs)");
  }
  // 0: all logical CPUs of the machine, at most kMaxThreads (a default never fails).
  const int threads = options.threads > 0 ? options.threads : std::min(hardware_thread_count(), kMaxThreads);
  if (options.max_tokens < 1 || options.max_tokens > (int64_t{1} << 24)) {
    return invalid_argument("max_tokens = " + std::to_string(options.max_tokens) + " must be in [1, 16777216]");
  }
  if (options.chunk_tokens < 8 || options.chunk_tokens > 4096) {
    return invalid_argument("chunk_tokens = " + std::to_string(options.chunk_tokens) + " must be in [8, 4096]");
  }
  const auto& a = problem.activation;
  if (a.kind == ActivationKind::kSiTU && !(a.situ_beta > 0.f && a.situ_linear_beta > 0.f)) {
    return invalid_argument("situ_beta = " + std::to_string(a.situ_beta) + " and situ_linear_beta = " +
                            std::to_string(a.situ_linear_beta) + " must be > 0");
  }
  MoePlan p;
  p.problem = problem;
  p.isa = isa;
  p.avx_vnni = options.avx_vnni;
  p.threads = threads;
  p.max_tokens = options.max_tokens;
  p.chunk_tokens = std::min(options.max_tokens, options.chunk_tokens);
  p.blocking.gemm1_tiles = problem.shape.intermediate / detail::kBlock;
  p.blocking.gemm2_tiles = problem.shape.hidden / detail::kBlock;
  switch (isa) {
    case IsaLevel::kAvx512Bf16:  // VDPBF16PS on BF16 operands (gemm_bf16.cpp); VNNI: exact int16 blocks
      p.blocking.kernel = detail::uses_int_views(isa) ? "avx512bf16 vdpbf16ps + int16 vpdpwssd" : "avx512bf16 vdpbf16ps";
      p.blocking.direct_max_rows = detail::kDirectMaxRows;
      p.blocking.panel_blocks = detail::kPanelBlocks;
      p.blocking.register_tile = "3x64 / 6x32";
      break;
    case IsaLevel::kAvx512:  // FP32 operands: the AVX2 kernel (gemm_avx2.cpp); AVX512-VNNI: VPDPWSSD
    case IsaLevel::kAvx2:
      switch (detail::int_mac_form(isa, options.avx_vnni)) {
        case detail::IntMac::kAvx512Vnni: p.blocking.kernel = "avx2 fma + int16 vpdpwssd"; break;
        case detail::IntMac::kAvxVnni: p.blocking.kernel = "avx2 fma + int16 vpdpwssd (avx-vnni)"; break;
        case detail::IntMac::kMadd: p.blocking.kernel = "avx2 fma + int16 madd"; break;
      }
      p.blocking.direct_max_rows = detail::kDirectMaxRowsAvx2;
      p.blocking.panel_blocks = detail::kPanelBlocksAvx2;
      p.blocking.register_tile = "6x16";
      break;
    case IsaLevel::kScalar:  // portable C++ (gemm_fp32.cpp)
      p.blocking.kernel = "portable";
      p.blocking.direct_max_rows = 0;
      p.blocking.panel_blocks = 1;
      p.blocking.register_tile = "1x64";
      break;
  }
  p.blocking.row_group = detail::kRowGroup;
  p.workspace_bytes = detail::workspace_layout(problem, isa, threads, p.chunk_tokens).total;
  return p;
}

}  // namespace k3::cpu
