// The CPU linear layer: plan, prepack, run (k3/cpu_linear.hpp, docs/linear.md).
#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <sstream>

#include "cpu/linear/kernels.hpp"
#include "cpu/moe/elementwise.hpp"
#include "k3/cpu_moe.hpp"  // kMaxThreads
#include "k3/formats.hpp"
#include "k3/mx.hpp"

namespace k3::cpu {
namespace lin {
namespace {

std::array<float, 256> make_e4m3_table() {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) t[static_cast<size_t>(c)] = e4m3_to_f32(static_cast<uint8_t>(c));
  return t;
}
const std::array<float, 256> kE4m3 = make_e4m3_table();

}  // namespace

void tile_portable(const PackedLinear& w, int64_t tile, const float* x, float* tot16) {
  const int64_t blocks = w.k() / kBlock;
  const uint8_t* codes = w.tile_codes(tile);
  const uint8_t* scales = w.tile_scales(tile);
  const bool b16 = w.bf16_weights();
  auto weight = [&](int64_t b, int k, int c) {
    const int64_t i = w.code_offset(b, k, c);
    if (!b16) return kE4m3[codes[i]];
    uint16_t h;
    std::memcpy(&h, codes + 2 * i, 2);
    return bf16_to_f32(h);
  };
  for (int c = 0; c < kLanes; ++c) {
    float total = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      float partial = 0.0f;
      for (int k = 0; k < kBlock; k += 2) {  // per pair: odd element, then even
        partial = std::fma(weight(b, k + 1, c), x[b * kBlock + k + 1], partial);
        partial = std::fma(weight(b, k, c), x[b * kBlock + k], partial);
      }
      total = std::fma(partial, e8m0_to_f32(scales[b * kLanes + c]), total);
    }
    tot16[c] = total;
  }
}

}  // namespace lin

using lin::kBlock;
using lin::kLanes;

