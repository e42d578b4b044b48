// The fragment-native weight layout and the index functions of the decode-splitk kernels
// (src/cuda/moe/moe_pack.hpp), compiled here by the host compiler: packing random matrices and
// emulating the kernels lane by lane with the very functions they run, against k3/mx.hpp's
// dequantization and a plain dot product. The kernels themselves ran on an H200 (2026-12-04).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_caps_util.hpp"
#include "cuda/moe/moe_pack.hpp"
#include "k3/cuda_moe.hpp"
#include "k3/formats.hpp"
#include "k3/mx.hpp"

namespace k3::cuda::moe_detail {
namespace {

// Random MXFP4 matrix [rows, red] whose blocks take the scale codes of interest (0, 1, 0x7F, 0xFE,
// 0xFF and random ones) with only the codes that prepack accepts under them (every nonzero product
// a normal BF16: mx_find_bf16_inexact_block finds nothing).
struct Mx4 {
  std::vector<uint8_t> q, s;
};
Mx4 random_mx4(int64_t rows, int64_t red, std::mt19937& rng) {
  const uint8_t special[] = {0, 1, 0x7F, 0xFE, kE8M0Nan};
  Mx4 m;
  m.q.assign(rows * red / 2, 0);
  m.s.assign(rows * red / kMxBlock, 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < red / kMxBlock; ++b) {
      const auto pick = static_cast<uint32_t>(rng() % 10);
      const uint8_t sc = pick < 5 ? special[pick] : static_cast<uint8_t>(100 + rng() % 50);
      m.s[r * (red / kMxBlock) + b] = sc;
      for (int64_t j = 0; j < kMxBlock; ++j) {
        uint8_t code = 0;
        do {
          code = static_cast<uint8_t>(rng() & 0xF);
        } while (!mx_element_bf16_exact(code, sc, MxElement::kE2M1));
        const int64_t k = b * kMxBlock + j;
        m.q[r * (red / 2) + k / 2] |= static_cast<uint8_t>(code << (4 * (k & 1)));
      }
    }
  }
  EXPECT_FALSE(mx_find_bf16_inexact_block(m.q, m.s, rows, red, MxElement::kE2M1).has_value());
  return m;
}

uint8_t code_at(const Mx4& m, int64_t red, int64_t row, int64_t k) {
  return static_cast<uint8_t>((m.q[row * (red / 2) + k / 2] >> (4 * (k & 1))) & 0xF);
}

struct Packed {
  SkGeom g;
  std::vector<uint8_t> pq;
  std::vector<uint32_t> ps;
};
Packed pack_all(bool fc1, int64_t k, int64_t n, int e, const Mx4& m) {
  Packed p;
  p.g = fc1 ? sk_geom_fc1(k, n) : sk_geom_fc2(k, n);
  p.pq.assign(e * p.g.bytes, 0xA5);  // poison: every byte must be written
  p.ps.assign(e * p.g.scale_words, 0xA5A5A5A5u);
  const int64_t rows = p.g.rows, red = p.g.red;
  for (int x = 0; x < e; ++x) {
    sk_pack_expert(fc1, n, p.g, m.q.data() + x * rows * (red / 2), m.s.data() + x * rows * (red / kMxBlock),
                   p.pq.data() + x * p.g.bytes, p.ps.data() + x * p.g.scale_words);
  }
  return p;
}

// The lane's 16-byte load as the kernel sees it (uint4 = 4 little-endian words).
void load_words(const Packed& p, int x, int64_t mt, int64_t kc, int lane, uint32_t (&w)[4]) {
  std::memcpy(w, p.pq.data() + x * p.g.bytes + sk_a_offset(p.g, mt, kc, lane), 16);
}
uint32_t load_scale(const Packed& p, int x, int64_t mt, int64_t kc, int lane) {
  return p.ps[x * p.g.scale_words + sk_scale_word(p.g, mt, kc / 2, lane)];
}

bool same_bits_or_nan(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return f32_to_bits(a) == f32_to_bits(b);
}

struct Shape {
  int64_t k, n;
  int e;
};
const Shape kShapes[] = {{96, 160, 3}, {128, 64, 1}, {256, 96, 2}, {160, 128, 5}};

// Every A register of every lane, step and chunk, as the kernel builds it (sk_a_offset,
// sk_scale_word, sk_scale_of, sk_fp4_table, sk_a_regs), placed where the PTX m16n8k16 fragment puts it (row g + 8 (i & 1),
// mma k 2q + 8 (i >> 1)), holds exactly mx_decode_element of the checkpoint weight at the row
// sk_ckpt_row and the real k the B operand of the same mma k reads (sk_b_k0 + 2 sk_b_word); every
// checkpoint weight appears exactly once, the padding is +0.
TEST(CudaMoePack, KernelIndexFunctionsReconstructEveryDequantizedWeight) {
  std::mt19937 rng(1234);
  for (const Shape& sh : kShapes) {
    for (bool fc1 : {true, false}) {
      const int64_t rows = fc1 ? 2 * sh.n : sh.k, red = fc1 ? sh.k : sh.n;
      const Mx4 m = random_mx4(sh.e * rows, red, rng);
      const Packed p = pack_all(fc1, sh.k, sh.n, sh.e, m);
      ASSERT_EQ(p.g.mtiles * 16, rows);
      ASSERT_GE(p.g.chunks * kSkChunk, red);
      ASSERT_LT(p.g.chunks * kSkChunk - red, kSkPairK);
      const std::string what = std::string(fc1 ? "fc1" : "fc2") + " K" + std::to_string(sh.k) + " N" +
                               std::to_string(sh.n) + " E" + std::to_string(sh.e);
      for (int x = 0; x < sh.e; ++x) {
        std::vector<int> seen(rows * red, 0);
        for (int64_t mt = 0; mt < p.g.mtiles; ++mt) {
          for (int64_t kc = 0; kc < p.g.chunks; ++kc) {
            for (int lane = 0; lane < 32; ++lane) {
              const int g = lane >> 2, q = lane & 3;
              uint32_t w[4];
              load_words(p, x, mt, kc, lane, w);
              const uint32_t sw = load_scale(p, x, mt, kc, lane);
              const int64_t b_k0 = sk_b_k0(kc, lane);
              const int kc_odd = static_cast<int>(kc & 1);
              const SkFp4Table t_lo = sk_fp4_table(sk_scale_of(sw, kc_odd, 0));
              const SkFp4Table t_hi = sk_fp4_table(sk_scale_of(sw, kc_odd, 1));
              for (int s = 0; s < 4; ++s) {
                uint32_t regs[4];
                sk_a_regs(w[s], t_lo, t_hi, regs);
                for (int i = 0; i < 4; ++i) {
                  const uint32_t reg = regs[i];
                  const int row = g + 8 * (i & 1);  // PTX A fragment
                  const int r = i >> 1;             // the B reg of the same mma k (2q + 8r)
                  const int64_t k = b_k0 + 2 * sk_b_word(s, r);
                  ASSERT_EQ(k, sk_real_k(kc, lane, s, r));
                  ASSERT_EQ(k - 64 * kc, 16 * q + 4 * s + 2 * r);  // depends on q only, as B needs
                  const int64_t ck_row = sk_ckpt_row(fc1, sh.n, mt, row);
                  for (int h = 0; h < 2; ++h) {
                    const float got = bf16_to_f32(static_cast<uint16_t>(reg >> (16 * h)));
                    if (k + h >= red) {
                      ASSERT_EQ(f32_to_bits(got), 0u) << what << " padding";
                      continue;
                    }
                    const int64_t er = x * rows + ck_row;
                    const float want = mx_decode_element(code_at(m, red, er, k + h),
                                                         m.s[er * (red / kMxBlock) + (k + h) / kMxBlock],
                                                         MxElement::kE2M1);
                    ASSERT_TRUE(same_bits_or_nan(got, want))
                        << what << " expert " << x << " mt " << mt << " kc " << kc << " lane " << lane << " s " << s
                        << " i " << i << ": got " << got << " want " << want;
                    ++seen[ck_row * red + k + h];
                  }
                }
              }
            }
          }
        }
        for (int64_t j = 0; j < rows * red; ++j) ASSERT_EQ(seen[j], 1) << what << " weight " << j;
      }
    }
  }
}

// The kernels' PRMT conversion equals moe_shared.hpp's fp4x2_to_bf16x2 bit for bit for every
// 16-bit input and scale code, except scale 0 with a magnitude-1 nibble, which prepack never
// accepts (0.5 x 2^-127 is below BF16's normal range).
TEST(CudaMoePack, PermuteConversionIsBitIdenticalToFp4x2ToBf16x2) {
  int64_t compared = 0;
  for (uint32_t sc = 0; sc < 256; ++sc) {
    const SkFp4Table t = sk_fp4_table(sc);
    for (uint32_t h = 0; h < 0x10000u; ++h) {
      bool excluded = false;
      for (int nib = 0; nib < 4; ++nib) excluded = excluded || (sc == 0 && ((h >> (4 * nib)) & 7u) == 1u);
      if (excluded) {
        for (int nib = 0; nib < 4; ++nib) {
          const auto code = static_cast<uint8_t>((h >> (4 * nib)) & 0xFu);
          if ((code & 7u) == 1u) {
            ASSERT_FALSE(mx_element_bf16_exact(code, 0, MxElement::kE2M1));
          }
        }
        continue;
      }
      uint32_t r0 = 0, r1 = 0;
      sk_fp4x4_to_bf16(h, t, r0, r1);
      ASSERT_EQ(r0, fp4x2_to_bf16x2(h & 0xFFu, static_cast<uint8_t>(sc))) << "scale " << sc << " h " << h;
      ASSERT_EQ(r1, fp4x2_to_bf16x2(h >> 8, static_cast<uint8_t>(sc))) << "scale " << sc << " h " << h;
      ++compared;
    }
  }
  EXPECT_GT(compared, 255 * 65536);
}

// FC1's interleave: accumulator regs 0, 1 of a lane are the gate row and regs 2, 3 the up row of
// the same intermediate column; the epilogue's lane c reads column 32 x + c.
TEST(CudaMoePack, Fc1GateAndUpOfOneColumnMeetInOneLane) {
  const int64_t n = 160;
  for (int64_t mt = 0; mt < 2 * n / 16; ++mt) {
    for (int lane = 0; lane < 32; ++lane) {
      for (int r = 0; r < 4; ++r) {
        const int row = sk_acc_row(static_cast<int>(mt % kSkMTiles), r, lane) % 16;
        const int64_t ck = sk_ckpt_row(true, n, mt, row);
        const int64_t col = 8 * mt + (lane >> 2);
        EXPECT_EQ(ck, r < 2 ? col : n + col) << mt << " " << lane << " " << r;
      }
    }
  }
  for (int c = 0; c < 32; ++c) {
    const int gr = sk_fc1_gate_row(c);
    EXPECT_EQ(sk_ckpt_row(true, n, gr / 16, gr % 16), c);  // CTA 0: intermediate column c
    EXPECT_EQ(sk_ckpt_row(true, n, (gr + 8) / 16, (gr + 8) % 16), n + c);
  }
}

// Split-K: warps take contiguous runs of pairs in warp order; every pair exactly once.
TEST(CudaMoePack, SplitKCoversEveryPairOnceInWarpOrder) {
  for (int64_t pairs = 1; pairs <= 300; ++pairs) {
    int64_t next = 0;
    for (int w = 0; w < kSkWarps; ++w) {
      const SkRange r = sk_split(pairs, w);
      ASSERT_EQ(r.begin, next) << pairs << " " << w;
      ASSERT_LE(r.begin, r.end);
      ASSERT_LE(r.end - r.begin, (pairs + kSkWarps - 1) / kSkWarps);
      next = r.end;
    }
    ASSERT_EQ(next, pairs);
  }
  // Kimi: K 3584 = 28 pairs, N 3072 = 24 pairs.
  EXPECT_EQ(sk_geom_fc1(3584, 3072).pairs, 28);
  EXPECT_EQ(sk_geom_fc2(3584, 3072).pairs, 24);
}

// The shared-memory partial index is a bijection per warp, and sk_reduced_index inverts the
// accumulator -> (token, row) map the epilogues use.
TEST(CudaMoePack, ReductionIndicesAreABijection) {
  std::vector<int> hit(kSkWarps * kSkElems * 32, 0);
  for (int w = 0; w < kSkWarps; ++w)
    for (int mt = 0; mt < kSkMTiles; ++mt)
      for (int nt = 0; nt < kSkNTiles; ++nt)
        for (int r = 0; r < 4; ++r)
          for (int lane = 0; lane < 32; ++lane) {
            const int i = sk_part_index(w, mt, nt, r, lane);
            ASSERT_GE(i, 0);
            ASSERT_LT(i, static_cast<int>(hit.size()));
            ++hit[i];
            if (w == 0) {
              ASSERT_EQ(sk_reduced_index(sk_acc_token(nt, r, lane), sk_acc_row(mt, r, lane)), i);
            }
          }
  for (int v : hit) ASSERT_EQ(v, 1);
  std::vector<int> cell(kSkTokens * kSplitKRows, 0);
  for (int t = 0; t < kSkTokens; ++t)
    for (int row = 0; row < kSplitKRows; ++row) {
      const int i = sk_reduced_index(t, row);
      ASSERT_LT(i, kSkElems * 32);
      ++cell[i];
    }
  for (int v : cell) ASSERT_EQ(v, 1);
}

// One CTA of each GEMM emulated end to end on the host: every warp's pairs (sk_split), each
// lane's weight loads, scale words and operand loads (sk_b_k0 / sk_b_word, zeros past the end and
// for padding tokens), the m16n8k16 fragments as the PTX ISA defines them, the reduction in warp
// order and the epilogue's map back to (token, weight row): equals the dot products of the
// dequantized weights with the operand rows.
TEST(CudaMoePack, EmulatedCtaMatchesDotProducts) {
  std::mt19937 rng(99);
  for (const Shape& sh : kShapes) {
    for (bool fc1 : {true, false}) {
      const int64_t rows = fc1 ? 2 * sh.n : sh.k, red = fc1 ? sh.k : sh.n;
      Mx4 m = random_mx4(sh.e * rows, red, rng);
      for (auto& sc : m.s) {
        if (sc < 100 || sc > 150) sc = 127;  // finite, moderate values for a tolerance check
      }
      const Packed p = pack_all(fc1, sh.k, sh.n, sh.e, m);
      const int live_tokens = 11;  // n-tile 1 partly padding
      std::vector<uint16_t> xs(kSkTokens * red, 0);
      for (int t = 0; t < live_tokens; ++t)
        for (int64_t k = 0; k < red; ++k) xs[t * red + k] = bf16_from_f32(std::normal_distribution<float>(0, 1)(rng));
      const int x = sh.e - 1;
      for (int64_t grp = 0; grp * kSkMTiles < p.g.mtiles; ++grp) {
        const int64_t mt0 = grp * kSkMTiles;
        const int mt_live = static_cast<int>(std::min<int64_t>(kSkMTiles, p.g.mtiles - mt0));
        std::vector<float> part(kSkWarps * kSkElems * 32, 0.0f);
        for (int wp = 0; wp < kSkWarps; ++wp) {
          float acc[kSkMTiles][kSkNTiles][32][4] = {};
          const SkRange range = sk_split(p.g.pairs, wp);
          for (int64_t pr = range.begin; pr < range.end; ++pr) {
            for (int c = 0; c < 2; ++c) {
              const int64_t kc = 2 * pr + c;
              for (int mt = 0; mt < mt_live; ++mt) {
                float a_mat[16][16], b_mat[kSkNTiles][16][8];
                for (int s = 0; s < 4; ++s) {
                  for (int lane = 0; lane < 32; ++lane) {
                    const int g = lane >> 2, q = lane & 3;
                    uint32_t w[4];
                    load_words(p, x, mt0 + mt, kc, lane, w);
                    const uint32_t sw = p.ps[x * p.g.scale_words + sk_scale_word(p.g, mt0 + mt, pr, lane)];
                    uint32_t regs[4];
                    sk_a_regs(w[s], sk_fp4_table(sk_scale_of(sw, c, 0)), sk_fp4_table(sk_scale_of(sw, c, 1)), regs);
                    for (int i = 0; i < 4; ++i) {
                      const uint32_t reg = regs[i];
                      for (int h = 0; h < 2; ++h)
                        a_mat[g + 8 * (i & 1)][2 * q + 8 * (i >> 1) + h] = bf16_to_f32(static_cast<uint16_t>(reg >> (16 * h)));
                    }
                    const int64_t k0 = sk_b_k0(kc, lane);
                    for (int nt = 0; nt < kSkNTiles; ++nt) {
                      const int tok = 8 * nt + g;
                      uint32_t bw[8] = {};
                      if (tok < live_tokens && k0 < red) {
                        for (int j = 0; j < 8; ++j)
                          bw[j] = xs[tok * red + k0 + 2 * j] | (uint32_t{xs[tok * red + k0 + 2 * j + 1]} << 16);
                      }
                      for (int r = 0; r < 2; ++r) {
                        const uint32_t b = bw[sk_b_word(s, r)];
                        for (int h = 0; h < 2; ++h)
                          b_mat[nt][2 * q + 8 * r + h][g] = bf16_to_f32(static_cast<uint16_t>(b >> (16 * h)));
                      }
                    }
                  }
                  for (int nt = 0; nt < kSkNTiles; ++nt) {
                    for (int lane = 0; lane < 32; ++lane) {
                      const int g = lane >> 2, q = lane & 3;
                      for (int r = 0; r < 4; ++r) {
                        const int row = g + 8 * (r >> 1), col = 2 * q + (r & 1);  // PTX C fragment
                        float sum = 0;
                        for (int kk = 0; kk < 16; ++kk) sum += a_mat[row][kk] * b_mat[nt][kk][col];
                        acc[mt][nt][lane][r] += sum;
                      }
                    }
                  }
                }
              }
            }
          }
          for (int mt = 0; mt < kSkMTiles; ++mt)
            for (int nt = 0; nt < kSkNTiles; ++nt)
              for (int r = 0; r < 4; ++r)
                for (int lane = 0; lane < 32; ++lane) part[sk_part_index(wp, mt, nt, r, lane)] = acc[mt][nt][lane][r];
        }
        for (int i = 0; i < kSkElems * 32; ++i) {
          float v = part[i];
          for (int wp = 1; wp < kSkWarps; ++wp) v += part[wp * kSkElems * 32 + i];
          part[i] = v;
        }
        for (int t = 0; t < live_tokens; ++t) {
          for (int row = 0; row < 16 * mt_live; ++row) {
            const int64_t ck = x * rows + sk_ckpt_row(fc1, sh.n, mt0 + row / 16, row % 16);
            double want = 0, mag = 0;
            for (int64_t k = 0; k < red; ++k) {
              const double term = double{mx_decode_element(code_at(m, red, ck, k), m.s[ck * (red / kMxBlock) + k / kMxBlock],
                                                           MxElement::kE2M1)} *
                                  bf16_to_f32(xs[t * red + k]);
              want += term;
              mag += std::fabs(term);
            }
            const float got = part[sk_reduced_index(t, row)];
            ASSERT_NEAR(got, want, 1e-5 * mag + 1e-6)
                << (fc1 ? "fc1" : "fc2") << " K" << sh.k << " N" << sh.n << " group " << grp << " token " << t
                << " row " << row;
          }
        }
      }
    }
  }
}

// The decode-splitk launches stay within CUDA's grid limits for every plan up to max_tokens 65536,
// top-32, E_local 4096, forced or chosen, and launch one CTA per row tile and 64-row group.
TEST(CudaMoePack, SplitKGridsStayWithinLimitsUpToTheLargestPlan) {
  const DeviceCaps h200 = test::h200_caps();
  struct S { int e, ep, top_k; int64_t k, n; };
  const S shapes[] = {{896, 32, 16, 3584, 3072}, {4096, 1, 32, 64, 32}, {32, 32, 1, 96, 160}, {4096, 4096, 32, 32, 64}};
  for (const auto& sh : shapes) {
    for (int64_t max_m : {int64_t{1}, int64_t{16}, int64_t{4096}, int64_t{65535}, int64_t{65536}}) {
      MoeProblem pr;
      pr.shape = {sh.k, sh.n, sh.e, sh.top_k, sh.ep, 0};
      MoeOptions o{.max_tokens = max_m, .device = h200};
      o.path = MoePath::kDecodeSplitK;
      auto plan = cuda::plan(pr, o);
      ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
      ASSERT_EQ(plan->block_m, kSkTokens);
      const Dims d = dims_of(plan.value());
      const std::string what = "E " + std::to_string(sh.e) + " top-" + std::to_string(sh.top_k) + " max_m " +
                               std::to_string(max_m);
      for (bool fc1 : {true, false}) {
        const Grid g = sk_grid(d, fc1);
        EXPECT_LE(int64_t{g.x}, kMaxGridX) << what;
        EXPECT_LE(int64_t{g.y}, kMaxGridYZ) << what;
        EXPECT_EQ(int64_t{g.x}, d.max_tiles) << what;
        const int64_t rows = fc1 ? 2 * d.n : d.k;
        EXPECT_GE(int64_t{g.y} * kSplitKRows, rows) << what;
        EXPECT_LT(int64_t{g.y} * kSplitKRows, rows + kSplitKRows) << what;
        EXPECT_EQ(int64_t{g.x} * g.y, fc1 ? plan->splitk_fc1_ctas : plan->splitk_fc2_ctas) << what;
      }
      // The last token row a CTA reads (row_token[row0 + 8 + 7]) is inside the row map.
      EXPECT_LE((d.max_tiles - 1) * kSkTokens + 15, d.max_tiles * d.block_m - 1);
    }
  }
}

}  // namespace
}  // namespace k3::cuda::moe_detail
