// k3/config.hpp — portability macros shared by host and device code.
#pragma once

// Functions usable from host and device code. Public headers never include CUDA headers;
// under nvcc the CUDA keywords are available without any include.
#if defined(__CUDACC__)
#define K3_HOST_DEVICE __host__ __device__
#else
#define K3_HOST_DEVICE
#endif
