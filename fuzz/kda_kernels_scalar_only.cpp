// The fuzz targets are built with clang, which does not apply `#pragma GCC target` to the SIMD
// kernels (kernels_avx2.cpp / kernels_avx512.cpp need it for their intrinsics). The fuzz target
// runs the CPU backend at the scalar level only (CpuOptions::isa), and these stand-ins satisfy the
// kernel table's other entries.
#include "cpu/kda/kernels.hpp"

namespace k3::cpu::kda_detail {
const KernelTable& kernels_avx2() { return kernels_scalar(); }
const KernelTable& kernels_avx512() { return kernels_scalar(); }
}  // namespace k3::cpu::kda_detail
