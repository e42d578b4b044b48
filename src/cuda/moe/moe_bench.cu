// Device timing helpers (k3/harness/cuda_bench.hpp). Ran on an H200 (2026-12-04).
#include <cublas_v2.h>  // types and prototypes only: the library is opened at run time (below)
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/moe/moe_kernels.cuh"
#include "cuda/timing.cuh"
#include "k3/harness/cuda_bench.hpp"
#include "k3/cuda_moe.hpp"

namespace k3::cuda {
namespace {

using detail::time_events;

// Random BF16 operands for the cuBLAS baseline, generated on the device (a counter hash,
// splitmix64 of seed + index): |v| in [2^-7, 1), random sign. Not zeros: zeros run faster than
// real data. On the host this took seconds per M at Kimi shapes (925 M values), which the first
// H200 window (2026-12-04) spent instead of timing the larger M.
__global__ void fill_random_bf16_kernel(uint16_t* __restrict__ v, int64_t count, uint64_t seed) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(i + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const uint32_t mag = 0x3C00u + static_cast<uint32_t>(z % (0x3F7Fu - 0x3C00u + 1u));
    v[i] = static_cast<uint16_t>(mag | ((z >> 63) << 15));
  }
}

Status fill_random_bf16(uint16_t* v, int64_t count, uint64_t seed) {
  if (count <= 0) return Status::ok();
  const int block = 256;
  const int64_t want = (count + block - 1) / block;
  const int grid = static_cast<int>(std::min<int64_t>(want, 65535));
  fill_random_bf16_kernel<<<grid, block>>>(v, count, seed);
  K3_CUDA_TRY(cudaGetLastError(), "fill_random_bf16_kernel launch");
  return Status::ok();
}


// cuBLAS is needed only for the BF16 baseline of `k3 bench moe --backend cuda`. Linking it would
// load ~700 MB of libraries at every start of every k3 command (and fail on machines without
// them), so it is opened here, on first use: the soname of the toolkit k3 was built with, then
// other majors, then lib64/ and lib/ of $CUDA_HOME and /usr/local/cuda.
struct CublasApi {
  decltype(&::cublasCreate_v2) create = nullptr;
  decltype(&::cublasDestroy_v2) destroy = nullptr;
  // The exported cublasGemmEx (the header adds an inline C++ overload taking a cudaDataType
  // compute type, so the signature is spelled out).
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
};

Result<CublasApi> load_cublas() {
  static const Result<CublasApi> loaded = []() -> Result<CublasApi> {
    const std::string own = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
    std::vector<std::string> names = {own, "libcublas.so.13", "libcublas.so.12", "libcublas.so"};
    const char* dirs[] = {std::getenv("CUDA_HOME"), "/usr/local/cuda"};
    for (const char* dir : dirs) {
      if (dir != nullptr && *dir != 0) {
        names.push_back(std::string(dir) + "/lib64/" + own);
        names.push_back(std::string(dir) + "/lib/" + own);
      }
    }
    std::string tried;
    for (const auto& name : names) {
      void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib == nullptr) {
        tried += (tried.empty() ? "" : ", ") + name;
        continue;
      }
      CublasApi api;
      api.create = reinterpret_cast<decltype(api.create)>(dlsym(lib, "cublasCreate_v2"));
      api.destroy = reinterpret_cast<decltype(api.destroy)>(dlsym(lib, "cublasDestroy_v2"));
      api.gemm_ex = reinterpret_cast<decltype(api.gemm_ex)>(dlsym(lib, "cublasGemmEx"));
      if (api.create && api.destroy && api.gemm_ex) return api;
      dlclose(lib);
      tried += (tried.empty() ? "" : ", ") + name + " (symbols missing)";
    }
    return unavailable("cuBLAS (for the BF16 baseline) could not be opened; tried " + tried +
                       "; add its folder to LD_LIBRARY_PATH");
  }();
  return loaded;
}

Status from_cublas(cublasStatus_t st, const char* what) {
  if (st == CUBLAS_STATUS_SUCCESS) return Status::ok();
  return unavailable(std::string(what) + ": cuBLAS status " + std::to_string(static_cast<int>(st)));
}

}  // namespace

Result<DeviceTiming> time_device_copy(int64_t bytes, int warmup, int iters) {
  detail::DeviceBuffer<uint8_t> a, b;
  K3_RETURN_IF_ERROR(a.allocate(bytes));
  K3_RETURN_IF_ERROR(b.allocate(bytes));
  K3_CUDA_TRY(cudaMemset(a.get(), 1, bytes), "cudaMemset");
  auto r = time_events(
      [&](int) { return detail::from_cuda(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice), "copy"); },
      warmup, iters);
  return r;
}

