// k3/cuda.hpp — the CUDA backend's host-side entry points. Includes no CUDA header: callers
// need neither nvcc nor the toolkit. In a build without CUDA every function reports that.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "k3/mx.hpp"
#include "k3/status.hpp"

namespace k3::cuda {

// True when this build contains the CUDA backend.
bool compiled();
// Architectures compiled in, e.g. "90a;120a" ("" without CUDA).
std::string compiled_archs();

struct DeviceInfo {
  int index = 0;
  std::string name;
  int cc_major = 0;
  int cc_minor = 0;
  int sm_count = 0;
  int64_t total_memory = 0;  // bytes
  bool runnable = false;     // an architecture compiled into this build runs on it
};

// The CUDA devices present. An error status (kUnavailable) says why there are none usable:
// no CUDA in this build, no driver, or no device.
Result<std::vector<DeviceInfo>> devices();

// What a device offers, as read by device_caps() (or written by a test).
struct DeviceCaps {
  std::string name;
  int cc_major = 0;
  int cc_minor = 0;
  int sm_count = 0;
  int64_t smem_per_block_optin = 0;  // bytes (cudaDevAttrMaxSharedMemoryPerBlockOptin)
  std::vector<int> compiled_archs;   // e.g. {90, 120}: architectures built into this binary
  // This binary contains the CUTLASS sm_90a grouped GEMM of the MoE prefill path "prefill-sm90"
  // (built only when CMake found the CUTLASS headers). device_caps() fills it; caps written by
  // hand say "not built" unless they set it.
  bool has_sm90_grouped = false;
  // This binary contains the CUTLASS sm_120a block-scaled grouped GEMM of the forced-only path
  // "w4a8-sm120-cutlass" (k3::cuda::has_sm120_blockscaled_gemm()); device_caps() fills it.
  bool has_sm120_blockscaled = false;
};

// What device `device` offers, for planning (cuda::plan of each op); kUnavailable without one.
Result<DeviceCaps> device_caps(int device);

// MX quantize / dequantize on device 0 (host buffers in and out; copies included). Same results,
// bit for bit, as k3::mx_quantize / k3::mx_dequantize. Used by tests and `k3 validate --op formats`.
Status mx_quantize(std::span<const float> x, int64_t rows, int64_t cols, MxElement e, ScaleRule rule,
                   std::span<uint8_t> q, std::span<uint8_t> scales);
Status mx_dequantize(std::span<const uint8_t> q, std::span<const uint8_t> scales, int64_t rows, int64_t cols,
                     MxElement e, std::span<float> out);

}  // namespace k3::cuda
