// A hand-described NVIDIA H200 for planning tests: planning is host code, so a plan needs no GPU.
#pragma once

#include "k3/cuda.hpp"

namespace k3::test {

inline cuda::DeviceCaps h200_caps() {
  cuda::DeviceCaps c;
  c.name = "NVIDIA H200";
  c.cc_major = 9;
  c.cc_minor = 0;
  c.sm_count = 132;
  c.smem_per_block_optin = 227 * 1024;
  c.compiled_archs = {90, 120};
  return c;
}

}  // namespace k3::test
