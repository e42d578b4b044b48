// The FP64 fused-MoE oracles (k3/moe_ref.hpp). Work is organised expert by expert so that each
// expert's MXFP4 weights are dequantized once per token chunk (they are 33 M values at Kimi
// shapes); every output element is still one thread's fixed-order FP64 reduction, so the OpenMP
// split never changes a bit.
#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <new>
#include <string>
#include <vector>

#include "k3/formats.hpp"
#include "k3/moe_ref.hpp"
#include "k3/mx.hpp"

namespace k3 {

const char* oracle_kind_name(OracleKind k) { return k == OracleKind::kContract ? "contract" : "bf16_reference"; }

namespace {

// Tokens per chunk: bounds the FP64 intermediate buffers ([C * top_k, 2N] and [C * top_k, K]) to
// tens of MB at Kimi shapes whatever M is.
constexpr int64_t kTokenChunk = 64;
// Weight rows per OpenMP work item of a GEMM: 16 rows of K = 3584 FP32 are 229 KB, which stay in
// L2 while every token-slot of the expert is multiplied with them.
constexpr int64_t kRowBlock = 16;
// Below this many inner-loop steps a loop runs on one thread: waking the team costs more than the
// work, and far more on an oversubscribed machine. (Which thread computes what never changes a bit.)
constexpr int64_t kParallelMin = int64_t{1} << 16;

// Dequantizes one MXFP4 matrix [rows, cols] (packed [rows, cols/2], scales [rows, cols/32]) to
// FP32. Exact (k3/mx.hpp): an E2M1 value times a power of two fits FP32 except beyond FLT_MAX
// (+-Inf); a 0xFF scale gives NaN for the whole block.
void dequant_fp4(const uint8_t* q, const uint8_t* s, int64_t rows, int64_t cols, float* out) {
  std::array<float, 16> lut{};
  for (int c = 0; c < 16; ++c) lut[c] = e2m1_to_f32(static_cast<uint8_t>(c));
  const int64_t nblk = cols / kMxBlock;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nblk; ++b) {
      const float scale = e8m0_to_f32(s[r * nblk + b]);
      const uint8_t* src = q + r * (cols / 2) + b * (kMxBlock / 2);
      float* dst = out + r * cols + b * kMxBlock;
      for (int i = 0; i < kMxBlock / 2; ++i) {
        dst[2 * i] = lut[fp4_low(src[i])] * scale;
        dst[2 * i + 1] = lut[fp4_high(src[i])] * scale;
      }
    }
  }
}

// FP64 dot product with a fixed order: 32 interleaved partial sums (partial j adds elements
// j, j+32, ...), then combined as a balanced pairwise tree. n % 32 == 0 (n is K or N). 32
// independent chains keep the adders busy (a single chain is bound by the add latency). Products
// of the operands used here (MXFP8 / BF16 / FP32 values times FP4 values) are exact in FP64; only
// the additions round.
// On x86-64 with GCC the function is also built for AVX2 and AVX-512 (chosen at load time); each
// partial sum sees the same additions in the same order whatever the vector width, so every
// variant returns the same bits.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
double dot(const double* a, const float* b, int64_t n) {
  constexpr int kLanes = 32;
  std::array<double, kLanes> acc{};
  for (int64_t i = 0; i < n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * static_cast<double>(b[i + j]);
  }
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) acc[j] = acc[2 * j] + acc[2 * j + 1];
  }
  return acc[0];
}

// C[p, r] = dot(A[p, :], W[r, :]) for p < np, r < rows. A: [np, cols] FP64, W: [rows, cols] FP32,
// C: [np, rows] FP64. Split over blocks of weight rows; each C element is written by one thread.
void gemm_nt(const double* a, int64_t np, const float* w, int64_t rows, int64_t cols, double* c) {
  const int64_t nblocks = (rows + kRowBlock - 1) / kRowBlock;
#pragma omp parallel for schedule(dynamic) if (np * rows * cols >= 4 * kParallelMin)
  for (int64_t rb = 0; rb < nblocks; ++rb) {
    const int64_t r0 = rb * kRowBlock, r1 = std::min(rows, r0 + kRowBlock);
    for (int64_t p = 0; p < np; ++p) {
      for (int64_t r = r0; r < r1; ++r) c[p * rows + r] = dot(a + p * cols, w + r * cols, cols);
    }
  }
}

