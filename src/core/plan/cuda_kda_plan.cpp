// Host-side planning of the CUDA KDA backend and the size checks of its device calls. Pure C++
// (no CUDA), so every decision and every refusal is unit-tested without a GPU.
#include <algorithm>
#include <sstream>
#include <string>

#include "core/kda/kda_chunk_math.hpp"
#include "core/kda/kda_math.hpp"
#include "k3/cuda_kda.hpp"

namespace k3::cuda {
namespace {

std::string num(int64_t v) { return std::to_string(v); }
int64_t align256(int64_t v) { return (v + 255) / 256 * 256; }
int64_t sz(size_t n) { return static_cast<int64_t>(n); }

std::string arch_list(const std::vector<int>& archs) {
  std::string s;
  for (int a : archs) s += (s.empty() ? "sm_" : ", sm_") + std::to_string(a);
  return s.empty() ? "none" : s;
}

Status check_plan(const KdaPlan& p) {
  if (p.workspace_bytes <= 0 || p.warps <= 0 || p.v_tiles <= 0) {
    return invalid_argument("the KDA plan is empty: make it with k3::cuda::plan(cfg, options)");
  }
  return kda::validate_config(p.cfg);
}

// The token inputs of decode / verify (cu_seqlens and initial_state must be empty): the token count.
Result<int64_t> check_pool_tokens(const KdaPlan& p, const kda::KdaInputs& in, std::span<float> o, const char* what) {
  if (!in.cu_seqlens.empty() || !in.initial_state.empty()) {
    return invalid_argument(std::string(what) +
                            ": cu_seqlens and initial_state must be empty (the state pool holds the states)");
  }
  K3_ASSIGN_OR_RETURN(auto s, kda::detail::validate_prefill_sizes(p.cfg, in, sz(o.size()), 0, /*host_values=*/false));
  return s.num_tokens;
}

// The FP32 or the BF16 pool (exactly one), whose slots an int32 index can name.
Status check_pool(const KdaPlan& p, std::span<const float> pool, std::span<const uint16_t> pool16) {
  K3_ASSIGN_OR_RETURN(const int64_t slots, kda::check_pool_choice(p.cfg, pool, pool16, /*bf16_ok=*/true));
  if (slots > INT32_MAX) {
    return out_of_range("the state pool has " + num(slots) + " slots, more than the " + num(INT32_MAX) +
                        " an int32 state index can name");
  }
  return Status::ok();
}

Status check_seqs(const KdaPlan& p, int64_t n, const char* what) {
  if (n > p.max_seqs) {
    return out_of_range(std::string(what) + " has " + num(n) + " sequences, more than the plan's max_seqs = " +
                        num(p.max_seqs));
  }
  return Status::ok();
}

}  // namespace

std::string kda_status_string(uint32_t bits) {
  if (bits == 0) return "ok";
  static const std::pair<uint32_t, const char*> kNames[] = {
      {kKdaBadSeqlens, "bad cu_seqlens"},
      {kKdaBadALog, "a_log outside [-87, 88]"},
      {kKdaSlotOutOfRange, "state slot past the pool"},
      {kKdaDuplicateSlot, "state slot written twice"},
      {kKdaBadAccepted, "num_accepted outside [1, T]"},
  };
  std::string s;
  for (const auto& [bit, name] : kNames) {
    if (bits & bit) s += (s.empty() ? "" : ", ") + std::string(name);
  }
  const uint32_t known = kKdaBadSeqlens | kKdaBadALog | kKdaSlotOutOfRange | kKdaDuplicateSlot | kKdaBadAccepted;
  if (bits & ~known) s += (s.empty() ? "" : ", ") + std::string("unknown bits ") + std::to_string(bits & ~known);
  return s;
}

std::string KdaPlan::describe() const {
  std::ostringstream os;
  os << "cuda kda plan: H " << cfg.num_heads << ", K " << cfg.head_k << ", V " << cfg.head_v << ", "
     << kda::state_layout_name(cfg.layout) << ", gate " << kda::gate_mode_name(cfg.gate) << ", device " << device.name
     << " (sm_" << device.cc_major << device.cc_minor << "), checked on an H200 (sm_90, 2026-12-04), never on sm_120\n"
     << "  prefill " << kda::algorithm_name(algorithm);
  if (algorithm == kda::Algorithm::kChunked) {
    os << " (tensor cores, 3xTF32; slower than recurrent on an H200): block = " << v_tiles << " V tile(s) of " << chunk_v_tile
       << " columns x H x N, " << chunk_warps << " warps, chunks of " << chunk_size
       << " tokens, state slice in shared memory, dynamic smem " << chunk_smem_bytes << " B";
  } else {
    os << " (auto and recurrent run the token-recurrent kernel; chunked is opt-in while unverified)";
  }
  os << "\n  decode / verify recurrent: block = " << v_tiles
     << " V tile(s) of " << kKdaVTile << " columns x H x N, " << warps << " warp(s) x " << rows_per_thread
     << " state rows per thread in registers, smem " << smem_bytes << " B\n"
     << "  max_seqs " << max_seqs << ", workspace " << workspace_bytes << " B";
  return os.str();
}

Result<KdaPlan> plan(const kda::KdaConfig& cfg, const KdaOptions& options) {
  K3_RETURN_IF_ERROR(kda::validate_config(cfg));
  if (options.max_seqs < 1 || options.max_seqs > kKdaMaxSeqs) {
    return invalid_argument("max_seqs = " + num(options.max_seqs) + " must be in [1, " + num(kKdaMaxSeqs) + "]");
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
                       "a, or run KDA with --backend cpu");
  }
  KdaPlan p;
  p.cfg = cfg;
  p.device = caps;
  p.max_seqs = options.max_seqs;
  // kAuto stays recurrent: on an H200 (2026-12-04) the chunked kernel was slower (43.4 against
  // 36.7 ms at T = 8192, H = 96).
  p.algorithm = options.algorithm == kda::Algorithm::kChunked ? kda::Algorithm::kChunked : kda::Algorithm::kRecurrent;
  if (p.algorithm == kda::Algorithm::kChunked) {
    p.chunk_size = kda::chunk::kC;
    p.chunk_v_tile = kda::chunk::kVt;
    p.chunk_warps = kda::chunk::kWarps;
    p.chunk_smem_bytes = kda::chunk::smem_bytes(static_cast<int>(cfg.head_k));
    if (p.chunk_smem_bytes > caps.smem_per_block_optin) {
      return unsupported("algorithm = chunked: the chunked prefill kernel needs " + num(p.chunk_smem_bytes) +
                         " B of shared memory per block for K = " + num(cfg.head_k) + ", above the " +
                         num(caps.smem_per_block_optin) + " B of device '" + caps.name +
                         "' (smem_per_block_optin); use algorithm = recurrent");
    }
  }
  const int64_t k = cfg.head_k;
  p.v_tiles = static_cast<int>((cfg.head_v + kKdaVTile - 1) / kKdaVTile);
  p.warps = static_cast<int>((k + 31) / 32);                              // <= 16 (K <= 512)
  p.rows_per_thread = static_cast<int>((k + p.warps - 1) / p.warps);     // <= 32
  // Per token: q, k, exp(g) rows [K]; v [32]; two [warps, 32] partial-sum tables; [warps] norm parts.
  p.smem_bytes = (3 * k + kKdaVTile + 2 * int64_t{p.warps} * kKdaVTile + 3 * int64_t{p.warps} + 4) * 4;
  p.ws_status = 0;
  p.ws_seq_flags = 256;
  p.workspace_bytes = p.ws_seq_flags + align256(p.max_seqs * 4);
  return p;
}

