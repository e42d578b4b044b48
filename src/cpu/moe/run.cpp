// run(): the fused-MoE pipeline on the CPU, one pass per chunk of tokens:
//   1. routing map   global ids -> local experts; rows grouped by expert in (token, slot) order
//   2. x operand     W4A8: MXFP8 (RCEIL) then exact dequantization; W4A16: the BF16 row
//   3. GEMM1 + act   tasks (expert, 32 columns of N): gate and up tiles together, activation in
//                    FP32, then W4A8: MXFP8 codes per 32 along N / W4A16: BF16
//   4. h operand     dequantization of the activation output (exact)
//   5. GEMM2         tasks (expert, 32 columns of K): y rows in FP32
//   6. finalize      per token, slots in order, FP32 FMAs, one rounding to the output dtype
// Work is split by output element ranges only (tasks own whole output tiles), so each value is
// computed by one thread with a fixed operation order: bits do not depend on the thread count.
#include <omp.h>

#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <string>

#include "cpu/moe/elementwise.hpp"
#include "cpu/moe/layout.hpp"
#include "cpu/moe/operand.hpp"
#include "cpu/moe/workspace.hpp"
#include "cpu/task_ranges.hpp"
#include "k3/cpu_moe.hpp"
#include "k3/expert_map.hpp"
#include "k3/formats.hpp"
#include "k3/mx.hpp"

namespace k3::cpu {
namespace {

using namespace detail;

constexpr int64_t kParallelMinElements = int64_t{1} << 16;
// Routed rows up to which the GEMM tasks are split into one contiguous weight stream per thread.
constexpr int64_t kStreamMaxRows = 64;

struct Pass {
  const MoePlan& plan;
  const PackedWeights& w;
  const MoeInputsView& in;
  const WorkspaceLayout& lay;
  uint8_t* base;      // aligned workspace
  uint8_t* out;       // [M, K] output dtype (run), or nullptr (run_experts)
  float* y_slots;     // run_experts: [local slots, K] FP32 in slot order; nullptr for run
  const uint8_t* xq_codes;   // run_experts with pre-quantized x: [M, K] E4M3, else nullptr
  const uint8_t* xq_scales;  // ... [M, K/32] E8M0
  int64_t slot_base = 0;  // run_experts: local slots of the tokens before this chunk
  TileGemmFn gemm;
  const Elementwise& ew;
  bool bf16;          // operands BF16 (with row shifts) rather than FP32
  bool views;         // the kernel reads integer views of the operand rows (uses_int_views)
  int64_t k, n, topk, e_local, first_expert, ob;
  int64_t t0 = 0, tokens = 0;  // this chunk: tokens [t0, t0 + tokens)

