// Host-side planning of the CUDA fused-MoE backend: shape and capability checks, tile choice and
// workspace layout. Pure C++ (no CUDA), so every decision is unit-tested without a GPU.
#include <algorithm>
#include <sstream>
#include <string>

#include "k3/cuda_moe.hpp"
#include "k3/mx.hpp"

namespace k3::cuda {

namespace {
constexpr MoePath kAllPaths[] = {MoePath::kPrefill, MoePath::kDecodeSplitK, MoePath::kPrefillSm90,
                                  MoePath::kW4a8Sm120Cutlass};
}  // namespace

const char* moe_path_name(MoePath p) {
  switch (p) {
    case MoePath::kPrefill: return "prefill";
    case MoePath::kDecodeSplitK: return "decode-splitk";
    case MoePath::kPrefillSm90: return "prefill-sm90";
    case MoePath::kW4a8Sm120Cutlass: return "w4a8-sm120-cutlass";
  }
  return "?";
}

Result<MoePath> moe_path_from_name(const std::string& name) {
  std::string names;
  for (MoePath p : kAllPaths) {
    if (name == moe_path_name(p)) return p;
    names += (names.empty() ? "" : ", ") + std::string(moe_path_name(p));
  }
  return invalid_argument("CUDA MoE path = '" + name + "' is not one of " + names);
}

namespace {

int64_t align256(int64_t v) { return (v + 255) / 256 * 256; }

std::string arch_list(const std::vector<int>& archs) {
  std::string s;
  for (int a : archs) s += (s.empty() ? "sm_" : ", sm_") + std::to_string(a);
  return s.empty() ? "none" : s;
}

}  // namespace

std::string MoePlan::describe() const {
  std::ostringstream os;
  os << "cuda moe plan: " << recipe_name(problem.recipe) << " " << activation_name(problem.activation.kind) << " -> "
     << out_dtype_name(problem.out_dtype) << ", K " << problem.shape.hidden << ", N " << problem.shape.intermediate
     << ", E_local " << problem.shape.local_experts() << " of " << problem.shape.num_experts << ", top-"
     << problem.shape.top_k << "\n"
     << "  path " << moe_path_name(path) << (path_forced ? " (forced by the options)" : "")
     << " (expected " << expected_rows_per_local_expert << " rows per local expert = max_tokens x top-"
     << problem.shape.top_k << " / " << problem.shape.num_experts << " experts, uniform routing; decode up to "
     << kDecodeMaxRowsPerExpert << ")" << ": tile " << block_m << "x" << block_n << "x" << block_k << ", max_tokens "
     << max_tokens << ", max_slots " << max_slots << ", max_tiles " << max_tiles << ", smem " << smem_bytes << " B\n";
  if (path == MoePath::kDecodeSplitK) {
    os << "  split-K: swap AB, " << block_m << " token rows (2 n-tiles of 8) x " << splitk_rows
       << " weight rows per CTA (FC1: gate + up of " << splitk_rows / 2 << " columns), K split over " << splitk_warps
       << " warps in 128-wide pairs, reduced in warp order; FC1 " << splitk_fc1_ctas << " CTAs, FC2 "
       << splitk_fc2_ctas << " CTAs (max_tiles x row groups); fragment-native prepacked weights\n";
  }
  os
     << "  workspace " << workspace_bytes << " B (act " << (ws_y - ws_act) << " B, y "
     << (ws_status - ws_y) << " B)";
  if (path == MoePath::kPrefillSm90) {
    os << "\n  prefill-sm90 (ran on an H200, 2026-12-04): CUTLASS sm_90a grouped mixed-input GEMMs, E4M3 weights x BF16 "
          "scales per 64 columns, tile 128x128x64, persistent grid of "
       << sm_count << " SMs; gathered rows " << (ws_h - ws_xg) << " B, FP32 GEMM1 output " << (ws_sm90_arrays - ws_h)
       << " B (activation not fused: one extra FP32 round trip), group arrays " << sm90_arrays_bytes
       << " B, CUTLASS workspace " << cutlass_bytes << " B"
       << (path_forced ? "" : "; runs the prefill kernels instead if prepack cannot encode the weights "
                              "(cuda::effective_path names the path that runs)");
  }
  if (path == MoePath::kW4a8Sm120Cutlass) {
    os << "\n  w4a8-sm120-cutlass (NEVER RUN ON ANY GPU): CUTLASS sm_120a block-scaled grouped GEMMs, MXFP8 x "
          "MXFP4, tile 128x128x128, persistent grid of "
       << sm_count << " SMs; its scratch is in the DeviceWeights (one stream at a time)";
  }
  return os.str();
}

Result<MoePlan> plan(const MoeProblem& problem, const MoeOptions& options) {
  K3_RETURN_IF_ERROR(validate_moe_shape(problem.shape));
  const int64_t max_m = options.max_tokens;
  if (max_m < 1 || max_m > 65536) {
    return invalid_argument("max_tokens = " + std::to_string(max_m) + " must be in [1, 65536]");
  }
  const DeviceCaps& caps = options.device;
  if (caps.cc_major == 0) {
    return invalid_argument("options.device is empty: plan for a device with cuda::device_caps(ordinal), "
                            "or describe the target device by hand");
  }
  const int arch = caps.cc_major * 10 + caps.cc_minor;
  if (std::find(caps.compiled_archs.begin(), caps.compiled_archs.end(), arch) == caps.compiled_archs.end()) {
    return unsupported("CUDA device '" + caps.name + "' is sm_" + std::to_string(arch) +
                       ", but this build contains kernels for " + arch_list(caps.compiled_archs) +
                       " only; rebuild with -DK3_CUDA_ARCHS including " + std::to_string(arch) +
                       "a, or run the layer with --backend cpu");
  }
  const int64_t k = problem.shape.hidden, n = problem.shape.intermediate;
  const int e_local = problem.shape.local_experts();
  MoePlan plan;
  plan.problem = problem;
  plan.max_tokens = max_m;
  plan.max_slots = max_m * problem.shape.top_k;
  // Expected rows per LOCAL expert under uniform routing: a rank receives the slots of its own
  // experts only, max_tokens * top_k / E of them per expert (E = all experts, not E_local: at EP 32
  // a rank holds 28 of 896 experts and sees 1/32 of the slots). The decode path (tiles of 16
  // rows) wins while tiles of 64 rows would mostly hold padding.
  plan.expected_rows_per_local_expert =
      static_cast<double>(plan.max_slots) / static_cast<double>(problem.shape.num_experts);
  // prefill-sm90 where the device is sm_90 and the build has the CUTLASS GEMM; otherwise the
  // mma.sync prefill path.
  const bool sm90_ok = arch == 90 && caps.has_sm90_grouped;
  plan.path = plan.expected_rows_per_local_expert <= kDecodeMaxRowsPerExpert
                  ? MoePath::kDecodeSplitK
                  : (sm90_ok ? MoePath::kPrefillSm90 : MoePath::kPrefill);
  if (options.path) plan.path = *options.path;
  plan.path_forced = options.path.has_value();
  if (plan.path == MoePath::kPrefillSm90) {
    if (arch != 90) {
      return unsupported("the prefill-sm90 path (CUTLASS wgmma/TMA grouped GEMM) needs an sm_90 device; '" + caps.name +
                         "' is sm_" + std::to_string(arch) + "; use path prefill");
    }
    if (!caps.has_sm90_grouped) {
      return unsupported("the prefill-sm90 path is not in this build (the CUTLASS headers were missing when k3 was "
                         "built); rebuild after scripts/setup.sh fetched CUTLASS, or use path prefill");
    }
    if (caps.sm_count < 1) {
      return invalid_argument("options.device.sm_count = " + std::to_string(caps.sm_count) +
                              " must be >= 1 for prefill-sm90 (its persistent grid)");
    }
  }
  if (plan.path == MoePath::kW4a8Sm120Cutlass) {
    if (arch != 120) {
      return unsupported("the w4a8-sm120-cutlass path (CUTLASS sm_120a block-scaled grouped GEMM) needs an sm_120 "
                         "device; '" + caps.name + "' is sm_" + std::to_string(arch));
    }
    if (!caps.has_sm120_blockscaled) {
      return unsupported("the w4a8-sm120-cutlass path is not in this build (needs the CUTLASS headers, see "
                         "scripts/setup.sh, and 120a in K3_CUDA_ARCHS)");
    }
    if (problem.recipe != Recipe::kW4A8) {
      return unsupported(std::string("the w4a8-sm120-cutlass path runs the w4a8 recipe only, not ") +
                         recipe_name(problem.recipe));
    }
    if (k % 128 != 0 || n % 128 != 0) {
      return unsupported("the w4a8-sm120-cutlass path needs K and N multiples of 128 (CUTLASS's scale-factor atoms); "
                         "K = " + std::to_string(k) + ", N = " + std::to_string(n));
    }
    if (caps.sm_count < 1) {
      return invalid_argument("options.device.sm_count = " + std::to_string(caps.sm_count) +
                              " must be >= 1 for w4a8-sm120-cutlass (its persistent grid)");
    }
    plan.sm_count = caps.sm_count;
  }
  plan.block_m = plan.path == MoePath::kDecodeSplitK ? 16 : 64;
  // block_n must divide N (FC1 output columns per half) and K (FC2 output columns).
  plan.block_n = (n % 64 == 0 && k % 64 == 0) ? 64 : 32;
  plan.block_k = kMxBlock;
  plan.max_tiles = (plan.max_slots + static_cast<int64_t>(e_local) * (plan.block_m - 1) + plan.block_m - 1) / plan.block_m;
  // Shared memory: the A tile [block_m, block_k + 8] BF16 (rows padded by 16 bytes against bank conflicts).
  plan.smem_bytes = int64_t{plan.block_m} * (plan.block_k + 8) * 2;
  if (plan.path == MoePath::kDecodeSplitK) {
    // Swap AB, split-K (src/cuda/moe/moe_gemm_splitk.cu): the warps' FP32 partial accumulators,
    // [warps][4 m-tiles x 2 n-tiles x 4][32 lanes], static shared memory.
    plan.splitk_warps = kSplitKWarps;
    plan.splitk_rows = kSplitKRows;
    plan.smem_bytes = int64_t{kSplitKWarps} * (kSplitKRows / 16) * 2 * 4 * 32 * 4;
    plan.splitk_fc1_ctas = plan.max_tiles * ((2 * n + kSplitKRows - 1) / kSplitKRows);
    plan.splitk_fc2_ctas = plan.max_tiles * ((k + kSplitKRows - 1) / kSplitKRows);
  }
  if (plan.smem_bytes > caps.smem_per_block_optin) {
    return unsupported("the " + std::string(moe_path_name(plan.path)) + " kernel needs " +
                       std::to_string(plan.smem_bytes) + " B of shared memory per block, device '" + caps.name +
                       "' offers " + std::to_string(caps.smem_per_block_optin) + " B; use --backend cpu");
  }
  const int64_t rows = plan.max_tiles * plan.block_m;
  const int64_t chunks = (plan.max_slots + plan.sort_chunk - 1) / plan.sort_chunk;
  int64_t off = 0;
  auto take = [&off](int64_t bytes) {
    const int64_t at = off;
    off += align256(bytes);
    return at;
  };
  plan.ws_x_bf16 = take(max_m * k * 2);
  plan.ws_slot_row = take(plan.max_slots * 4);
  plan.ws_row_token = take(rows * 4);
  plan.ws_tile_expert = take(plan.max_tiles * 4);
  plan.ws_counts = take(2 * int64_t{e_local} * 4);
  plan.ws_chunk_hist = take(int64_t{e_local} * chunks * 4);
  plan.ws_act = take(rows * n * 2);
  plan.ws_y = take(rows * k * 4);
  plan.ws_status = take(4);
  if (plan.path == MoePath::kPrefillSm90) {
    plan.sm_count = caps.sm_count;
    plan.ws_xg = take(rows * k * 2);
    plan.ws_h = take(rows * 2 * n * 4);
    plan.sm90_arrays_bytes = align256(int64_t{e_local} * kSm90ArraysBytesPerExpert + 1024);
    plan.ws_sm90_arrays = take(plan.sm90_arrays_bytes);
    plan.cutlass_bytes = align256(int64_t{caps.sm_count} * kSm90CutlassWorkspacePerSm + kSm90CutlassWorkspaceFixed);
    plan.ws_cutlass = take(plan.cutlass_bytes);
  }
  plan.workspace_bytes = off;
  return plan;
}

}  // namespace k3::cuda