namespace {

constexpr int64_t kAlign = 64;
int64_t align_up(int64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }
// Operand row strides: K (or K/2 pairs) plus one cache line, so that rows a power of two of bytes
// long do not all map to the same L1 sets (K = 4096 ran at half speed without it).
int64_t ld_xs(int64_t k) { return k + 16; }
int64_t ld_xb(int64_t k) { return k / 2 + 16; }

bool isa_supported(IsaLevel level) { return static_cast<int>(level) <= static_cast<int>(best_isa_level()); }

// Workspace regions (offsets from the 64-byte aligned base).
struct Layout {
  int64_t rows_cap = 0;
  int64_t xs = 0, xb = 0, cls = 0, qcodes = 0, qscales = 0, stream_tot = 0, per_thread = 0, thread_bytes = 0;
  int64_t total = 0;
};

Layout layout_of(const LinearPlan& p) {
  Layout l;
  const int64_t k = p.problem.k;
  l.rows_cap = std::max<int64_t>(std::min(p.chunk_tokens, p.max_tokens), p.stream_max_rows);
  int64_t off = 0;
  l.xs = off;
  off += align_up(l.rows_cap * ld_xs(k) * 4);
  l.xb = off;
  if (p.pair_layout) off += align_up(l.rows_cap * ld_xb(k) * 4);
  l.cls = off;
  off += align_up(l.rows_cap);
  l.qcodes = off;
  if (p.problem.recipe == LinearRecipe::kW8A8) off += align_up(l.rows_cap * k);
  l.qscales = off;
  if (p.problem.recipe == LinearRecipe::kW8A8) off += align_up(l.rows_cap * (k / kBlock));
  l.stream_tot = off;
  off += align_up(int64_t{p.stream_max_rows} * p.tiles * kLanes * 4);
  l.per_thread = off;
  // panel + totals [rows_cap][16] + one exact operand row (K floats) + 16 totals
  // (the BF16 panel of two tiles is the size of one FP32 panel; their totals take [rows_cap][32])
  l.thread_bytes = align_up(lin::kPanelBytes) + align_up(l.rows_cap * 2 * kLanes * 4) + align_up(k * 4) + align_up(kLanes * 4);
  off += l.thread_bytes * p.threads;
  l.total = off + kAlign;  // room to align the caller's pointer
  return l;
}

const char* stream_kernel_name(IsaLevel l, bool pairs, bool b16) {
  if (pairs) return "avx512bf16 vdpbf16ps (e4m3 via gf2p8affineqb; blocks with zero or subnormal codes via vpermt2b)";
  switch (l) {
    case IsaLevel::kScalar: return "portable";
    case IsaLevel::kAvx2: return b16 ? "avx2 fp32 fma (bf16 weights)" : "avx2 fp32 fma (e4m3 by shifts)";
    default: return b16 ? "avx512 fp32 fma (bf16 weights)" : "avx512 fp32 fma (e4m3 by shifts)";
  }
}
const char* panel_kernel_name(IsaLevel l, bool pairs, bool b16) {
  if (pairs) return "avx512bf16 vdpbf16ps, 6x32 register tile, totals in registers";
  switch (l) {
    case IsaLevel::kScalar: return "portable";
    case IsaLevel::kAvx2: return b16 ? "avx2 fp32 fma (bf16 weights), 6x16 register tile" : "avx2 fp32 fma, 6x16 register tile";
    default: return b16 ? "avx512 fp32 fma (bf16 weights), 12x16 register tile" : "avx512 fp32 fma, 12x16 register tile";
  }
}

constexpr uint32_t kBits2p120 = 0x7B800000u;   // 2^120
constexpr uint32_t kBits2p8 = 0x43800000u;     // 2^8
constexpr uint32_t kBits2p114 = 0x78800000u;   // 2^114
constexpr uint32_t kBits2m110 = 0x08800000u;   // 2^-110

// x' = x 2^8 in stored order (FP32 kernels; xs null on the pair layout; BF16 weights: x' = x,
// every row in range), the BF16 pairs of x 2^8 (VDPBF16PS kernels), and the row's class, from the
// exact operand values v (natural order). below_2p8: set to whether every finite |x| < 2^8 (the
// stream kernels' x' = x 2^120 is then exact).
uint8_t prep_row(const float* v, int64_t k, float* xs, uint32_t* xb, bool b16 = false, bool* below_2p8 = nullptr) {
  if (b16) {
    for (int64_t i = 0; i < k; i += 2) {
      xs[i] = v[i + 1];
      xs[i + 1] = v[i];
    }
    return lin::kRowFp32;
  }
  uint32_t amax_finite = 0, amin_nonzero = 0xFFFFFFFFu;
  bool nonfinite = false;
  for (int64_t i = 0; i < k; ++i) {
    const uint32_t a = f32_to_bits(v[i]) & 0x7FFFFFFFu;
    nonfinite |= a >= 0x7F800000u;
    if (a < 0x7F800000u && a > amax_finite) amax_finite = a;
    if (a != 0 && a < amin_nonzero) amin_nonzero = a;
  }
  if (below_2p8 != nullptr) *below_2p8 = amax_finite < kBits2p8;
  if (amax_finite >= kBits2p120) return lin::kRowPortable;
  if (xs != nullptr) {
    for (int64_t i = 0; i < k; i += 2) {
      xs[i] = v[i + 1] * 256.0f;
      xs[i + 1] = v[i] * 256.0f;
    }
  }
  const bool bf16 = !nonfinite && amax_finite < kBits2p114 && (amin_nonzero == 0xFFFFFFFFu || amin_nonzero >= kBits2m110);
  if (xb != nullptr) {  // x 2^8 (exact in BF16: BF16 values or MXFP8 values in the window, times 2^8)
    for (int64_t i = 0; i < k; i += 2)
      xb[i / 2] = bf16 ? ((f32_to_bits(v[i] * 256.0f) >> 16) | (f32_to_bits(v[i + 1] * 256.0f) & 0xFFFF0000u)) : 0u;
  }
  return bf16 ? lin::kRowBf16 : lin::kRowFp32;
}

// One rounding per element, 16 columns at a time; the dtype switch is outside the inner loops so
// that they vectorize.
void store_row(const LinearPlan& p, const PackedLinear& w, int64_t row, int64_t col0, int64_t cols, const float* tot,
               uint8_t* out) {
  const float* bias = w.bias();
  for (int64_t c0 = 0; c0 < cols; c0 += kLanes) {
    const int64_t nc = std::min<int64_t>(kLanes, cols - c0);
    float v[kLanes];
    for (int64_t c = 0; c < nc; ++c) v[c] = bias != nullptr ? tot[c0 + c] + bias[col0 + c0 + c] : tot[c0 + c];
    const int64_t idx = row * p.problem.n + col0 + c0;
    uint16_t h[kLanes];
    switch (p.problem.out_dtype) {
      case OutDType::kFP32: std::memcpy(out + idx * 4, v, static_cast<size_t>(nc) * 4); break;
      case OutDType::kBF16:
        for (int64_t c = 0; c < nc; ++c) h[c] = bf16_from_f32(v[c]);
        std::memcpy(out + idx * 2, h, static_cast<size_t>(nc) * 2);
        break;
      case OutDType::kFP16:
        for (int64_t c = 0; c < nc; ++c) h[c] = fp16_from_f32(v[c]);
        std::memcpy(out + idx * 2, h, static_cast<size_t>(nc) * 2);
        break;
    }
  }
}

// The exact operand values of one row (natural order), from BF16 x or MXFP8 codes + scales.
void operand_values(const LinearPlan& p, const uint16_t* x, const uint8_t* qc, const uint8_t* qs, float* v) {
  const int64_t k = p.problem.k;
  if (qc != nullptr) {
    for (int64_t b = 0; b < k / kBlock; ++b) {
      const float f = e8m0_to_f32(qs[b]);
      for (int i = 0; i < kBlock; ++i) v[b * kBlock + i] = lin::kE4m3[qc[b * kBlock + i]] * f;
    }
  } else {
    for (int64_t i = 0; i < k; ++i) v[i] = bf16_to_f32(x[i]);
  }
}


// The W8A8 quantizer of one row: MXFP8 codes [K] and scales [K/32] (the codec's bits).
void quantize_row(const detail::Elementwise& ew, const uint16_t* x, int64_t k, uint8_t* codes, uint8_t* scales) {
  float v[kBlock];
  for (int64_t b = 0; b < k / kBlock; ++b) {
    for (int i = 0; i < kBlock; ++i) v[i] = bf16_to_f32(x[b * kBlock + i]);
    scales[b] = ew.quantize_e4m3_block(v, codes + b * kBlock);
  }
}

// The FP32 kernels' w 2^-120 of a subnormal E4M3 code is an FP32 subnormal, which an FMA or
// multiply would read as zero under MXCSR.DAZ (set by some libraries and by
// torch.set_flush_denormal): the kernels clear DAZ on their thread and restore it after.
class DazOff {
 public:
#if defined(__x86_64__) || defined(__i386__)
  DazOff() : csr_(_mm_getcsr()) {
    if ((csr_ & kDaz) != 0) _mm_setcsr(csr_ & ~kDaz);
  }
  ~DazOff() {
    if ((csr_ & kDaz) != 0) _mm_setcsr(csr_);
  }