// True when a value is finite in FP64 but beyond FP32's range (|v| > FLT_MAX): an FP32 backend
// holds +-Inf there (moe_ref.hpp, rows_beyond_fp32).
bool beyond_fp32(const double* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::isfinite(v[i]) && std::fabs(v[i]) > static_cast<double>(FLT_MAX)) return true;
  }
  return false;
}

// Step 1 of the contract for one token row: x (BF16) -> the GEMM1 operand in FP64.
void input_row(const uint16_t* x, int64_t k, Recipe recipe, double* out) {
  if (recipe == Recipe::kW4A16) {
    for (int64_t i = 0; i < k; ++i) out[i] = bf16_to_f32(x[i]);
    return;
  }
  std::array<float, kMxBlock> blk{};
  std::array<uint8_t, kMxBlock> codes{};
  for (int64_t b = 0; b < k / kMxBlock; ++b) {
    for (int i = 0; i < kMxBlock; ++i) blk[i] = bf16_to_f32(x[b * kMxBlock + i]);
    const uint8_t scale = mx_quantize_block(blk.data(), MxElement::kE4M3, ScaleRule::kRceil, codes.data());
    for (int i = 0; i < kMxBlock; ++i) out[b * kMxBlock + i] = mx_decode_element(codes[i], scale, MxElement::kE4M3);
  }
}

// Steps 3 and 4 for one token-slot: h [2N] = [gate | up] -> a [N], the GEMM2 operand in FP64.
void activation_row(const double* h, int64_t n, const Activation& act, double b, double lb, Recipe recipe,
                    OracleKind kind, double* a) {
  for (int64_t j = 0; j < n; ++j) a[j] = activation_ref(act, h[j], h[n + j], b, lb);
  if (kind == OracleKind::kBf16Reference) return;  // the reference keeps the FP64 intermediate
  if (recipe == Recipe::kW4A16) {
    for (int64_t j = 0; j < n; ++j) a[j] = bf16_to_f32(bf16_from_f32(round_to_f32(a[j])));
    return;
  }
  std::array<float, kMxBlock> blk{};
  std::array<uint8_t, kMxBlock> codes{};
  for (int64_t b0 = 0; b0 < n; b0 += kMxBlock) {
    for (int i = 0; i < kMxBlock; ++i) blk[i] = round_to_f32(a[b0 + i]);
    const uint8_t scale = mx_quantize_block(blk.data(), MxElement::kE4M3, ScaleRule::kRceil, codes.data());
    for (int i = 0; i < kMxBlock; ++i) a[b0 + i] = mx_decode_element(codes[i], scale, MxElement::kE4M3);
  }
}