  template <typename T>
  T* region(int64_t off) const { return reinterpret_cast<T*>(base + off); }
  uint8_t* thread_region(int64_t off) const {
    return base + lay.per_thread + omp_get_thread_num() * lay.per_thread_bytes + off;
  }
};

// 1. Routing map (sequential, O(tokens * top_k)): the library's permutation (k3/expert_map.hpp),
// on this chunk's ids and the workspace.
void build_routing(Pass& p) {
  const auto rows = static_cast<size_t>(p.tokens * p.topk);
  const Status st = sort_local_slots(
      p.in.topk_ids.subspan(static_cast<size_t>(p.t0 * p.topk), rows), static_cast<int>(p.topk),
      static_cast<int>(p.first_expert), static_cast<int>(p.e_local),
      {p.region<int64_t>(p.lay.expert_offset), static_cast<size_t>(p.e_local + 1)},
      {p.region<int32_t>(p.lay.slot_row), rows}, {p.region<int32_t>(p.lay.row_token), rows});
  assert(st.is_ok() && "sizes are fixed by the workspace layout");
  (void)st;
}

// 2. x operand of one token.
void prepare_x_op(const Pass& p, int64_t t) {
  const uint16_t* x = p.xq_codes != nullptr ? nullptr : p.in.x.data() + (p.t0 + t) * p.k;
  uint8_t* dst = p.region<uint8_t>(p.lay.x_op) + t * p.k * p.ob;
  int32_t& shift = p.region<int32_t>(p.lay.x_shift)[t];
  if (p.plan.problem.recipe == Recipe::kW4A16) {
    if (p.bf16) {
      shift = bf16_row_to_bf16(x, p.k, reinterpret_cast<uint16_t*>(dst));
    } else {
      auto* d = reinterpret_cast<float*>(dst);
      for (int64_t i = 0; i < p.k; ++i) d[i] = bf16_to_f32(x[i]);
      shift = f32_row_fit(d, p.k);
    }
    return;
  }
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  if (p.xq_codes != nullptr) {  // quantized by quantize_x_mxfp8 (the same quantizer, elsewhere)
    codes = p.xq_codes + (p.t0 + t) * p.k;
    scales = p.xq_scales + (p.t0 + t) * (p.k / kBlock);
  } else {
    uint8_t* c = p.thread_region(p.lay.pt_codes);
    uint8_t* sc = c + p.k;
    float* vals = reinterpret_cast<float*>(p.thread_region(p.lay.pt_acc));
    for (int64_t b = 0; b < p.k / kBlock; ++b) {
      for (int i = 0; i < kBlock; ++i) vals[i] = bf16_to_f32(x[b * kBlock + i]);
      sc[b] = p.ew.quantize_e4m3_block(vals, c + b * kBlock);
    }
    codes = c;
    scales = sc;
  }
  if (p.bf16) {
    shift = mxfp8_row_to_bf16(codes, scales, p.k, reinterpret_cast<uint16_t*>(dst));
  } else {
    mxfp8_row_to_f32(codes, scales, p.k, reinterpret_cast<float*>(dst));
    shift = f32_row_fit(reinterpret_cast<float*>(dst), p.k);
  }
}

// The integer view of one prepared operand row (BF16 on avx512bf16, else FP32).
void make_view(const Pass& p, const uint8_t* row, int64_t len, uint8_t* view) {
  auto* v = reinterpret_cast<int16_t*>(view);
  if (p.bf16) {
    int_view_row_bf16(reinterpret_cast<const uint16_t*>(row), len, v);
  } else {
    int_view_row(reinterpret_cast<const float*>(row), len, v);
  }
}

void prepare_x(const Pass& p, int64_t t) {
  prepare_x_op(p, t);
  if (p.views) make_view(p, p.region<uint8_t>(p.lay.x_op) + t * p.k * p.ob, p.k,
                         p.region<uint8_t>(p.lay.x_view) + t * int_view_bytes(p.k));
}

// A GEMM result of a scaled-down row (shift < 0) is multiplied back by 2^-shift. When that
// leaves the FP32 range, the value is finite but huge (the FP64 oracle keeps it finite); it
// saturates to +-FLT_MAX instead of becoming +-Inf, so that for example SwiGLU's
// g * sigmoid(alpha g) gives the oracle's -0 rather than -Inf * 0 = NaN.
inline float unshift_value(float t, float unshift) {
  const float v = t * unshift;
  if (std::isinf(v) && std::isfinite(t)) return std::copysign(std::numeric_limits<float>::max(), t);
  return v;
}

// Adds the Inf class of each listed weight block (PackedWeights::InfBlock) to the GEMM totals of
// rows [0, nr): over the block's overflowing elements w and the row's operand x at their
// positions, w * x is +-Inf for a nonzero finite or infinite x and NaN for x = 0 or NaN; the
// block contributes NaN when any product is NaN or both signs occur, else the common Inf.
// (The operand rows are exact scaled copies of the contract's values: scaling keeps zero, sign
// and NaN, except that an FP32-level row with magnitudes >= 2^120 is scaled down and a value of
// it below 2^-126 * 2^-(shift) may become zero; such a product then counts as Inf * 0.)
void add_inf_blocks(const Pass& p, std::span<const PackedWeights::InfBlock> blocks, const void* const* rows,
                    int64_t nr, float* totals, int64_t width) {
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < nr; ++i) {
    for (const auto& ib : blocks) {
      bool pos = false, neg = false, nan = false;
      for (int el = 0; el < kBlock && !nan; ++el) {
        if (((ib.inf_mask >> el) & 1u) == 0) continue;
        const int64_t idx = int64_t{ib.block} * kBlock + el;
        const float x = p.bf16 ? bf16_to_f32(static_cast<const uint16_t*>(rows[i])[idx])
                               : static_cast<const float*>(rows[i])[idx];
        if (x == 0.f || std::isnan(x)) {
          nan = true;
        } else if (std::signbit(x) != (((ib.neg_mask >> el) & 1u) != 0)) {
          neg = true;
        } else {
          pos = true;
        }
      }
      float& t = totals[i * width + ib.column];
      t += nan || (pos && neg) ? std::numeric_limits<float>::quiet_NaN() : (neg ? -inf : inf);
    }
  }
}

ActParams act_params(const MoePlan& plan, const PackedWeights& w, int64_t e) {
  const Activation& a = plan.problem.activation;
  ActParams ap;
  ap.kind = a.kind;
  ap.beta = w.situ_beta(e);
  ap.linear_beta = w.situ_linear_beta(e);
  ap.alpha = a.swiglu_alpha;
  ap.swiglu_beta = a.swiglu_beta;
  ap.limit = a.swiglu_limit;
  return ap;
}

// 3. GEMM1 + activation for expert e, columns [32j, 32j+32) of N, all rows of the expert.
void gemm1_task(const Pass& p, int64_t e, int64_t j) {
  const auto* offset = p.region<int64_t>(p.lay.expert_offset);
  const auto* row_token = p.region<int32_t>(p.lay.row_token);
  const auto* x_shift = p.region<int32_t>(p.lay.x_shift);
  const uint8_t* x_op = p.region<uint8_t>(p.lay.x_op);
  auto* totals = reinterpret_cast<float*>(p.thread_region(p.lay.pt_totals));
  auto* rows = reinterpret_cast<const void**>(p.thread_region(p.lay.pt_rows));
  float* scratch = reinterpret_cast<float*>(p.thread_region(p.lay.pt_acc));  // [3, 32]
  const ActParams ap = act_params(p.plan, p.w, e);
  const int64_t tile_bytes = (p.k / kBlock) * record_bytes(kFc1Groups);
  TileGemm g;
  g.records = p.w.fc1(e) + j * tile_bytes;
  g.blocks = p.k / kBlock;
  g.groups = kFc1Groups;
  g.rows = rows;
  g.totals = totals;
  g.panel = p.thread_region(p.lay.pt_panel);
  auto* views = reinterpret_cast<const int16_t**>(p.thread_region(p.lay.pt_views));
  const uint8_t* x_view = p.region<uint8_t>(p.lay.x_view);
  if (p.views) g.views = views;
  const int64_t width = kFc1Groups * kLanes;
  for (int64_t r0 = offset[e]; r0 < offset[e + 1]; r0 += kRowGroup) {
    const int64_t nr = offset[e + 1] - r0 < kRowGroup ? offset[e + 1] - r0 : kRowGroup;
    for (int64_t i = 0; i < nr; ++i) rows[i] = x_op + row_token[r0 + i] * p.k * p.ob;
    if (p.views) {
      for (int64_t i = 0; i < nr; ++i) {
        views[i] = reinterpret_cast<const int16_t*>(x_view + row_token[r0 + i] * int_view_bytes(p.k));
      }
    }
    g.num_rows = nr;
    p.gemm(g);
    if (const auto inf = p.w.inf_blocks(1, e, j); !inf.empty()) add_inf_blocks(p, inf, rows, nr, totals, width);
    for (int64_t i = 0; i < nr; ++i) {
      const int64_t r = r0 + i;
      const float unshift = exp2i(-x_shift[row_token[r]]);
      float* gate = scratch;
      float* up = scratch + kBlock;
      float* act = scratch + 2 * kBlock;
      for (int c = 0; c < kBlock; ++c) {
        gate[c] = unshift_value(totals[i * width + c], unshift);
        up[c] = unshift_value(totals[i * width + kBlock + c], unshift);
      }
      p.ew.activate(ap, gate, up, act, kBlock);
      if (p.plan.problem.recipe == Recipe::kW4A8) {
        uint8_t* hq = p.region<uint8_t>(p.lay.h_q) + r * p.n + j * kBlock;
        p.region<uint8_t>(p.lay.h_s)[r * (p.n / kBlock) + j] = p.ew.quantize_e4m3_block(act, hq);
      } else if (p.bf16) {
        uint16_t* h = p.region<uint16_t>(p.lay.h_op) + r * p.n + j * kBlock;
        for (int c = 0; c < kBlock; ++c) h[c] = bf16_from_f32(act[c]);
      } else {
        float* h = p.region<float>(p.lay.h_op) + r * p.n + j * kBlock;
        for (int c = 0; c < kBlock; ++c) h[c] = bf16_to_f32(bf16_from_f32(act[c]));
      }
    }
  }
}

// 4. GEMM2 operand of one row.
void prepare_h_op(const Pass& p, int64_t r) {
  int32_t& shift = p.region<int32_t>(p.lay.h_shift)[r];
  uint8_t* h_op = p.region<uint8_t>(p.lay.h_op) + r * p.n * p.ob;
  if (p.plan.problem.recipe == Recipe::kW4A8) {
    const uint8_t* codes = p.region<uint8_t>(p.lay.h_q) + r * p.n;
    const uint8_t* scales = p.region<uint8_t>(p.lay.h_s) + r * (p.n / kBlock);
    if (p.bf16) {
      shift = mxfp8_row_to_bf16(codes, scales, p.n, reinterpret_cast<uint16_t*>(h_op));
    } else {
      mxfp8_row_to_f32(codes, scales, p.n, reinterpret_cast<float*>(h_op));
      shift = f32_row_fit(reinterpret_cast<float*>(h_op), p.n);
    }
  } else if (p.bf16) {
    auto* h = reinterpret_cast<uint16_t*>(h_op);
    shift = bf16_row_to_bf16(h, p.n, h);
  } else {
    shift = f32_row_fit(reinterpret_cast<float*>(h_op), p.n);
  }
}

void prepare_h(const Pass& p, int64_t r) {
  prepare_h_op(p, r);
  if (p.views) make_view(p, p.region<uint8_t>(p.lay.h_op) + r * p.n * p.ob, p.n,
                         p.region<uint8_t>(p.lay.h_view) + r * int_view_bytes(p.n));
}

// 5. GEMM2 for expert e, columns [32j, 32j+32) of K.
void gemm2_task(const Pass& p, int64_t e, int64_t j) {
  const auto* offset = p.region<int64_t>(p.lay.expert_offset);
  const auto* h_shift = p.region<int32_t>(p.lay.h_shift);
  const uint8_t* h_op = p.region<uint8_t>(p.lay.h_op);
  auto* totals = reinterpret_cast<float*>(p.thread_region(p.lay.pt_totals));
  auto* rows = reinterpret_cast<const void**>(p.thread_region(p.lay.pt_rows));
  float* y = p.region<float>(p.lay.y);
  const int64_t tile_bytes = (p.n / kBlock) * record_bytes(kFc2Groups);
  TileGemm g;
  g.records = p.w.fc2(e) + j * tile_bytes;
  g.blocks = p.n / kBlock;
  g.groups = kFc2Groups;
  g.rows = rows;
  g.totals = totals;
  g.panel = p.thread_region(p.lay.pt_panel);
  auto* views = reinterpret_cast<const int16_t**>(p.thread_region(p.lay.pt_views));
  const uint8_t* h_view = p.region<uint8_t>(p.lay.h_view);
  if (p.views) g.views = views;
  for (int64_t r0 = offset[e]; r0 < offset[e + 1]; r0 += kRowGroup) {
    const int64_t nr = offset[e + 1] - r0 < kRowGroup ? offset[e + 1] - r0 : kRowGroup;
    for (int64_t i = 0; i < nr; ++i) rows[i] = h_op + (r0 + i) * p.n * p.ob;
    if (p.views) {
      for (int64_t i = 0; i < nr; ++i) views[i] = reinterpret_cast<const int16_t*>(h_view + (r0 + i) * int_view_bytes(p.n));
    }
    g.num_rows = nr;
    p.gemm(g);
    if (const auto inf = p.w.inf_blocks(2, e, j); !inf.empty()) {
      add_inf_blocks(p, inf, rows, nr, totals, kFc2Groups * kLanes);
    }
    for (int64_t i = 0; i < nr; ++i) {
      const float unshift = exp2i(-h_shift[r0 + i]);
      float* dst = y + (r0 + i) * p.k + j * kBlock;
      for (int c = 0; c < kBlock; ++c) dst[c] = unshift_value(totals[i * kFc2Groups * kLanes + c], unshift);
    }
  }
}

// 6. Finalize: one output row from the y rows of its slots (nullptr: masked / remote slot, skipped),
// FP32 FMAs in slot order from +0, one rounding to the output dtype. Shared by run() and finalize().
void finalize_row(const Elementwise& ew, OutDType d, const float* const* slot_y, const float* slot_w, int64_t topk,
                  int64_t k, float* acc, uint8_t* o) {
  const float* rows[64];
  float weights[64];
  int count = 0;
  for (int64_t s = 0; s < topk; ++s) {
    if (slot_y[s] == nullptr) continue;
    rows[count] = slot_y[s];
    weights[count] = slot_w[s];
    ++count;
  }
  ew.weighted_sum(rows, weights, count, k, acc);  // count = 0 gives exact zeros
  if (d == OutDType::kFP32) {
    std::memcpy(o, acc, static_cast<size_t>(k) * sizeof(float));
    return;
  }
  for (int64_t c = 0; c < k; ++c) {
    const uint16_t v = d == OutDType::kBF16 ? bf16_from_f32(acc[c]) : fp16_from_f32(acc[c]);
    std::memcpy(o + c * 2, &v, 2);
  }
}

void finalize_token(const Pass& p, int64_t t) {
  const auto* slot_row = p.region<int32_t>(p.lay.slot_row);
  const float* y = p.region<float>(p.lay.y);
  const float* slot_y[64];
  for (int64_t s = 0; s < p.topk; ++s) {
    const int32_t r = slot_row[t * p.topk + s];
    slot_y[s] = r < 0 ? nullptr : y + r * p.k;
  }
  float* acc = reinterpret_cast<float*>(p.thread_region(p.lay.pt_acc));
  const OutDType d = p.plan.problem.out_dtype;
  finalize_row(p.ew, d, slot_y, p.in.topk_weights.data() + (p.t0 + t) * p.topk, p.topk, p.k, acc,
               p.out + (p.t0 + t) * p.k * out_dtype_size(d));
}

// run_experts: the y rows of this chunk's local slots, in slot order, to y_slots.
void copy_slots(Pass& p) {
  const auto* slot_row = p.region<int32_t>(p.lay.slot_row);
  const float* y = p.region<float>(p.lay.y);
  int64_t at = p.slot_base;
  for (int64_t i = 0; i < p.tokens * p.topk; ++i) {
    const int32_t r = slot_row[i];
    if (r < 0) continue;
    std::memcpy(p.y_slots + at * p.k, y + r * p.k, static_cast<size_t>(p.k) * sizeof(float));
    ++at;
  }
  p.slot_base = at;
}

Status shift_error(const char* what, int64_t row, int64_t token, const char* recipe) {
  return Status(StatusCode::kInexact,
                std::string(what) + " of token " + std::to_string(token) + " (row " + std::to_string(row) +
                    "): its nonzero magnitudes span more than 2^237, beyond what the avx512bf16 dot products "
                    "compute exactly (" + recipe +
                    "); run it at the ISA level avx512 (FP32 operands; the k3 tool: K3_ISA=avx512)");
}

Status run_chunk(Pass& p) {
  build_routing(p);
  const int threads = p.plan.threads;
  const auto* offset = p.region<int64_t>(p.lay.expert_offset);
  const auto* row_token = p.region<int32_t>(p.lay.row_token);
  const int64_t rows_total = offset[p.e_local];
  const char* recipe = recipe_name(p.plan.problem.recipe);

  // Element-wise steps run on one thread when small (decode): waking the team costs more than
  // the work, and far more on an oversubscribed machine. (Which thread runs a step never
  // changes a bit.)
#pragma omp parallel for num_threads(threads) schedule(static) if (p.tokens * p.k >= kParallelMinElements)
  for (int64_t t = 0; t < p.tokens; ++t) prepare_x(p, t);
  if (p.bf16) {
    const auto* x_shift = p.region<int32_t>(p.lay.x_shift);
    for (int64_t t = 0; t < p.tokens; ++t) {
      if (x_shift[t] == kShiftFail) return shift_error("x row", t, p.t0 + t, recipe);
    }
  }

  const int64_t tiles1 = p.n / kBlock, tiles2 = p.k / kBlock;
  // Decode (few rows per expert): the tasks of the experts in use, split into one contiguous range
  // per thread, so that each thread streams one run of weights (the hardware prefetchers follow
  // one stream far better than many interleaved ones); a thread done early takes the last tasks
  // of the others (run_ranges, cpu/task_ranges.hpp). Larger batches are bound by arithmetic and
  // balance their uneven experts with a dynamic schedule. (Which thread runs a task never changes
  // a bit.)
  const bool streams = rows_total <= kStreamMaxRows;
  int32_t* used = p.region<int32_t>(p.lay.used_experts);
  int64_t n_used = 0;
  auto rows_of = [offset](int64_t e) { return offset[e + 1] - offset[e]; };
  for (int64_t e = 0; e < p.e_local; ++e) {
    if (offset[e + 1] > offset[e]) used[n_used++] = static_cast<int32_t>(e);
  }
  if (streams) {
    run_ranges(threads, n_used * tiles1, [&](int64_t task) { return 1 + rows_of(used[task / tiles1]); },
               [&](int64_t task) { gemm1_task(p, used[task / tiles1], task % tiles1); });
  } else {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t task = 0; task < n_used * tiles1; ++task) gemm1_task(p, used[task / tiles1], task % tiles1);
  }

#pragma omp parallel for num_threads(threads) schedule(static) if (rows_total * p.n >= kParallelMinElements)
  for (int64_t r = 0; r < rows_total; ++r) prepare_h(p, r);
  if (p.bf16) {
    const auto* h_shift = p.region<int32_t>(p.lay.h_shift);
    for (int64_t r = 0; r < rows_total; ++r) {
      if (h_shift[r] == kShiftFail) return shift_error("activation row", r, p.t0 + row_token[r], recipe);
    }
  }