 private:
  static constexpr unsigned kDaz = 0x40;
  unsigned csr_;
#endif
};

Status check_plan(const LinearPlan& p) {
  if (auto st = validate_linear_problem(p.problem); !st.is_ok()) return st;
  if (p.tiles != (p.problem.n + kLanes - 1) / kLanes || p.threads < 1 || p.max_tokens < 1)
    return invalid_argument("linear: the plan was not made by k3::cpu::plan()");
  return Status::ok();
}

}  // namespace

std::string LinearPlan::describe() const {
  std::ostringstream o;
  o << "linear cpu: K " << problem.k << " -> N " << problem.n << ", " << linear_recipe_name(problem.recipe) << ", out "
    << out_dtype_name(problem.out_dtype) << (problem.bias ? ", bias" : "") << "; isa " << isa_level_name(isa)
    << ", threads " << threads << ", tiles " << tiles << " x 16 columns; stream (M <= " << stream_max_rows
    << "): " << stream_kernel << "; panel: " << panel_kernel << ", chunk " << chunk_tokens << " rows; max_tokens "
    << max_tokens << "; workspace " << workspace_bytes << " bytes";
  return o.str();
}

Result<LinearPlan> plan(const LinearProblem& problem, const LinearOptions& options) {
  if (auto st = validate_linear_problem(problem); !st.is_ok()) return st;
  LinearPlan p;
  p.problem = problem;
  p.isa = options.isa.value_or(best_isa_level());
  if (!isa_supported(p.isa))
    return unsupported(std::string("linear: isa = ") + isa_level_name(p.isa) + " is above this CPU's best level " +
                       isa_level_name(best_isa_level()));
  if (options.threads < 0 || options.threads > kMaxThreads)
    return invalid_argument("linear: threads = " + std::to_string(options.threads) + " must be in [0, " +
                            std::to_string(kMaxThreads) + "] (0: all logical CPUs)");
  p.threads = options.threads == 0 ? std::min(hardware_thread_count(), kMaxThreads) : options.threads;
  if (options.max_tokens < 1 || options.max_tokens > (int64_t{1} << 24))
    return invalid_argument("linear: max_tokens = " + std::to_string(options.max_tokens) + " must be in [1, 2^24]");
  if (options.chunk_tokens < 16 || options.chunk_tokens > 4096)
    return invalid_argument("linear: chunk_tokens = " + std::to_string(options.chunk_tokens) + " must be in [16, 4096]");
  if (options.stream_max_rows < 0 || options.stream_max_rows > 8)
    return invalid_argument("linear: stream_max_rows = " + std::to_string(options.stream_max_rows) + " must be in [0, 8]");
  p.max_tokens = options.max_tokens;
  p.chunk_tokens = std::min(options.chunk_tokens, options.max_tokens);
  if (p.chunk_tokens < 16) p.chunk_tokens = 16;
  p.stream_max_rows = options.stream_max_rows;
  p.tiles = (problem.n + kLanes - 1) / kLanes;
  // W16A16: VDPBF16PS is not exact for BF16 x BF16 sums, so the avx512bf16 level runs the AVX-512
  // FP32 kernels.
  const bool b16 = problem.recipe == LinearRecipe::kW16A16;
  p.pair_layout = p.isa == IsaLevel::kAvx512Bf16 && !b16 && lin::bf16_kernels_available();
  p.stream_kernel = stream_kernel_name(p.isa, p.pair_layout, b16);
  p.panel_kernel = panel_kernel_name(p.isa, p.pair_layout, b16);
  p.workspace_bytes = layout_of(p).total;
  return p;
}

