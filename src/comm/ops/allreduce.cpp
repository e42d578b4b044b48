// Tensor-parallel all-reduce (k3/allreduce.hpp): argument agreement, then per round of whole
// rows a two-shot exchange — alltoallv of each rank's partial elements to the owner of their
// 16-byte-pack shard, an exact reduction (+ residual add) of the owned elements, allgatherv of
// the results — and, for the epilogue, the RMSNorm of every row on every rank.
#include "k3/allreduce.hpp"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <new>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/ops/exact_sum.hpp"
#include "k3/formats.hpp"

namespace k3::comm {
namespace {

constexpr int64_t kDefaultCallBytes = int64_t{1} << 30;
constexpr int64_t kMaxCallBytes = (int64_t{1} << 31) - 1;
constexpr int kMaxThreads = 1024;

std::string str(int64_t v) { return std::to_string(v); }

template <typename A, typename B>
bool overlaps(std::span<A> a, std::span<B> b) {
  if (a.empty() || b.empty()) return false;
  const auto a0 = reinterpret_cast<uintptr_t>(a.data()), a1 = a0 + a.size_bytes();
  const auto b0 = reinterpret_cast<uintptr_t>(b.data()), b1 = b0 + b.size_bytes();
  return a0 < b1 && b0 < a1;
}

// What every rank publishes before data moves (the agreement allgather).
struct Header {
  int32_t ok = 0;
  int32_t has_residual = 0;
  int64_t rows = 0, cols = 0, max_call_bytes = 0;
  uint32_t eps_bits = 0, reserved = 0;
  uint64_t gamma_digest = 0;
};

// FNV-1a over 64-bit words (4 BF16 at a time: one multiply per word keeps it cheap next to the
// reduction), then the tail element by element. A digest for the agreement check, not a MAC.
uint64_t fnv1a(std::span<const uint16_t> v) {
  uint64_t h = 0xcbf29ce484222325ull;
  size_t i = 0;
  for (; i + 4 <= v.size(); i += 4) {
    uint64_t word;
    std::memcpy(&word, v.data() + i, sizeof word);
    h = (h ^ word) * 0x100000001b3ull;
  }
  for (; i < v.size(); ++i) h = (h ^ v[i]) * 0x100000001b3ull;
  return h;
}

struct Call {
  const char* fn;
  std::span<const uint16_t> x, residual, gamma;
  int64_t rows, cols;
  float eps;
  std::span<uint16_t> out, residual_out;
  AllreduceOptions opt;
  bool norm;  // allreduce_add_rmsnorm_bf16
};

Status check_size(const char* fn, const char* name, size_t got, int64_t want, const std::string& as) {
  if (static_cast<int64_t>(got) != want) {
    return invalid_argument(std::string(fn) + ": " + name + " has " + str(static_cast<int64_t>(got)) +
                            " elements, expected " + as + " = " + str(want));
  }
  return Status::ok();
}

// This rank's verdict on its own arguments.
Status validate_local(const Call& c) {
  const std::string fn = c.fn;
  if (c.rows < 0) return invalid_argument(fn + ": rows = " + str(c.rows) + " must be >= 0");
  if (c.cols < 0 || c.cols > kAllreduceMaxCols) {
    return invalid_argument(fn + ": cols = " + str(c.cols) + " must be in [0, " + str(kAllreduceMaxCols) + "]");
  }
  if (c.cols > 0 && c.rows > kAllreduceMaxElements / c.cols) {
    return invalid_argument(fn + ": rows * cols = " + str(c.rows) + " * " + str(c.cols) + " exceeds the limit of " +
                            str(kAllreduceMaxElements) + " elements");
  }
  if (c.opt.threads < 1 || c.opt.threads > kMaxThreads) {
    return invalid_argument(fn + ": AllreduceOptions.threads = " + str(c.opt.threads) + " must be in [1, " +
                            str(kMaxThreads) + "]");
  }
  if (c.opt.max_call_bytes < 0 || c.opt.max_call_bytes > kMaxCallBytes) {
    return invalid_argument(fn + ": AllreduceOptions.max_call_bytes = " + str(c.opt.max_call_bytes) +
                            " must be in [0, 2^31 - 1] (0: 2^30)");
  }
  const int64_t n = c.rows * c.cols;
  const std::string rc = "rows * cols (" + str(c.rows) + " * " + str(c.cols) + ")";
  K3_RETURN_IF_ERROR(check_size(c.fn, "x", c.x.size(), n, rc));
  K3_RETURN_IF_ERROR(check_size(c.fn, "out", c.out.size(), n, rc));
  if (n > 0 && (c.x.data() == nullptr || c.out.data() == nullptr)) return invalid_argument(fn + ": x or out is null");
  if (overlaps(c.out, c.x)) return invalid_argument(fn + ": out overlaps x (out may alias no other argument)");
  if (!c.norm) return Status::ok();
  if (!c.residual.empty()) K3_RETURN_IF_ERROR(check_size(c.fn, "residual", c.residual.size(), n, rc + " or 0"));
  K3_RETURN_IF_ERROR(check_size(c.fn, "gamma", c.gamma.size(), c.cols, "cols"));
  K3_RETURN_IF_ERROR(check_size(c.fn, "residual_out", c.residual_out.size(), n, rc));
  if (!(c.eps > 0.0f) || !std::isfinite(c.eps)) {
    return invalid_argument(fn + ": eps = " + std::to_string(c.eps) + " must be > 0 and finite");
  }
  if (overlaps(c.out, c.residual) || overlaps(c.out, c.gamma) || overlaps(c.out, c.residual_out)) {
    return invalid_argument(fn + ": out overlaps residual, gamma or residual_out (out may alias no other argument)");
  }
  const bool in_place = !c.residual.empty() && c.residual.data() == c.residual_out.data();
  if (overlaps(c.residual_out, c.x) || overlaps(c.residual_out, c.gamma) ||
      (!in_place && overlaps(c.residual_out, c.residual))) {
    return invalid_argument(fn + ": residual_out overlaps x, gamma or residual (it may only be the residual span itself)");
  }
  return Status::ok();
}

// Every rank learns every rank's verdict and shape; a bad or disagreeing rank fails them all.
Status agree(Communicator& comm, const Call& c, const Status& local) {
  Header mine;
  mine.ok = local.is_ok() ? 1 : 0;
  mine.has_residual = c.residual.empty() ? 0 : 1;
  mine.rows = c.rows;
  mine.cols = c.cols;
  mine.max_call_bytes = c.opt.max_call_bytes;
  mine.eps_bits = f32_to_bits(c.eps);
  mine.gamma_digest = local.is_ok() && c.norm ? fnv1a(c.gamma) : 0;
  const int w = comm.size();
  std::vector<Header> all(static_cast<size_t>(w));
  K3_RETURN_IF_ERROR(comm.allgather(&mine, sizeof mine, all.data()));
  if (!local.is_ok()) return local;
  const std::string fn = c.fn;
  for (int q = 0; q < w; ++q) {
    if (all[static_cast<size_t>(q)].ok == 0) {
      return invalid_argument(fn + ": rank " + str(q) + " of " + str(w) +
                              " rejected its arguments or could not allocate its scratch (that rank's error says "
                              "which); no data was moved");
    }
  }
  const Header& h0 = all[0];
  for (int q = 1; q < w; ++q) {
    const Header& h = all[static_cast<size_t>(q)];
    auto differs = [&](const char* what, const std::string& theirs, const std::string& first) {
      return invalid_argument(fn + ": rank " + str(q) + " passed " + what + " = " + theirs + " but rank 0 passed " +
                              first + " (every rank must pass the same " + what + "); no data was moved");
    };
    if (h.rows != h0.rows) return differs("rows", str(h.rows), str(h0.rows));
    if (h.cols != h0.cols) return differs("cols", str(h.cols), str(h0.cols));
    if (h.max_call_bytes != h0.max_call_bytes) {
      return differs("AllreduceOptions.max_call_bytes", str(h.max_call_bytes), str(h0.max_call_bytes));
    }
    if (c.norm) {
      if (h.eps_bits != h0.eps_bits) {
        return differs("eps", std::to_string(bits_to_f32(h.eps_bits)), std::to_string(bits_to_f32(h0.eps_bits)));
      }
      if (h.has_residual != h0.has_residual) {
        return differs("residual (empty or not)", h.has_residual ? "non-empty" : "empty", h0.has_residual ? "non-empty" : "empty");
      }
      if (h.gamma_digest != h0.gamma_digest) return differs("gamma (digest)", std::to_string(h.gamma_digest), std::to_string(h0.gamma_digest));
    }
  }
  return Status::ok();
}

// The owned elements [off, off + len) of a round's shard: the exact sums of their W
// contributions (recv plane q = rank q, each `plane` elements), written to `stage` as
// bf16(s) (allreduce_bf16) or bf16(s + residual) (the residual_out of the epilogue; `global0` is
// the shard's first element in the tensor, for the residual). Compiled for AVX2 and for the
// baseline ISA (ifunc dispatch): the same IEEE operations in both (no FMA: -ffp-contract=off), so
// the bits do not depend on the CPU either.
// No clones under a sanitizer: the ifunc resolver runs before the sanitizer runtime is set up, and
// an instrumented resolver crashes there (clang spells the check __has_feature, GCC __SANITIZE_*).
#if defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define K3_AR_NO_CLONES 1
#endif
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__) && \
    !defined(K3_AR_NO_CLONES)
#define K3_AR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define K3_AR_CLONES
#endif
K3_AR_CLONES void reduce_chunk(const Call& c, const uint16_t* recv, int w, int64_t plane, int64_t off, int64_t len,
                               int64_t global0, uint16_t* stage, double* s, double* err, float* sum) {
  const size_t n = static_cast<size_t>(len);
  {  // plane 0: -0.0 + x is x exactly (the -0 start keeps exact_sum.hpp's zero-sign rule)
    const uint16_t* src = recv + off;
    for (size_t j = 0; j < n; ++j) {
      s[j] = static_cast<double>(bf16_to_f32(src[j]));
      err[j] = 0.0;
    }
  }
  for (int q = 1; q < w; ++q) {  // FP64 + TwoSum, vectorized over the elements
    const uint16_t* src = recv + q * plane + off;
    for (size_t j = 0; j < n; ++j) {
      const double xv = static_cast<double>(bf16_to_f32(src[j]));
      const double t = s[j] + xv;
      const double bp = t - s[j];
      const double e = (s[j] - (t - bp)) + (xv - bp);
      s[j] = t;
      err[j] += std::fabs(e);  // stays 0 iff every step was exact; NaN for non-finite inputs
    }
  }
  // Exact and in FP32's range: one conversion; the rest (err != 0, NaN, Inf, overflow) is
  // summed again by exact_sum_bf16 (whose fallback is the fixed-point accumulator).
  // Integer compares on the bit patterns (FP compares may trap, which blocks vectorization):
  // err == +0 exactly, and |s| below FP32's overflow threshold (NaN fails both).
  constexpr uint64_t kInfFromBits = 0x47EFFFFFF0000000ull;  // 0x1.ffffffp127
  constexpr uint64_t kOneBits = 0x3FF0000000000000ull;       // 1.0
  int64_t slow = 0;
  for (size_t j = 0; j < n; ++j) {
    const uint64_t sb = std::bit_cast<uint64_t>(s[j]);
    const uint64_t ok = static_cast<uint64_t>((std::bit_cast<uint64_t>(err[j]) == 0) &
                                              ((sb & 0x7FFFFFFFFFFFFFFFull) < kInfFromBits));
    const uint64_t m = 0 - ok;  // all ones on the fast path
    sum[j] = static_cast<float>(std::bit_cast<double>(sb & m));
    err[j] = std::bit_cast<double>(~m & kOneBits);  // 1.0 marks the elements to redo
    slow += static_cast<int64_t>(1 - ok);
  }
  if (slow > 0) {
    for (size_t j = 0; j < n; ++j) {
      if (err[j] != 0.0) sum[j] = detail::exact_sum_bf16(recv + off + static_cast<int64_t>(j), plane, w);
    }
  }
  uint16_t* o = stage + off;
  if (!c.norm || c.residual.empty()) {
    for (size_t j = 0; j < n; ++j) o[j] = bf16_from_f32(sum[j]);
    return;
  }
  const uint16_t* res = c.residual.data() + global0 + off;
  for (size_t j = 0; j < n; ++j) o[j] = bf16_from_f32(sum[j] + bf16_to_f32(res[j]));
}

// The RMSNorm of one row from its residual_out `ro` (complete on every rank after phase 2).
K3_AR_CLONES void norm_row(const Call& c, const uint16_t* ro, uint16_t* o) {
  const size_t ncols = static_cast<size_t>(c.cols);
  double acc = 0.0;  // column order, FP64 (a serial chain by contract)
  for (size_t j = 0; j < ncols; ++j) {
    const double r = static_cast<double>(bf16_to_f32(ro[j]));
    acc += r * r;
  }
  const double rstd = 1.0 / std::sqrt(acc / static_cast<double>(c.cols) + static_cast<double>(c.eps));
  const uint16_t* g = c.gamma.data();
  for (size_t j = 0; j < ncols; ++j) {
    const double y = (static_cast<double>(bf16_to_f32(ro[j])) * rstd) * static_cast<double>(bf16_to_f32(g[j]));
    o[j] = bf16_from_f32(detail::f32_from_f64(y));
  }
}

// Shards of a round of n rows (N = n * cols elements). Two ways, the same bits:
//  - packs (allreduce_bf16 always; the epilogue when n < W): the round is split into 16-byte
//    packs of 8 BF16, P = ceil(N / 8), and rank q owns the elements [lo(q), lo(q + 1)) with
//    lo(q) = min(N, 8 * floor(P q / W)): shards differ by at most one pack, however few the rows
//    (one row of 7168 on nine ranks: 896 packs, 99 or 100 per rank). The epilogue then gathers
//    residual_out and every rank normalizes the round's (fewer than W) rows itself.
//  - rows (the epilogue when n >= W): rank q owns rows [n q / W, n (q + 1) / W), normalizes them
//    and the ranks gather out and residual_out.
constexpr int64_t kPack = 8;
constexpr int64_t kChunk = 2048;  // elements per reduction task (one thread's s / err / sum buffers)

int64_t shard_begin(int64_t elements, int q, int w) {
  const int64_t packs = (elements + kPack - 1) / kPack;
  return std::min(elements, kPack * (packs * q / w));
}

// Scratch of a call, one block: per thread the chunk buffers (s and err: double[kChunk], sum:
// float[kChunk]), then the W receive planes and one staging buffer (two for the epilogue by
// rows), each [max_mine] BF16.
// Allocated before the agreement (an allocation failure is one more reason for every rank to
// return an error), without zero-filling, and up to kKeepScratchBytes kept per calling thread so
// that repeated calls do not fault its pages in again.
constexpr size_t kKeepScratchBytes = size_t{256} << 20;

struct FreeAligned {
  void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{64}); }
};
using AlignedBytes = std::unique_ptr<std::byte[], FreeAligned>;

