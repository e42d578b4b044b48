// Interface between the KDA CPU driver (kda_cpu.cpp) and the per-ISA kernels
// (kernels_<isa>.cpp, all generated from kernels_impl.hpp). Internal to k3_cpu.
#pragma once

#include <cstdint>

#include <span>

#include "k3/cpu_kda.hpp"
#include "k3/kda.hpp"

namespace k3::cpu::kda_detail {

using namespace k3::kda;  // the op's types (GateMode, ...)

// Every buffer of the kernels is padded to a multiple of 16 floats (one AVX-512 vector) with
// zeros, so no SIMD loop needs a tail; padding lanes carry k = q = 0 and stay 0.
inline constexpr int64_t kPad = 16;
inline int64_t round_up_pad(int64_t n) { return (n + kPad - 1) / kPad * kPad; }

// Per-thread scratch, offsets in floats (each a multiple of kPad). C = kChunk.
struct ScratchLayout {
  int64_t kp = 0, vp = 0;  // padded K and V
  // token vectors (recurrent path; the chunked path uses them as temporaries)
  int64_t q = 0, k = 0, v = 0, g = 0, alpha = 0, ak = 0, vnew = 0, out = 0, bias = 0, tmp = 0;
  // non-finite policy (docs/kda.md), chunked path: columns of v that were non-finite (1) in the
  // token being prepared, and the first chunk row from which each column is poisoned (C: none)
  int64_t vbad = 0, pstart = 0;  // [vp]
  // chunk tiles
  int64_t cq = 0, ck = 0, cg = 0, cqg = 0, ckg = 0, cki = 0, ckl = 0;  // [C, kp]
  int64_t cr1 = 0, cr2 = 0, cr3 = 0;  // [C, kp] factor rows of the strong-decay chunk ratios
  int64_t cv = 0, cp1 = 0, cp2 = 0, co = 0;                              // [C, vp]
  int64_t cl = 0, caqk = 0;                                              // [C, C]
  int64_t beta = 0;                                                      // [C]
  int64_t state = 0;                                                     // [kp, vp] local state
  int64_t total = 0;
};
ScratchLayout scratch_layout(int64_t head_k, int64_t head_v);

// One head of one sequence: where its inputs are and how to turn them into q, k, v, g, beta.
struct HeadCtx {
  const uint16_t* q16 = nullptr;  // [T, H, K] BF16, or q32
  const float* q32 = nullptr;
  const uint16_t* k16 = nullptr;
  const float* k32 = nullptr;
  const uint16_t* v16 = nullptr;  // [T, H, V]
  const float* v32 = nullptr;
  const float* g = nullptr;        // [T, H, K]
  const float* beta = nullptr;     // [T, H]
  const float* dt_bias = nullptr;  // [K] row of this head, or nullptr (zeros)
  float* o = nullptr;              // [T, H, V]
  int64_t num_heads = 0, head = 0, head_k = 0, head_v = 0;
  GateMode gate = GateMode::kLogDecay;
  float a = 0.0f;  // exp(A_log[head])
  float lower_bound = -5.0f;
  float scale = 1.0f;
  bool beta_logits = true;
  bool l2norm = true;
  ScratchLayout lay;
  // verify_replay: where the recurrent path keeps each token's update inputs (the replay window
  // row of token t0 for this head, k3/kda.hpp: [k | alpha | v | beta | poisoned]; the next token's
  // row is num_heads * replay_row_floats further). nullptr: not kept.
  float* window = nullptr;
};

// The order of the commit's fold. kDecode is the only one the library uses: the arithmetic of the
// recurrent path, operation for operation (its bits are decode's). kReversedForTest sums the
// k-dimension of S^T (alpha k) backwards; a test uses it to show that the bit-identity checks
// catch a reordered fold.
enum class FoldOrder : uint8_t { kDecode, kReversedForTest };

struct KernelTable {
  // Tokens [t0, t1) one by one on the state s (K rows of `lds` floats, K-first; columns up to
  // `vw`, a multiple of kPad with zeros from head_v on, are processed). Writes o rows.
  void (*recurrent)(const HeadCtx& x, int64_t t0, int64_t t1, float* s, int64_t lds, int64_t vw, float* scratch);
  // Tokens [t0, t1) in chunks of kChunk on the local padded state s ([kp, vp]).
  void (*chunked)(const HeadCtx& x, int64_t t0, int64_t t1, float* s, float* scratch);
  // Folds `tokens` replay window rows (the first at `rows`, each num_heads * R floats after the
  // previous) into the state s (as recurrent: K rows of `lds`, columns up to `vw`). No output.
  // DO NOT REORDER: every state entry must get exactly the operations recurrent() applies, in its
  // order (commit's result is bit-identical to decode; tests/cpu/test_kda_replay.cpp checks it).
  void (*commit)(const HeadCtx& x, const float* rows, int64_t tokens, float* s, int64_t lds, int64_t vw,
                 float* scratch, FoldOrder order);
};

const KernelTable& kernels_scalar();
const KernelTable& kernels_avx2();
const KernelTable& kernels_avx512();

// k3::cpu::commit with a chosen fold order (kDecode is commit itself; tests pass kReversedForTest).
Status commit_with_order(const KdaPlan& p, const kda::CommitArgs& a, std::span<uint8_t> workspace, FoldOrder order);

}  // namespace k3::cpu::kda_detail