  if (streams) {
    run_ranges(threads, n_used * tiles2, [&](int64_t task) { return 1 + rows_of(used[task / tiles2]); },
               [&](int64_t task) { gemm2_task(p, used[task / tiles2], task % tiles2); });
  } else {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t task = 0; task < n_used * tiles2; ++task) gemm2_task(p, used[task / tiles2], task % tiles2);
  }
  if (p.y_slots != nullptr) {
    copy_slots(p);
    return Status::ok();
  }
  // An inactive region (if false) still numbers its one thread 0, even when run() is called from
  // inside a caller's parallel region: per-thread scratch indices stay below plan.threads.
#pragma omp parallel for num_threads(threads) schedule(static) if (p.tokens * p.k >= kParallelMinElements)
  for (int64_t t = 0; t < p.tokens; ++t) finalize_token(p, t);
  return Status::ok();
}

// Checks shared by run() and run_experts(); the pipeline over chunks of tokens.
Status check_common(const MoePlan& plan, const PackedWeights& weights, const MoeInputsView& in, bool need_weights,
                    std::span<uint8_t> workspace, bool x_quantized = false) {
  const MoeProblem& pr = plan.problem;
  const MoeShape& ws = weights.shape();
  if (ws.hidden != pr.shape.hidden || ws.intermediate != pr.shape.intermediate ||
      ws.num_experts != pr.shape.num_experts || ws.top_k != pr.shape.top_k || ws.ep_size != pr.shape.ep_size ||
      ws.ep_rank != pr.shape.ep_rank) {
    return invalid_argument("weights were prepacked for a different shape than the plan's (K " +
                            std::to_string(ws.hidden) + " N " + std::to_string(ws.intermediate) + " E " +
                            std::to_string(ws.num_experts) + " vs K " + std::to_string(pr.shape.hidden) + " N " +
                            std::to_string(pr.shape.intermediate) + " E " + std::to_string(pr.shape.num_experts) + ")");
  }
  K3_RETURN_IF_ERROR(validate_moe_shape(pr.shape));
  if (in.m < 0 || in.m > plan.max_tokens) {
    return invalid_argument("m = " + std::to_string(in.m) + " must be in [0, plan.max_tokens = " +
                            std::to_string(plan.max_tokens) + "]");
  }
  const int64_t k = pr.shape.hidden;
  if ((!x_quantized && in.x.size() != static_cast<size_t>(in.m * k)) || in.topk_ids.size() != static_cast<size_t>(in.m * pr.shape.top_k) ||
      (need_weights && in.topk_weights.size() != static_cast<size_t>(in.m * pr.shape.top_k))) {
    return invalid_argument("inputs: x has " + std::to_string(in.x.size()) + " elements (expected M*K = " +
                            std::to_string(in.m * k) + "), topk_ids " + std::to_string(in.topk_ids.size()) +
                            " and topk_weights " + std::to_string(in.topk_weights.size()) + " (expected M*top_k = " +
                            std::to_string(in.m * pr.shape.top_k) + ")");
  }
  for (size_t i = 0; i < in.topk_ids.size(); ++i) {
    const int32_t id = in.topk_ids[i];
    if (id < -1 || id >= pr.shape.num_experts) {
      return invalid_argument("topk_ids[" + std::to_string(i / static_cast<size_t>(pr.shape.top_k)) + ", " +
                              std::to_string(i % static_cast<size_t>(pr.shape.top_k)) + "] = " + std::to_string(id) +
                              " must be -1 (masked) or a global expert id in [0, " +
                              std::to_string(pr.shape.num_experts) + ")");
    }
  }
  if (static_cast<int64_t>(workspace.size()) < plan.workspace_bytes) {
    return invalid_argument("workspace has " + std::to_string(workspace.size()) +
                            " bytes, the plan needs workspace_bytes = " + std::to_string(plan.workspace_bytes));
  }
  if (static_cast<int>(plan.isa) > static_cast<int>(best_isa_level())) {
    return unsupported(std::string("plan.isa = ") + isa_level_name(plan.isa) + " is not supported by this CPU");
  }
  return Status::ok();
}