size_t round64(size_t n) { return (n + 63) / 64 * 64; }

struct Scratch {
  AlignedBytes own;             // when too large to keep
  std::byte* base = nullptr;
  int threads = 1;
  size_t thread_bytes = 0;      // chunk buffers of one thread
  uint16_t *recv = nullptr, *stage = nullptr, *stage2 = nullptr;  // stage2: out rows (by rows only)

  double* s(int t) const { return reinterpret_cast<double*>(base + static_cast<size_t>(t) * thread_bytes); }
};

Status make_scratch(const Call& c, int w, int64_t round_rows, Scratch& sc) {
  // Elements owned in any round (the last round may be smaller, and shard by packs where the
  // others shard by rows): at most the larger of both bounds for the largest round.
  const int64_t rows = std::min(round_rows, c.rows), elements = rows * c.cols;
  const bool by_rows = c.norm && rows >= w;
  const int64_t max_mine = std::max(by_rows ? (rows + w - 1) / w * c.cols : 0,
                                    kPack * (((elements + kPack - 1) / kPack + w - 1) / w));
  sc.threads = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(c.opt.threads, std::max((max_mine + kChunk - 1) / kChunk, rows))));
  sc.thread_bytes = round64(static_cast<size_t>(kChunk) * (2 * sizeof(double) + sizeof(float)));
  const size_t plane = static_cast<size_t>(max_mine);
  const size_t planes = static_cast<size_t>(w) + (by_rows ? 2 : 1);  // receive planes + staging
  const size_t bytes = static_cast<size_t>(sc.threads) * sc.thread_bytes + round64(plane * planes * 2);
  auto alloc = [](size_t n) {
    return AlignedBytes(static_cast<std::byte*>(::operator new[](n, std::align_val_t{64}, std::nothrow)));
  };
  thread_local AlignedBytes kept;
  thread_local size_t kept_bytes = 0;
  if (bytes > kKeepScratchBytes) {
    sc.own = alloc(bytes);
    sc.base = sc.own.get();
  } else {
    if (bytes > kept_bytes) {
      kept.reset();
      kept_bytes = 0;
      kept = alloc(bytes);
      if (kept) kept_bytes = bytes;
    }
    sc.base = kept.get();
  }
  if (sc.base == nullptr) {
    return unavailable(std::string(c.fn) + ": cannot allocate " + std::to_string(bytes) + " bytes of scratch (rows = " +
                       str(c.rows) + ", cols = " + str(c.cols) + ", " + str(w) + " ranks)");
  }
  sc.recv = reinterpret_cast<uint16_t*>(sc.base + static_cast<size_t>(sc.threads) * sc.thread_bytes);
  sc.stage = sc.recv + static_cast<size_t>(w) * plane;
  sc.stage2 = by_rows ? sc.stage + plane : nullptr;
  return Status::ok();
}

