// k3/config.hpp — portability macros shared by host and device code.
#pragma once

// Functions usable from host and device code. Public headers never include CUDA headers;
// under nvcc the CUDA keywords are available without any include.
#if defined(__CUDACC__)
#define K3_HOST_DEVICE __host__ __device__
#else
#define K3_HOST_DEVICE
#endif

// Always inlined. Shared math (k3/activation.hpp) is called from CPU kernels compiled with
// per-function ISA targets (__attribute__((target("avx512f")))): left to the inliner's size
// heuristics, a call would go to an out-of-line copy built for the baseline ISA (no FMA, no
// vectorization) and cost the caller most of its speed.
#if defined(__CUDACC__)
#define K3_FORCE_INLINE __forceinline__
#elif defined(__GNUC__)
#define K3_FORCE_INLINE inline __attribute__((always_inline))
#else
#define K3_FORCE_INLINE inline
#endif

// k3's results are defined bit for bit (IEEE-754 rounding, NaN / Inf propagation): -ffast-math and
// -Ofast would change them (and make `x != x` NaN checks disappear), so k3's own build refuses
// them (K3_BUILDING is defined for every target of k3's build tree, CMakeLists.txt, which also
// compiles k3's code with -ffp-contract=off). A program that includes these headers in its own
// fast-math translation units is not refused, but the inline functions it calls from them then
// lose the same guarantees.
#if defined(__FAST_MATH__) && defined(K3_BUILDING)
#error "k3 must not be compiled with -ffast-math / -Ofast: its numerics depend on IEEE-754 semantics"
#endif