Status run_pipeline(const MoePlan& plan, const PackedWeights& weights, const MoeInputsView& in,
                    std::span<uint8_t> workspace, uint8_t* out, float* y_slots, const Mxfp8Rows& xq = {}) {
  const MoeProblem& pr = plan.problem;
  const int64_t k = pr.shape.hidden;
  const WorkspaceLayout lay = workspace_layout(pr, plan.isa, plan.threads, plan.chunk_tokens);
  const auto addr = reinterpret_cast<uintptr_t>(workspace.data());
  uint8_t* base = workspace.data() + ((64 - (addr & 63)) & 63);
  const bool bf16 = plan.isa == IsaLevel::kAvx512Bf16;
  Pass p{plan,
         weights,
         in,
         lay,
         base,
         out,
         y_slots,
         xq.codes.empty() ? nullptr : xq.codes.data(),
         xq.codes.empty() ? nullptr : xq.scales.data(),
         0,
         bf16 ? tile_gemm_bf16() : tile_gemm_fp32(plan.isa, plan.avx_vnni),
         elementwise(plan.isa),
         bf16,
         uses_int_views(plan.isa),
         k,
         pr.shape.intermediate,
         pr.shape.top_k,
         pr.shape.local_experts(),
         pr.shape.first_local_expert(),
         operand_bytes(plan.isa)};
  for (int64_t t0 = 0; t0 < in.m; t0 += plan.chunk_tokens) {
    p.t0 = t0;
    p.tokens = in.m - t0 < plan.chunk_tokens ? in.m - t0 : plan.chunk_tokens;
    K3_RETURN_IF_ERROR(run_chunk(p));
  }
  return Status::ok();
}