Status check_prefill_sizes(const KdaPlan& p, const kda::KdaInputs& in, const kda::KdaOutputs& out) {
  K3_RETURN_IF_ERROR(check_plan(p));
  K3_ASSIGN_OR_RETURN(auto s, kda::detail::validate_prefill_sizes(p.cfg, in, sz(out.o.size()),
                                                                  sz(out.final_state.size()), /*host_values=*/false));
  return check_seqs(p, s.num_seqs, "prefill: cu_seqlens");
}

Status check_decode_sizes(const KdaPlan& p, const kda::DecodeArgs& a) {
  K3_RETURN_IF_ERROR(check_plan(p));
  K3_ASSIGN_OR_RETURN(const int64_t n, check_pool_tokens(p, a.in, a.o, "decode"));
  K3_RETURN_IF_ERROR(check_pool(p, a.state_pool, a.state_pool_bf16));
  if (sz(a.state_indices.size()) != n) {
    return invalid_argument("state_indices has " + num(sz(a.state_indices.size())) + " entries, expected N = " +
                            num(n) + " ([N])");
  }
  return check_seqs(p, n, "decode: the batch");
}

Status check_verify_sizes(const KdaPlan& p, const kda::VerifyArgs& a) {
  K3_RETURN_IF_ERROR(check_plan(p));
  K3_ASSIGN_OR_RETURN(const int64_t tokens, check_pool_tokens(p, a.in, a.o, "verify"));
  K3_RETURN_IF_ERROR(check_pool(p, a.state_pool, a.state_pool_bf16));
  const int64_t t = a.draft_tokens;
  if (t < 1 || t > kKdaMaxDraftTokens || tokens % t != 0) {
    return invalid_argument("draft_tokens = " + num(t) + " must be in [1, " + num(kKdaMaxDraftTokens) +
                            "] and divide the token count " + num(tokens));
  }
  const int64_t n = tokens / t;
  if (sz(a.state_indices.size()) != n * t) {
    return invalid_argument("state_indices has " + num(sz(a.state_indices.size())) + " entries, expected N * T = " +
                            num(n * t) + " ([N, T])");
  }
  if (sz(a.num_accepted.size()) != n) {
    return invalid_argument("num_accepted has " + num(sz(a.num_accepted.size())) + " entries, expected N = " +
                            num(n) + " ([N])");
  }
  return check_seqs(p, n, "verify: the batch");
}

Result<int64_t> kda_replan_max_seqs(int64_t planned, int64_t seqs) {
  if (seqs < 1 || seqs > kKdaMaxSeqs) {
    return invalid_argument("sequences = " + num(seqs) + " must be in [1, " + num(kKdaMaxSeqs) + "] (a plan's max_seqs)");
  }
  if (planned >= seqs) return int64_t{0};
  return std::max<int64_t>(1024, seqs);
}

}  // namespace k3::cuda
