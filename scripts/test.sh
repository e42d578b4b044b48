#!/usr/bin/env bash
# Builds and runs the whole k3 test suite: the Release build with warnings as errors (CUDA code
# compiled when nvcc exists; CUDA tests skip without a device), then the tests again under
# AddressSanitizer + UndefinedBehaviorSanitizer (CPU code), then under ThreadSanitizer (clang-14
# with LLVM's OpenMP runtime and its Archer tool, so OpenMP synchronization is understood).
# Usage: scripts/test.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
jobs="$(nproc 2>/dev/null || echo 2)"
"$root/scripts/setup.sh"

echo "== release build (warnings are errors)"
"$root/scripts/build.sh" "$root/build" -DK3_WERROR=ON
(cd "$root/build" && ctest -j "$jobs" --output-on-failure)

echo "== sanitizer build (ASan + UBSan)"
"$root/scripts/build.sh" "$root/build-asan" -DK3_WERROR=ON -DK3_SANITIZE=ON -DK3_CUDA=OFF -DK3_BUILD_BENCH=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo
(cd "$root/build-asan" && ASAN_OPTIONS=detect_leaks=1 ctest -j "$jobs" --output-on-failure)

echo "== thread sanitizer build (TSan, clang-14 + libomp + Archer)"
"$root/scripts/build.sh" "$root/build-tsan" -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_C_COMPILER=clang-14 -DK3_WERROR=ON \
  -DK3_TSAN=ON -DK3_CUDA=OFF -DK3_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
archer=/usr/lib/llvm-14/lib/libarcher.so
[ -f "$archer" ] || { echo "k3 test: $archer missing (Debian package libomp-14-dev)" >&2; exit 1; }
(cd "$root/build-tsan" && OMP_TOOL_LIBRARIES="$archer" TSAN_OPTIONS="halt_on_error=1 ignore_noninstrumented_modules=1" \
  ctest -j "$jobs" --output-on-failure)
echo "== all tests passed"