Result<PackedLinear> prepack(const LinearPlan& plan, const LinearWeightsView& weights) {
  if (auto st = check_plan(plan); !st.is_ok()) return st;
  if (auto st = validate_linear_weights(plan.problem, weights); !st.is_ok()) return st;
  const int64_t k = plan.problem.k, n = plan.problem.n, blocks = k / kBlock;
  PackedLinear w;
  w.k_ = k;
  w.n_ = n;
  w.pair_layout_ = plan.pair_layout;
  w.bf16_weights_ = plan.problem.recipe == LinearRecipe::kW16A16;
  w.scales_.assign(static_cast<size_t>(plan.tiles * blocks * kLanes), 127);
  if (w.bf16_weights_) {
    w.codes_.assign(static_cast<size_t>(plan.tiles * k * kLanes * 2), 0);
    for (int64_t row = 0; row < n; ++row) {
      uint8_t* tc = w.codes_.data() + (row / kLanes) * k * kLanes * 2;
      const uint16_t* src = weights.bf16.data() + row * k;
      for (int64_t kk = 0; kk < k; ++kk)
        std::memcpy(tc + 2 * w.code_offset(kk / kBlock, static_cast<int>(kk % kBlock), static_cast<int>(row % kLanes)),
                    src + kk, 2);
    }
    if (plan.problem.bias) w.bias_.assign(weights.bias.begin(), weights.bias.end());
    return w;
  }
  w.codes_.assign(static_cast<size_t>(plan.tiles * k * kLanes), 0);
  for (int64_t row = 0; row < n; ++row) {
    const int64_t t = row / kLanes, c = row % kLanes;
    uint8_t* tc = w.codes_.data() + t * k * kLanes;
    uint8_t* ts = w.scales_.data() + t * blocks * kLanes;
    const uint8_t* src = weights.codes.data() + row * k;
    for (int64_t kk = 0; kk < k; ++kk) tc[w.code_offset(kk / kBlock, static_cast<int>(kk % kBlock), static_cast<int>(c))] = src[kk];
    for (int64_t b = 0; b < blocks; ++b) ts[b * kLanes + c] = weights.scales[static_cast<size_t>(row * blocks + b)];
  }
  if (w.pair_layout_) {
    // A block is "normal" when each of its 32 x 16 codes (padding columns included: code 0) has a
    // nonzero exponent field.
    w.normal_.assign(static_cast<size_t>(plan.tiles * blocks), 1);
    for (int64_t t = 0; t < plan.tiles; ++t) {
      const uint8_t* tc = w.codes_.data() + t * k * kLanes;
      for (int64_t b = 0; b < blocks; ++b) {
        bool normal = true;
        for (int64_t i = 0; i < kBlock * kLanes && normal; ++i) normal = (tc[b * kBlock * kLanes + i] & 0x78) != 0;
        w.normal_[static_cast<size_t>(t * blocks + b)] = normal ? 1 : 0;
      }
    }
  }
  if (plan.problem.bias) w.bias_.assign(weights.bias.begin(), weights.bias.end());
  return w;
}

