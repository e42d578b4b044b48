#!/usr/bin/env bash
# Builds and runs the whole k3 test suite: the Release build with warnings as errors (CUDA code
# compiled when nvcc exists; CUDA tests skip without a device), then the tests again under
# AddressSanitizer + UndefinedBehaviorSanitizer (CPU code).
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
echo "== all tests passed"
