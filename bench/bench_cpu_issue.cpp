// Issue-rate probes of one core (x86, AVX2): how many of an AVX2 instruction, or of an even mix of
// two, the core starts per cycle, and the same for the bodies of k3's AVX2 decode kernels with
// their dependencies removed. They show which instructions share execution pipes on the CPU at
// hand (CPUs differ: docs/cpu_moe.md "Issue rates"), which bounds the AVX2 decode kernels.
//
// Each loop pass runs 8 independent instructions (or the kernel body) on registers only, so the
// loop is bound by the pipes and not by latency or memory. Counter per_cycle: instructions per
// core cycle, with the cycle time measured in the same process by a chain of dependent scalar
// adds (one cycle each on every x86 core). Run with one thread on an idle core; on a shared
// host, take the best of several runs.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "k3/system.hpp"

namespace {

constexpr int64_t kPasses = 1 << 16;

bool has_avx2() {
  const auto l = k3::active_isa_level();
  return l.is_ok() && static_cast<int>(l.value()) >= static_cast<int>(k3::IsaLevel::kAvx2);
}

// Seconds per core cycle: best of 9 timings of 2^16 passes of 16 dependent adds.
double cycle_seconds() {
  static const double s = [] {
    double best = 1e30;
    for (int t = 0; t < 9; ++t) {
      int64_t n = kPasses, v = 0;
      const auto t0 = std::chrono::steady_clock::now();
      __asm__ volatile(
          "1:\n"
          ".rept 16\n add $1, %1\n .endr\n"
          "dec %0\n jnz 1b"
          : "+r"(n), "+r"(v));
      const std::chrono::duration<double> d = std::chrono::steady_clock::now() - t0;
      best = std::min(best, d.count() / (kPasses * 16.0));
    }
    return best;
  }();
  return s;
}

// Eight independent instances of an instruction "OP %ymm15, %ymm14, %ymmN" (N = 0..7) or of
// "OP $imm, %ymm15, %ymmN"; mixes put 4 of each kind in ymm0-3 and ymm8-11.
#define K3_R8(op) op "%%ymm0\n" op "%%ymm1\n" op "%%ymm2\n" op "%%ymm3\n" op "%%ymm4\n" op "%%ymm5\n" op "%%ymm6\n" op "%%ymm7\n"
#define K3_R4A(op) op "%%ymm0\n" op "%%ymm1\n" op "%%ymm2\n" op "%%ymm3\n"
#define K3_R4B(op) op "%%ymm8\n" op "%%ymm9\n" op "%%ymm10\n" op "%%ymm11\n"
#define K3_MADD "vpmaddwd %%ymm15, %%ymm14, "
#define K3_MADDUBS "vpmaddubsw %%ymm15, %%ymm14, "
#define K3_FMA "vfmadd231ps %%ymm15, %%ymm14, "
#define K3_MUL "vmulps %%ymm15, %%ymm14, "
#define K3_SHUFB "vpshufb %%ymm15, %%ymm14, "
#define K3_UNPCK "vpunpcklbw %%ymm15, %%ymm14, "
#define K3_SRAW "vpsraw $4, %%ymm15, "
#define K3_BSLL "vpslldq $2, %%ymm15, "
#define K3_ADD "vpaddd %%ymm15, %%ymm14, "

// The MoE integer kernel's body for one k-pair, one row, both nibble planes (gemm_avx2.cpp,
// int_record_rows): 3 nibble ops, 2 VPSHUFB, 4 VPUNPCK, 4 VPMADDWD, 4 VPADDD = 17.
#define K3_MOE_BODY                                                                               \
  "vpand %%ymm13, %%ymm15, %%ymm0\n vpsrlw $4, %%ymm15, %%ymm1\n vpand %%ymm13, %%ymm1, %%ymm1\n" \
  "vpshufb %%ymm0, %%ymm12, %%ymm0\n vpshufb %%ymm1, %%ymm12, %%ymm1\n"                           \
  "vpunpcklbw %%ymm14, %%ymm0, %%ymm2\n vpunpckhbw %%ymm14, %%ymm0, %%ymm3\n"                     \
  "vpunpcklbw %%ymm14, %%ymm1, %%ymm4\n vpunpckhbw %%ymm14, %%ymm1, %%ymm5\n"                     \
  "vpmaddwd %%ymm11, %%ymm2, %%ymm2\n vpmaddwd %%ymm11, %%ymm3, %%ymm3\n"                         \
  "vpmaddwd %%ymm11, %%ymm4, %%ymm4\n vpmaddwd %%ymm11, %%ymm5, %%ymm5\n"                         \
  "vpaddd %%ymm2, %%ymm6, %%ymm6\n vpaddd %%ymm3, %%ymm7, %%ymm7\n"                               \
  "vpaddd %%ymm4, %%ymm8, %%ymm8\n vpaddd %%ymm5, %%ymm9, %%ymm9\n"
// A VPMADDUBSW form of the same (not built; four k-pairs): the looked-up weight bytes times the
// operand's low and high bytes (int16 sums, no VPUNPCK per k-pair), widened every four k-pairs
// by VPUNPCK{L,H}WD + VPMADDWD by (1, 256) + VPADDD: 13 per k-pair + 12 per four = 16 per k-pair.
#define K3_MOE_MADDUBS_KP                                                                         \
  "vpand %%ymm13, %%ymm15, %%ymm0\n vpsrlw $4, %%ymm15, %%ymm1\n vpand %%ymm13, %%ymm1, %%ymm1\n" \
  "vpshufb %%ymm0, %%ymm12, %%ymm0\n vpshufb %%ymm1, %%ymm12, %%ymm1\n"                           \
  "vpmaddubsw %%ymm11, %%ymm0, %%ymm2\n vpmaddubsw %%ymm10, %%ymm0, %%ymm3\n"                     \
  "vpmaddubsw %%ymm11, %%ymm1, %%ymm4\n vpmaddubsw %%ymm10, %%ymm1, %%ymm5\n"                     \
  "vpaddw %%ymm2, %%ymm6, %%ymm6\n vpaddw %%ymm3, %%ymm7, %%ymm7\n"                               \
  "vpaddw %%ymm4, %%ymm8, %%ymm8\n vpaddw %%ymm5, %%ymm9, %%ymm9\n"
#define K3_MOE_MADDUBS_BODY                                                                       \
  K3_MOE_MADDUBS_KP K3_MOE_MADDUBS_KP K3_MOE_MADDUBS_KP K3_MOE_MADDUBS_KP                         \
  "vpunpcklwd %%ymm7, %%ymm6, %%ymm0\n vpunpckhwd %%ymm7, %%ymm6, %%ymm1\n"                       \
  "vpunpcklwd %%ymm9, %%ymm8, %%ymm2\n vpunpckhwd %%ymm9, %%ymm8, %%ymm3\n"                       \
  "vpmaddwd %%ymm14, %%ymm0, %%ymm0\n vpmaddwd %%ymm14, %%ymm1, %%ymm1\n"                         \
  "vpmaddwd %%ymm14, %%ymm2, %%ymm2\n vpmaddwd %%ymm14, %%ymm3, %%ymm3\n"                         \
  "vpaddd %%ymm0, %%ymm4, %%ymm4\n vpaddd %%ymm1, %%ymm5, %%ymm5\n"                               \
  "vpaddd %%ymm2, %%ymm4, %%ymm4\n vpaddd %%ymm3, %%ymm5, %%ymm5\n"
// The linear FP32 stream kernel's body for one vector of one quad (kernels_avx2.cpp): 2 VPSRAW,
// 3 VPSLLDQ, 4 VPAND, 4 FMA = 13 (the FMAs here into independent registers).
#define K3_LIN_BODY                                                                                           \
  "vpsraw $4, %%ymm15, %%ymm0\n vpslldq $1, %%ymm15, %%ymm1\n vpsraw $4, %%ymm1, %%ymm1\n"                    \
  "vpslldq $2, %%ymm0, %%ymm2\n vpslldq $2, %%ymm1, %%ymm3\n"                                                 \
  "vpand %%ymm13, %%ymm0, %%ymm0\n vpand %%ymm13, %%ymm1, %%ymm1\n vpand %%ymm13, %%ymm2, %%ymm2\n"           \
  "vpand %%ymm13, %%ymm3, %%ymm3\n"                                                                           \
  "vfmadd231ps %%ymm12, %%ymm0, %%ymm4\n vfmadd231ps %%ymm12, %%ymm1, %%ymm5\n"                               \
  "vfmadd231ps %%ymm12, %%ymm2, %%ymm6\n vfmadd231ps %%ymm12, %%ymm3, %%ymm7\n"

#define K3_ISSUE_PROBE(name, ops, body)                                                                        \
  void BM_IssueRate_##name(benchmark::State& state) {                                                          \
    if (!has_avx2()) {                                                                                         \
      state.SkipWithError("needs AVX2 (or K3_ISA is below avx2)");                                             \
      return;                                                                                                  \
    }                                                                                                          \
    const double cycle = cycle_seconds();                                                                      \
    double seconds = 0;                                                                                        \
    for (auto _ : state) {                                                                                     \
      const auto t0 = std::chrono::steady_clock::now();                                                        \
      int64_t n = kPasses;                                                                                     \
      __asm__ volatile("vpxor %%xmm15, %%xmm15, %%xmm15\n vpxor %%xmm14, %%xmm14, %%xmm14\n"                  \
                       "vpxor %%xmm13, %%xmm13, %%xmm13\n vpxor %%xmm12, %%xmm12, %%xmm12\n"                  \
                       "vpxor %%xmm11, %%xmm11, %%xmm11\n"                                                     \
                       "1:\n" body "dec %0\n jnz 1b\n vzeroupper"                                              \
                       : "+r"(n)                                                                               \
                       :                                                                                       \
                       : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",       \
                         "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc");                          \
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();                 \
    }                                                                                                          \
    state.counters["per_cycle"] = static_cast<double>(state.iterations() * kPasses * ops) * cycle / seconds;   \
    state.counters["GHz"] = 1e-9 / cycle;                                                                      \
  }                                                                                                            \
  BENCHMARK(BM_IssueRate_##name)

K3_ISSUE_PROBE(vpaddd, 8, K3_R8(K3_ADD));
K3_ISSUE_PROBE(vpmaddwd, 8, K3_R8(K3_MADD));
K3_ISSUE_PROBE(vpmaddubsw, 8, K3_R8(K3_MADDUBS));
K3_ISSUE_PROBE(vfmadd231ps, 8, K3_R8(K3_FMA));
K3_ISSUE_PROBE(vmulps, 8, K3_R8(K3_MUL));
K3_ISSUE_PROBE(vpshufb, 8, K3_R8(K3_SHUFB));
K3_ISSUE_PROBE(vpunpcklbw, 8, K3_R8(K3_UNPCK));
K3_ISSUE_PROBE(vpsraw, 8, K3_R8(K3_SRAW));
K3_ISSUE_PROBE(vpslldq, 8, K3_R8(K3_BSLL));
K3_ISSUE_PROBE(vpmaddwd_vmulps, 8, K3_R4A(K3_MADD) K3_R4B(K3_MUL));
K3_ISSUE_PROBE(vpmaddwd_vpshufb, 8, K3_R4A(K3_MADD) K3_R4B(K3_SHUFB));
K3_ISSUE_PROBE(vpmaddwd_vpunpcklbw, 8, K3_R4A(K3_MADD) K3_R4B(K3_UNPCK));
K3_ISSUE_PROBE(vpshufb_vpunpcklbw, 8, K3_R4A(K3_SHUFB) K3_R4B(K3_UNPCK));
K3_ISSUE_PROBE(vmulps_vpsraw, 8, K3_R4A(K3_MUL) K3_R4B(K3_SRAW));
K3_ISSUE_PROBE(vmulps_vpslldq, 8, K3_R4A(K3_MUL) K3_R4B(K3_BSLL));
K3_ISSUE_PROBE(vpsraw_vpslldq, 8, K3_R4A(K3_SRAW) K3_R4B(K3_BSLL));
K3_ISSUE_PROBE(moe_int_body, 17, K3_MOE_BODY);
K3_ISSUE_PROBE(moe_maddubs_body, 64, K3_MOE_MADDUBS_BODY);
K3_ISSUE_PROBE(linear_fp32_body, 13, K3_LIN_BODY);

}  // namespace