// The oracles. out[0] = contract, out[1] = BF16 reference; a null pointer skips that oracle.
// Steps 1-2 (input rounding, GEMM1) are shared: they are the same for both.
Status oracle_impl(const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in,
                   const std::array<double*, 2>& out, std::vector<bool>* beyond) {
  const int64_t m = in.m, k = p.shape.hidden, n = p.shape.intermediate;
  const int top_k = p.shape.top_k;
  const int e_local = p.shape.local_experts();
  const int first = p.shape.first_local_expert();
  constexpr std::array<OracleKind, 2> kKinds = {OracleKind::kContract, OracleKind::kBf16Reference};
  for (double* o : out) {
    if (o != nullptr) std::fill(o, o + m * k, 0.0);
  }
  if (beyond != nullptr) beyond->assign(static_cast<size_t>(std::max<int64_t>(m, 0)), false);
  // The FP32-range marks are those of the contract: with only the BF16 reference requested, the
  // contract's activation and GEMM2 are computed for them too.
  const bool mark_only = beyond != nullptr && out[0] == nullptr;

  std::vector<float> w1;                // [2N, K] FP32, one expert's FC1 dequantized
  std::vector<float> w2;                // [K, N]  FP32, one expert's FC2 dequantized
  std::vector<double> xq(kTokenChunk * k);  // [C, K] the chunk's GEMM1 operands
  std::array<std::vector<double>, 2> y;     // per oracle: [local slots of the chunk, K] expert outputs
  std::vector<double> xs, h, a, ye;     // [P, K], [P, 2N], [P, N], [P, K] per expert
  std::vector<std::vector<int64_t>> slots(e_local);  // per local expert: chunk slot indices (t*top_k + s)
  std::vector<int64_t> y_row(kTokenChunk * top_k);     // chunk slot -> row of y, -1 if not local

  for (int64_t t0 = 0; t0 < m; t0 += kTokenChunk) {
    const int64_t tc = std::min(kTokenChunk, m - t0);
    for (auto& v : slots) v.clear();
    int64_t n_local = 0;
    for (int64_t i = 0; i < tc * top_k; ++i) {
      const int32_t id = in.topk_ids[t0 * top_k + i];
      const bool local = id >= first && id < first + e_local;
      y_row[i] = local ? n_local++ : -1;
      if (local) slots[id - first].push_back(i);
    }
    if (n_local == 0) continue;  // every row of the chunk stays +0.0
#pragma omp parallel for schedule(static) if (tc * k >= kParallelMin)
    for (int64_t t = 0; t < tc; ++t) input_row(in.x.data() + (t0 + t) * k, k, p.recipe, xq.data() + t * k);
    for (int o = 0; o < 2; ++o) {
      if (out[o] != nullptr) y[o].resize(n_local * k);
    }

    for (int e = 0; e < e_local; ++e) {
      const auto& sl = slots[e];
      const int64_t np = static_cast<int64_t>(sl.size());
      if (np == 0) continue;
      w1.resize(2 * n * k);
      w2.resize(k * n);
      dequant_fp4(w.fc1_q.data() + e * 2 * n * (k / 2), w.fc1_scale.data() + e * 2 * n * (k / kMxBlock), 2 * n, k,
                  w1.data());
      dequant_fp4(w.fc2_q.data() + e * k * (n / 2), w.fc2_scale.data() + e * k * (n / kMxBlock), k, n, w2.data());
      xs.resize(np * k);
      h.resize(np * 2 * n);
      a.resize(np * n);
      ye.resize(np * k);
      for (int64_t s = 0; s < np; ++s) {
        std::copy_n(xq.data() + (sl[s] / top_k) * k, k, xs.data() + s * k);
      }
      gemm_nt(xs.data(), np, w1.data(), 2 * n, k, h.data());  // h [P, 2N]
      const double b = w.situ_beta.empty() ? p.activation.situ_beta : w.situ_beta[e];
      const double lb = w.situ_linear_beta.empty() ? p.activation.situ_linear_beta : w.situ_linear_beta[e];
      auto mark = [&](int64_t s, const double* v, int64_t count) {
        if (beyond_fp32(v, count)) (*beyond)[static_cast<size_t>(t0 + sl[s] / top_k)] = true;
      };
      if (beyond != nullptr) {
        for (int64_t s = 0; s < np; ++s) mark(s, h.data() + s * 2 * n, 2 * n);
      }
      for (int o = mark_only ? -1 : 0; o < 2; ++o) {
        const bool contract = o <= 0;  // o = -1: the contract, for the marks only
        if (o >= 0 && out[o] == nullptr) continue;
#pragma omp parallel for schedule(static) if (np * n >= kParallelMin / 4)
        for (int64_t s = 0; s < np; ++s) {
          activation_row(h.data() + s * 2 * n, n, p.activation, b, lb, p.recipe,
                         contract ? OracleKind::kContract : kKinds[o], a.data() + s * n);
        }
        gemm_nt(a.data(), np, w2.data(), k, n, ye.data());  // y_e [P, K]
        if (contract && beyond != nullptr) {
          for (int64_t s = 0; s < np; ++s) mark(s, ye.data() + s * k, k);
        }
        if (o < 0) continue;
        for (int64_t s = 0; s < np; ++s) std::copy_n(ye.data() + s * k, k, y[o].data() + y_row[sl[s]] * k);
      }
    }

    // Finalize in slot order, one token per thread.
    for (int o = 0; o < 2; ++o) {
      if (out[o] == nullptr) continue;
#pragma omp parallel for schedule(static) if (n_local * k >= kParallelMin)
      for (int64_t t = 0; t < tc; ++t) {
        double* dst = out[o] + (t0 + t) * k;
        for (int s = 0; s < top_k; ++s) {
          const int64_t row = y_row[t * top_k + s];
          if (row < 0) continue;
          const double wt = in.topk_weights[(t0 + t) * top_k + s];
          const double* yr = y[o].data() + row * k;
          for (int64_t c = 0; c < k; ++c) dst[c] += wt * yr[c];
        }
      }
    }
  }
  return Status::ok();
}