Result<DeviceTiming> time_moe(const MoeProblem& p, const MoeWeightsView& w, const MoeInputsView& in, int warmup,
                              int iters, int weight_copies, const std::string& path, int device) {
  K3_RETURN_IF_ERROR(validate_moe_buffers(p, w, in));
  MoeOptions options;
  K3_RETURN_IF_ERROR(moe_detail::apply_path_option(path, options));
  auto caps = device_caps(device);
  if (!caps.is_ok()) return caps.status();
  options.max_tokens = std::max<int64_t>(in.m, 1);
  options.device = caps.value();
  auto plan = cuda::plan(p, options);
  if (!plan.is_ok()) return plan.status();
  std::vector<DeviceWeights> copies;
  for (int c = 0; c < std::max(weight_copies, 1); ++c) {
    auto wt = prepack(plan.value(), w);
    if (!wt.is_ok()) return wt.status();
    copies.push_back(std::move(wt.value()));
  }
  detail::DeviceBuffer<uint8_t> ws, out;
  detail::DeviceBuffer<uint16_t> x;
  detail::DeviceBuffer<int32_t> ids, m;
  detail::DeviceBuffer<float> wts;
  K3_RETURN_IF_ERROR(ws.allocate(plan->workspace_bytes));
  K3_RETURN_IF_ERROR(x.allocate(in.x.size()));
  K3_RETURN_IF_ERROR(ids.allocate(in.topk_ids.size()));
  K3_RETURN_IF_ERROR(wts.allocate(in.topk_weights.size()));
  K3_RETURN_IF_ERROR(m.allocate(1));
  K3_RETURN_IF_ERROR(out.allocate(in.m * p.shape.hidden * out_dtype_size(p.out_dtype)));
  const int32_t m32 = static_cast<int32_t>(in.m);
  K3_CUDA_TRY(cudaMemcpy(x.get(), in.x.data(), in.x.size_bytes(), cudaMemcpyHostToDevice), "copy x");
  K3_CUDA_TRY(cudaMemcpy(ids.get(), in.topk_ids.data(), in.topk_ids.size_bytes(), cudaMemcpyHostToDevice), "copy ids");
  K3_CUDA_TRY(cudaMemcpy(wts.get(), in.topk_weights.data(), in.topk_weights.size_bytes(), cudaMemcpyHostToDevice),
              "copy weights");
  K3_CUDA_TRY(cudaMemcpy(m.get(), &m32, 4, cudaMemcpyHostToDevice), "copy m");
  const DeviceInputs din{m.get(), x.get(), ids.get(), wts.get(), out.get()};
  auto timing = time_events(
      [&](int i) { return run(plan.value(), copies[i % copies.size()], din, ws.get(), nullptr); }, warmup, iters);
  if (timing.is_ok()) timing->path = moe_path_name(effective_path(plan.value(), copies.front()));
  return timing;
}

Result<DeviceTiming> time_cublas_baseline(const MoeProblem& p, std::span<const int64_t> rows_per_expert, int warmup,
                                          int iters) {
  K3_RETURN_IF_ERROR(validate_moe_shape(p.shape));
  const int64_t k = p.shape.hidden, n = p.shape.intermediate, e = p.shape.local_experts();
  if (static_cast<int64_t>(rows_per_expert.size()) != e) {
    return invalid_argument("rows_per_expert has " + std::to_string(rows_per_expert.size()) +
                            " entries, expected E_local = " + std::to_string(e));
  }
  int64_t max_rows = 1;
  for (int64_t r : rows_per_expert) max_rows = std::max(max_rows, r);
  // Random BF16 operands, generated on the device (fill_random_bf16).
  detail::DeviceBuffer<uint16_t> w1, w2, a, h;
  detail::DeviceBuffer<float> c1, c2;
  K3_RETURN_IF_ERROR(w1.allocate(e * 2 * n * k));
  K3_RETURN_IF_ERROR(w2.allocate(e * k * n));
  K3_RETURN_IF_ERROR(a.allocate(max_rows * k));
  K3_RETURN_IF_ERROR(h.allocate(max_rows * n));
  K3_RETURN_IF_ERROR(c1.allocate(max_rows * 2 * n));
  K3_RETURN_IF_ERROR(c2.allocate(max_rows * k));
  K3_RETURN_IF_ERROR(fill_random_bf16(w1.get(), e * 2 * n * k, 1));
  K3_RETURN_IF_ERROR(fill_random_bf16(w2.get(), e * k * n, 2));
  K3_RETURN_IF_ERROR(fill_random_bf16(a.get(), max_rows * k, 3));
  K3_CUDA_TRY(cudaDeviceSynchronize(), "fill the baseline's operands");
  K3_CUDA_TRY(cudaMemset(h.get(), 0x3C, max_rows * n * 2), "init h");
  auto api = load_cublas();
  if (!api.is_ok()) return api.status();
  const CublasApi& cb = api.value();
  cublasHandle_t handle;
  K3_RETURN_IF_ERROR(from_cublas(cb.create(&handle), "cublasCreate"));
  const float one = 1.0f, zero = 0.0f;
  // Column-major view: C^T [cols, rows] = W [cols, red] (row-major = col-major transposed) x A^T.
  auto gemm = [&](const uint16_t* w, const uint16_t* act, float* c, int64_t rows, int64_t cols, int64_t red) {
    return from_cublas(cb.gemm_ex(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(cols), static_cast<int>(rows),
                                    static_cast<int>(red), &one, w, CUDA_R_16BF, static_cast<int>(red), act,
                                    CUDA_R_16BF, static_cast<int>(red), &zero, c, CUDA_R_32F, static_cast<int>(cols),
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                       "cublasGemmEx");
  };
  auto result = time_events(
      [&](int) -> Status {
        for (int64_t ex = 0; ex < e; ++ex) {
          const int64_t rows = rows_per_expert[ex];
          if (rows == 0) continue;
          K3_RETURN_IF_ERROR(gemm(w1.get() + ex * 2 * n * k, a.get(), c1.get(), rows, 2 * n, k));
          K3_RETURN_IF_ERROR(gemm(w2.get() + ex * k * n, h.get(), c2.get(), rows, k, n));
        }
        return Status::ok();
      },
      warmup, iters);
  cb.destroy(handle);
  return result;
}

}  // namespace k3::cuda