int64_t count_local_slots(const MoeShape& s, std::span<const int32_t> ids) {
  const int64_t lo = s.first_local_expert(), hi = lo + s.local_experts();
  int64_t n = 0;
  for (const int32_t id : ids) n += id >= lo && id < hi ? 1 : 0;
  return n;
}

}  // namespace

Status run(const MoePlan& plan, const PackedWeights& weights, const MoeInputsView& in, std::span<uint8_t> workspace,
           std::span<uint8_t> out) {
  K3_RETURN_IF_ERROR(check_common(plan, weights, in, true, workspace));
  const MoeProblem& pr = plan.problem;
  const int64_t out_bytes = in.m * pr.shape.hidden * out_dtype_size(pr.out_dtype);
  if (static_cast<int64_t>(out.size()) != out_bytes) {
    return invalid_argument("out has " + std::to_string(out.size()) + " bytes, expected M*K*" +
                            std::to_string(out_dtype_size(pr.out_dtype)) + " = " + std::to_string(out_bytes));
  }
  return run_pipeline(plan, weights, in, workspace, out.data(), nullptr);
}

int64_t local_slot_count(const MoeShape& shape, std::span<const int32_t> topk_ids) {
  return count_local_slots(shape, topk_ids);
}

Status run_experts(const MoePlan& plan, const PackedWeights& weights, const MoeInputsView& in,
                   std::span<uint8_t> workspace, std::span<float> y, const Mxfp8Rows& x_mxfp8) {
  const bool xq = !x_mxfp8.codes.empty() || !x_mxfp8.scales.empty();
  if (xq) {
    const int64_t k = plan.problem.shape.hidden;
    if (plan.problem.recipe != Recipe::kW4A8) {
      return invalid_argument("x_mxfp8: pre-quantized rows are W4A8 operands; the plan's recipe is w4a16");
    }
    if (!in.x.empty()) return invalid_argument("x_mxfp8 given: inputs.x must be empty (one source of x)");
    if (x_mxfp8.codes.size() != static_cast<size_t>(in.m * k) || x_mxfp8.scales.size() != static_cast<size_t>(in.m * k / 32)) {
      return invalid_argument("x_mxfp8: codes has " + std::to_string(x_mxfp8.codes.size()) + " bytes and scales " +
                              std::to_string(x_mxfp8.scales.size()) + ", expected M*K = " + std::to_string(in.m * k) +
                              " and M*K/32 = " + std::to_string(in.m * k / 32));
    }
  }
  K3_RETURN_IF_ERROR(check_common(plan, weights, in, false, workspace, xq));
  const int64_t slots = count_local_slots(plan.problem.shape, in.topk_ids);
  const int64_t k = plan.problem.shape.hidden;
  if (static_cast<int64_t>(y.size()) != slots * k) {
    return invalid_argument("y has " + std::to_string(y.size()) + " floats, expected local slots * K = " +
                            std::to_string(slots) + " * " + std::to_string(k) + " = " + std::to_string(slots * k));
  }
  return run_pipeline(plan, weights, in, workspace, nullptr, y.data(), x_mxfp8);
}