Status check_oracle_args(const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in) {
  K3_RETURN_IF_ERROR(validate_moe_buffers(p, w, in));
  K3_RETURN_IF_ERROR(validate_activation(p.activation));
  if (p.activation.kind == ActivationKind::kSiTU) {
    for (size_t e = 0; e < w.situ_beta.size() || e < w.situ_linear_beta.size(); ++e) {
      Activation one = p.activation;
      if (e < w.situ_beta.size()) one.situ_beta = w.situ_beta[e];
      if (e < w.situ_linear_beta.size()) one.situ_linear_beta = w.situ_linear_beta[e];
      const Status st = validate_activation(one);
      if (!st.is_ok()) return invalid_argument("local expert " + std::to_string(e) + ": " + st.message());
    }
  }
  return Status::ok();
}

Status check_out(const char* name, const MoeProblem& p, const MoeInputsView& in, std::span<double> out) {
  const int64_t want = in.m * p.shape.hidden;
  if (static_cast<int64_t>(out.size()) != want) {
    return invalid_argument(std::string(name) + " [M, K] has " + std::to_string(out.size()) + " elements, expected " +
                            std::to_string(want));
  }
  return Status::ok();
}

Status run_guarded(const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in,
                   const std::array<double*, 2>& out, std::vector<bool>* beyond) {
  try {
    return oracle_impl(p, w, in, out, beyond);
  } catch (const std::bad_alloc&) {
    return unavailable("moe_oracle: out of memory for the FP64 buffers (M = " + std::to_string(in.m) +
                       ", K = " + std::to_string(p.shape.hidden) + ", N = " + std::to_string(p.shape.intermediate) +
                       ")");
  }
}

}  // namespace

Status moe_oracle(const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in, OracleKind kind,
                  std::span<double> out, std::vector<bool>* rows_beyond_fp32) {
  K3_RETURN_IF_ERROR(check_oracle_args(p, w, in));
  K3_RETURN_IF_ERROR(check_out("moe_oracle: out", p, in, out));
  std::array<double*, 2> outs = {nullptr, nullptr};
  outs[kind == OracleKind::kContract ? 0 : 1] = out.data();
  return run_guarded(p, w, in, outs, rows_beyond_fp32);
}

Status moe_oracles(const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in, std::span<double> contract,
                   std::span<double> bf16_reference, std::vector<bool>* rows_beyond_fp32) {
  K3_RETURN_IF_ERROR(check_oracle_args(p, w, in));
  K3_RETURN_IF_ERROR(check_out("moe_oracles: contract", p, in, contract));
  K3_RETURN_IF_ERROR(check_out("moe_oracles: bf16_reference", p, in, bf16_reference));
  return run_guarded(p, w, in, {contract.data(), bf16_reference.data()}, rows_beyond_fp32);
}

}  // namespace k3
