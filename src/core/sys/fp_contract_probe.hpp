// Probes of the compiler's floating-point contraction in k3's own translation units
// (tests/core/test_fp_contract.cpp). k3 is built with -ffp-contract=off (CMakeLists.txt): results
// that must be bit-identical across backends and compilers (the router on CPU and GPU, the CPU
// backend's ISA levels) may not depend on whether the compiler fuses a*b+c into one FMA. Code
// that wants an FMA says so (std::fma, portable_fma, FMA intrinsics), and -ffp-contract=off does
// not touch those.
#pragma once

namespace k3::detail {

// a * b + c as written, in a function where the FMA instruction is available (target "fma" on
// x86-64; always on aarch64), so that a contracting compiler would fuse it. Defined in k3_core
// (src/core/sys/fp_contract_probe.cpp) and k3_cpu (src/cpu/fp_contract_probe.cpp) respectively.
float fp_contract_probe_core(float a, float b, float c);
float fp_contract_probe_cpu(float a, float b, float c);

// Whether the probes may run here (x86-64: the CPU has FMA).
bool fp_contract_probe_runnable();

}  // namespace k3::detail
