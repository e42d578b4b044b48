#!/usr/bin/env bash
# Installs k3's build dependencies from Debian packages when they are missing. Idempotent.
# Usage: scripts/setup.sh
set -euo pipefail

# clang-14 + libomp-14-dev + libclang-rt-14-dev: the ThreadSanitizer build of scripts/test.sh (LLVM's
# OpenMP runtime with its Archer TSan annotations) and the libFuzzer targets of scripts/fuzz.sh.
# python3-dev + python3-venv + ninja-build: the Python package (pip install .) and its pytest suite.
# libopenmpi-dev + openmpi-bin: the MPI transport of the multi-rank ops and its mpirun tests.
# python3-pip: downloads the pinned CUTLASS headers (PyPI nvidia-cutlass) for the CUDA build.
packages=(cmake g++ make libgtest-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev libssl-dev
          clang-14 libomp-14-dev libclang-rt-14-dev pkg-config python3-dev python3-venv ninja-build
          libopenmpi-dev openmpi-bin python3-pip)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "k3 setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "k3 setup: CUDA toolkit found, the CUDA backend will be compiled"
  # CUTLASS headers (NVIDIA's tested GEMM building blocks; header-only) for the CUTLASS-based MoE
  # kernels: the pinned PyPI wheel nvidia-cutlass, checked against its SHA-256, unpacked into
  # .cache/ (CMake looks there; -DK3_CUTLASS_INCLUDE_DIR=... overrides).
  "$(dirname "$0")/fetch-cutlass.sh"
else
  echo "k3 setup: no CUDA toolkit, building the CPU backends only"
fi