int64_t PackedLinear::normal_blocks() const {
  int64_t n = 0;
  for (const uint8_t v : normal_) n += v;
  return n;
}

namespace {

// x (BF16) or pre-quantized codes + scales -> the result (shared by run and run_quantized).
Status run_impl(const LinearPlan& p, const PackedLinear& w, int64_t m, const uint16_t* x, const uint8_t* xq,
                const uint8_t* xqs, std::span<uint8_t> workspace, std::span<uint8_t> out) {
  if (w.k() != p.problem.k || w.n() != p.problem.n || (w.bias() != nullptr) != p.problem.bias ||
      w.pair_layout() != p.pair_layout || w.bf16_weights() != (p.problem.recipe == LinearRecipe::kW16A16))
    return invalid_argument("linear: the packed weights (K " + std::to_string(w.k()) + ", N " + std::to_string(w.n()) +
                            ") do not belong to this plan (K " + std::to_string(p.problem.k) + ", N " +
                            std::to_string(p.problem.n) + ")");
  if (m > p.max_tokens)
    return invalid_argument("linear: m = " + std::to_string(m) + " exceeds the plan's max_tokens = " +
                            std::to_string(p.max_tokens));
  const Layout l = layout_of(p);
  if (static_cast<int64_t>(workspace.size()) < l.total)
    return invalid_argument("linear: workspace has " + std::to_string(workspace.size()) + " bytes; the plan needs " +
                            std::to_string(l.total));
  if (m == 0) return {};
  uint8_t* base = workspace.data();
  base += (kAlign - reinterpret_cast<uintptr_t>(base) % kAlign) % kAlign;
  const int64_t k = p.problem.k, n = p.problem.n, blocks = k / kBlock;
  float* xs = reinterpret_cast<float*>(base + l.xs);
  uint32_t* xb = p.pair_layout ? reinterpret_cast<uint32_t*>(base + l.xb) : nullptr;
  uint8_t* cls = base + l.cls;
  uint8_t* qc = base + l.qcodes;
  uint8_t* qs = base + l.qscales;
  const detail::Elementwise& ew = detail::elementwise(p.isa);
  const bool w8a8 = p.problem.recipe == LinearRecipe::kW8A8;
  const bool b16 = p.problem.recipe == LinearRecipe::kW16A16;
  const int out_size = out_dtype_size(p.problem.out_dtype);
  auto thread_mem = [&](int tid) { return base + l.per_thread + l.thread_bytes * tid; };
  // Scratch of one thread: panel, totals [rows_cap][16], one operand row, 16 totals.
  auto t_panel = [&](int tid) { return static_cast<void*>(thread_mem(tid)); };
  auto t_tot = [&](int tid) { return reinterpret_cast<float*>(thread_mem(tid) + align_up(lin::kPanelBytes)); };
  auto t_row = [&](int tid) {
    return reinterpret_cast<float*>(thread_mem(tid) + align_up(lin::kPanelBytes) + align_up(l.rows_cap * 2 * kLanes * 4));
  };
  auto t_tot16 = [&](int tid) {
    return reinterpret_cast<float*>(thread_mem(tid) + align_up(lin::kPanelBytes) + align_up(l.rows_cap * 2 * kLanes * 4) +
                                    align_up(k * 4));
  };
  // The exact operand row r of the call (for the portable body).
  auto exact_row = [&](int64_t r, float* v) {
    if (xq != nullptr) {
      operand_values(p, nullptr, xq + r * k, xqs + r * blocks, v);
    } else if (w8a8) {
      uint8_t codes[kBlock];
      float f[kBlock];
      for (int64_t b = 0; b < blocks; ++b) {
        for (int i = 0; i < kBlock; ++i) f[i] = bf16_to_f32(x[r * k + b * kBlock + i]);
        const uint8_t s = ew.quantize_e4m3_block(f, codes);
        const float sf = e8m0_to_f32(s);
        for (int i = 0; i < kBlock; ++i) v[b * kBlock + i] = lin::kE4m3[codes[i]] * sf;
      }
    } else {
      operand_values(p, x + r * k, nullptr, nullptr, v);
    }
  };
  // Rows the level's kernel cannot take exactly: the portable body.
  const uint8_t need = p.pair_layout ? lin::kRowBf16 : lin::kRowFp32;
  const bool scalar = p.isa == IsaLevel::kScalar;

  if (m <= p.stream_max_rows) {
    // ---- stream route: operands prepared here (W8A8 quantized inside the call), then each thread
    // streams a contiguous range of tiles.
    float* v = t_row(0);
    // E4M3 weights on the FP32 layout: x' = x 2^120 when every row's finite |x| < 2^8 (the
    // kernels then use w 2^-120 as widened, without the multiply by 2^112).
    bool x120 = !scalar && !p.pair_layout && !b16;
    for (int64_t r = 0; r < m; ++r) {
      exact_row(r, v);
      bool small = false;
      cls[r] = scalar ? static_cast<uint8_t>(lin::kRowPortable)
                      : prep_row(v, k, xb == nullptr ? xs + r * ld_xs(k) : nullptr, xb == nullptr ? nullptr : xb + r * ld_xb(k), b16,
                                 &small);
      if (cls[r] != lin::kRowPortable && !small) x120 = false;
    }
    if (x120)
      for (int64_t r = 0; r < m; ++r)
        if (cls[r] != lin::kRowPortable)
          for (int64_t i = 0; i < k; ++i) xs[r * ld_xs(k) + i] *= 0x1p112f;  // x 2^8 -> x 2^120, exact
    float* stot = reinterpret_cast<float*>(base + l.stream_tot);
    const lin::Operand op{xs, xb, cls, static_cast<int>(m), ld_xs(k), ld_xb(k), x120};
    const int threads = static_cast<int>(std::min<int64_t>(p.threads, p.tiles));
#pragma omp parallel num_threads(threads)
    {
      const DazOff daz;
      const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t t0 = p.tiles * tid / nt, t1 = p.tiles * (tid + 1) / nt;
      if (t1 > t0) {
        float* tot = stot + t0 * kLanes * m;  // this thread's [m][(t1 - t0) * 16]
        const int64_t ldt = (t1 - t0) * kLanes;
        if (p.pair_layout) lin::stream_bf16(w, op, t0, t1, tot);
        else if (p.isa == IsaLevel::kAvx2) lin::stream_avx2(w, op, t0, t1, tot);
        else if (!scalar) lin::stream_avx512(w, op, t0, t1, tot);
        float* row = t_row(tid);
        for (int64_t r = 0; r < m; ++r) {
          if (cls[r] >= need) continue;
          exact_row(r, row);
          for (int64_t t = t0; t < t1; ++t) lin::tile_portable(w, t, row, tot + r * ldt + (t - t0) * kLanes);
        }
        for (int64_t r = 0; r < m; ++r)
          store_row(p, w, r, t0 * kLanes, std::min(t1 * kLanes, n) - t0 * kLanes, tot + r * ldt, out.data());
      }
    }
    return Status::ok();
  }

  // ---- panel route: per chunk of rows, the operands are prepared in parallel (W8A8: the separate
  // quantizer first), then the tiles are shared out dynamically.
  for (int64_t c0 = 0; c0 < m; c0 += p.chunk_tokens) {
    const int64_t rows = std::min(p.chunk_tokens, m - c0);
#pragma omp parallel num_threads(p.threads)
    {
      const DazOff daz;
      const int tid = omp_get_thread_num();
      float* v = t_row(tid);
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* rc = nullptr;
        const uint8_t* rs = nullptr;
        if (xq != nullptr) {
          rc = xq + (c0 + r) * k;
          rs = xqs + (c0 + r) * blocks;
        } else if (w8a8) {
          quantize_row(ew, x + (c0 + r) * k, k, qc + r * k, qs + r * blocks);
          rc = qc + r * k;
          rs = qs + r * blocks;
        }
        if (rc != nullptr) operand_values(p, nullptr, rc, rs, v);
        else operand_values(p, x + (c0 + r) * k, nullptr, nullptr, v);
        cls[r] = scalar ? static_cast<uint8_t>(lin::kRowPortable)
                        : prep_row(v, k, xb == nullptr ? xs + r * ld_xs(k) : nullptr, xb == nullptr ? nullptr : xb + r * ld_xb(k), b16);
      }
      // (implicit barrier)
      const lin::Operand op{xs, xb, cls, static_cast<int>(rows), ld_xs(k), ld_xb(k)};
      float* tot = t_tot(tid);
      float* row = t_row(tid);
      float* tot16 = t_tot16(tid);
// Tasks of one tile (two on the VDPBF16PS kernel, which shares each broadcast between them).
      const int64_t per = p.pair_layout ? 2 : 1;
      const int64_t tasks = (p.tiles + per - 1) / per;
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < tasks; ++task) {
        const int64_t t0 = task * per;
        const int nt = static_cast<int>(std::min(per, p.tiles - t0));
        if (p.pair_layout) lin::panel_bf16(w, op, t0, nt, t_panel(tid), tot);
        else if (p.isa == IsaLevel::kAvx2) lin::panel_avx2(w, op, t0, t_panel(tid), tot);
        else if (!scalar) lin::panel_avx512(w, op, t0, t_panel(tid), tot);
        for (int g = 0; g < nt; ++g) {
          const int64_t t = t0 + g;
          const int64_t cols = std::min((t + 1) * kLanes, n) - t * kLanes;
          for (int64_t r = 0; r < rows; ++r) {
            const float* tr = tot + (r * nt + g) * kLanes;
            if (cls[r] < need) {
              exact_row(c0 + r, row);
              lin::tile_portable(w, t, row, tot16);
              tr = tot16;
            }
            store_row(p, w, c0 + r, t * kLanes, cols, tr, out.data());
          }
        }
      }
    }
  }
  (void)out_size;
  return Status::ok();
}

}  // namespace