// Runs body(thread, i) for i in [0, n) on up to `threads` OpenMP threads (static schedule; no
// parallel region for one: the latency of small messages). Every i is independent of the others.
template <typename F>
void parallel_for(int threads, int64_t n, const F& body) {
  threads = static_cast<int>(std::min<int64_t>(threads, n));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) body(0, i);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) body(t, i);
  }
}

Status run(Communicator& comm, const Call& c) {
  const int w = comm.size(), me = comm.rank();
  const auto uw = static_cast<size_t>(w);
  Status local = validate_local(c);
  const int64_t row_bytes = 2 * c.cols;
  const int64_t limit = c.opt.max_call_bytes > 0 ? c.opt.max_call_bytes : kDefaultCallBytes;
  // Rows per round: a rank receives W planes of at most ceil(n / W) rows (by rows) or
  // ceil(P / W) packs, under (n + W - 1) rows or n rows + 16 W bytes: both must fit the limit
  // (at least one row per round).
  const int64_t round_rows =
      row_bytes > 0 ? std::max<int64_t>(1, (limit - 2 * kPack * w) / row_bytes - (w - 1)) : 1;
  Scratch sc;
  if (local.is_ok() && c.rows > 0 && c.cols > 0) local = make_scratch(c, w, round_rows, sc);
  K3_RETURN_IF_ERROR(agree(comm, c, local));
  if (c.rows == 0 || c.cols == 0) return Status::ok();
  std::vector<int64_t> counts(uw), recv_counts(uw);
  for (int64_t r0 = 0; r0 < c.rows; r0 += round_rows) {
    const int64_t n = std::min(round_rows, c.rows - r0), elements = n * c.cols, e0 = r0 * c.cols;
    const bool by_rows = c.norm && n >= w;
    // Rank q owns the round's elements [lo(q), lo(q + 1)).
    auto lo = [&](int q) { return by_rows ? n * q / w * c.cols : shard_begin(elements, q, w); };
    const int64_t mine = lo(me + 1) - lo(me);
    for (int q = 0; q < w; ++q) {
      counts[static_cast<size_t>(q)] = (lo(q + 1) - lo(q)) * 2;
      recv_counts[static_cast<size_t>(q)] = mine * 2;
    }
    // Phase 1: my partial elements of shard q go to rank q (x's shards are contiguous: no packing).
    K3_RETURN_IF_ERROR(comm.alltoallv(c.x.data() + e0, counts, sc.recv, recv_counts));
    const int64_t chunks = (mine + kChunk - 1) / kChunk;
    parallel_for(sc.threads, chunks, [&](int t, int64_t i) {
      double* s = sc.s(t);
      double* err = s + kChunk;
      auto* sum = reinterpret_cast<float*>(err + kChunk);
      reduce_chunk(c, sc.recv, w, mine, i * kChunk, std::min(kChunk, mine - i * kChunk), e0 + lo(me), sc.stage, s, err,
                   sum);
    });
    // Phase 2: every rank gathers every shard.
    if (!c.norm) {
      K3_RETURN_IF_ERROR(comm.allgatherv(sc.stage, mine * 2, c.out.data() + e0, counts));
    } else if (by_rows) {  // the owner normalizes its rows; out and residual_out are gathered
      parallel_for(sc.threads, mine / c.cols,
                   [&](int, int64_t i) { norm_row(c, sc.stage + i * c.cols, sc.stage2 + i * c.cols); });
      K3_RETURN_IF_ERROR(comm.allgatherv(sc.stage2, mine * 2, c.out.data() + e0, counts));
      K3_RETURN_IF_ERROR(comm.allgatherv(sc.stage, mine * 2, c.residual_out.data() + e0, counts));
    } else {  // fewer rows than ranks: residual_out is gathered, every rank normalizes the rows
      K3_RETURN_IF_ERROR(comm.allgatherv(sc.stage, mine * 2, c.residual_out.data() + e0, counts));
      parallel_for(sc.threads, n, [&](int, int64_t i) {
        norm_row(c, c.residual_out.data() + (r0 + i) * c.cols, c.out.data() + (r0 + i) * c.cols);
      });
    }
  }
  return Status::ok();
}

}  // namespace

Status allreduce_bf16(Communicator& comm, std::span<const uint16_t> x, int64_t rows, int64_t cols,
                      std::span<uint16_t> out, const AllreduceOptions& opt) {
  return run(comm, Call{"allreduce_bf16", x, {}, {}, rows, cols, 1.0f, out, {}, opt, false});
}

Status allreduce_add_rmsnorm_bf16(Communicator& comm, std::span<const uint16_t> x, std::span<const uint16_t> residual,
                                  std::span<const uint16_t> gamma, int64_t rows, int64_t cols, float eps,
                                  std::span<uint16_t> out, std::span<uint16_t> residual_out,
                                  const AllreduceOptions& opt) {
  return run(comm, Call{"allreduce_add_rmsnorm_bf16", x, residual, gamma, rows, cols, eps, out, residual_out, opt, true});
}

}  // namespace k3::comm