Status quantize_x_mxfp8(const MoePlan& plan, std::span<const uint16_t> x, std::span<uint8_t> codes,
                        std::span<uint8_t> scales) {
  const int64_t k = plan.problem.shape.hidden;
  if (x.size() % static_cast<size_t>(k) != 0 || codes.size() != x.size() || scales.size() != x.size() / kBlock) {
    return invalid_argument("quantize_x_mxfp8: x has " + std::to_string(x.size()) + " elements (a multiple of K = " +
                            std::to_string(k) + "), codes " + std::to_string(codes.size()) + " bytes (= x) and scales " +
                            std::to_string(scales.size()) + " (= x / 32)");
  }
  const Elementwise& ew = elementwise(plan.isa);
  const int64_t blocks = static_cast<int64_t>(x.size()) / kBlock;
#pragma omp parallel for num_threads(plan.threads) schedule(static) if (blocks * kBlock >= kParallelMinElements)
  for (int64_t b = 0; b < blocks; ++b) {
    float vals[kBlock];
    for (int i = 0; i < kBlock; ++i) vals[i] = bf16_to_f32(x[static_cast<size_t>(b * kBlock + i)]);
    scales[static_cast<size_t>(b)] = ew.quantize_e4m3_block(vals, codes.data() + b * kBlock);
  }
  return Status::ok();
}