Status run(const LinearPlan& plan, const PackedLinear& weights, int64_t m, std::span<const uint16_t> x,
           std::span<uint8_t> workspace, std::span<uint8_t> out) {
  if (auto st = check_plan(plan); !st.is_ok()) return st;
  if (auto st = validate_linear_io(plan.problem, m, x, out); !st.is_ok()) return st;
  return run_impl(plan, weights, m, x.data(), nullptr, nullptr, workspace, out);
}

Status quantize_x(const LinearPlan& plan, int64_t rows, std::span<const uint16_t> x, std::span<uint8_t> codes,
                  std::span<uint8_t> scales) {
  if (auto st = check_plan(plan); !st.is_ok()) return st;
  const int64_t k = plan.problem.k;
  if (rows < 0) return invalid_argument("linear quantize_x: rows = " + std::to_string(rows) + " must be >= 0");
  if (static_cast<int64_t>(x.size()) != rows * k)
    return invalid_argument("linear quantize_x: x has " + std::to_string(x.size()) + " values; expected rows x K = " +
                            std::to_string(rows * k));
  if (static_cast<int64_t>(codes.size()) != rows * k)
    return invalid_argument("linear quantize_x: codes has " + std::to_string(codes.size()) + " bytes; expected " +
                            std::to_string(rows * k));
  if (static_cast<int64_t>(scales.size()) != rows * (k / kBlock))
    return invalid_argument("linear quantize_x: scales has " + std::to_string(scales.size()) + " bytes; expected " +
                            std::to_string(rows * (k / kBlock)));
  const detail::Elementwise& ew = detail::elementwise(plan.isa);
#pragma omp parallel for num_threads(plan.threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    quantize_row(ew, x.data() + r * k, k, codes.data() + r * k, scales.data() + r * (k / kBlock));
  return Status::ok();
}

Status run_quantized(const LinearPlan& plan, const PackedLinear& weights, int64_t m, std::span<const uint8_t> x_codes,
                     std::span<const uint8_t> x_scales, std::span<uint8_t> workspace, std::span<uint8_t> out) {
  if (auto st = check_plan(plan); !st.is_ok()) return st;
  if (plan.problem.recipe != LinearRecipe::kW8A8)
    return invalid_argument(std::string("linear run_quantized: the plan's recipe is ") +
                            linear_recipe_name(plan.problem.recipe) + "; pre-quantized x needs a w8a8 plan");
  const int64_t k = plan.problem.k;
  if (m < 0) return invalid_argument("linear: m = " + std::to_string(m) + " must be >= 0");
  if (static_cast<int64_t>(x_codes.size()) != m * k || static_cast<int64_t>(x_scales.size()) != m * (k / kBlock))
    return invalid_argument("linear run_quantized: x_codes / x_scales have " + std::to_string(x_codes.size()) + " / " +
                            std::to_string(x_scales.size()) + " bytes; expected " + std::to_string(m * k) + " / " +
                            std::to_string(m * (k / kBlock)));
  const int64_t want = m * plan.problem.n * out_dtype_size(plan.problem.out_dtype);
  if (static_cast<int64_t>(out.size()) != want)
    return invalid_argument("linear: out has " + std::to_string(out.size()) + " bytes; expected " + std::to_string(want));
  return run_impl(plan, weights, m, nullptr, x_codes.data(), x_scales.data(), workspace, out);
}

}  // namespace k3::cpu