Status finalize(const MoePlan& plan, int64_t m, std::span<const float> topk_weights,
                std::span<const float* const> slot_y, std::span<float> scratch, std::span<uint8_t> out) {
  const MoeProblem& pr = plan.problem;
  const int64_t k = pr.shape.hidden, topk = pr.shape.top_k;
  if (m < 0) return invalid_argument("m = " + std::to_string(m) + " must be >= 0");
  if (topk_weights.size() != static_cast<size_t>(m * topk) || slot_y.size() != static_cast<size_t>(m * topk)) {
    return invalid_argument("finalize: topk_weights has " + std::to_string(topk_weights.size()) + " and slot_y " +
                            std::to_string(slot_y.size()) + " entries, expected M*top_k = " + std::to_string(m * topk));
  }
  if (static_cast<int64_t>(scratch.size()) < k) {
    return invalid_argument("finalize: scratch has " + std::to_string(scratch.size()) + " floats, needs K = " +
                            std::to_string(k));
  }
  const int64_t out_bytes = m * k * out_dtype_size(pr.out_dtype);
  if (static_cast<int64_t>(out.size()) != out_bytes) {
    return invalid_argument("finalize: out has " + std::to_string(out.size()) + " bytes, expected M*K*" +
                            std::to_string(out_dtype_size(pr.out_dtype)) + " = " + std::to_string(out_bytes));
  }
  const Elementwise& ew = elementwise(plan.isa);
  for (int64_t t = 0; t < m; ++t) {
    finalize_row(ew, pr.out_dtype, slot_y.data() + t * topk, topk_weights.data() + t * topk, topk, k, scratch.data(),
                 out.data() + t * k * out_dtype_size(pr.out_dtype));
  }
  return Status::ok();
}

}  // namespace k3::cpu
