#!/usr/bin/env bash
# Builds and runs the whole k3 test suite: the Release build with warnings as errors (CUDA code
# compiled when nvcc exists; CUDA tests skip without a device), then the tests again under
# AddressSanitizer + UndefinedBehaviorSanitizer (CPU code), then under ThreadSanitizer (clang-14
# with LLVM's OpenMP runtime and its Archer tool, so OpenMP synchronization is understood; without
# MPI, whose uninstrumented runtime TSan cannot follow: the multi-rank code runs there on the
# one-process communicator), then
# installs the Python package into a virtual environment and runs its pytest suite.
# Usage: scripts/test.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
jobs="$(nproc 2>/dev/null || echo 2)"
"$root/scripts/setup.sh"

echo "== python test dependencies (downloaded first: a network failure shows in minute one, not after the builds)"
venv="$root/build-venv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$root/scripts/pip-retry.sh" "$venv/bin/pip" install -q --upgrade pip
# torch and transformers are part of the suite (the custom ops, the fla-compatible entry points,
# the transformers Kimi-Linear integration): installed here, and K3_REQUIRE_TORCH=1 makes their
# tests fail rather than skip when either is missing. fla-core 0.6.0's released wheel is downloaded and its
# source is unpacked (not installed: transformers would pick it up, and it has no CPU path) so
# that a test reads its real signatures.
"$root/scripts/pip-retry.sh" "$venv/bin/pip" install -q numpy pytest "scikit-build-core>=0.10" "nanobind>=2.4" torch "transformers>=5.17,<6"
fla="$venv/fla-core-0.6.0"
if [ ! -d "$fla/fla" ]; then
  rm -rf "$fla" && mkdir -p "$fla"
  "$root/scripts/pip-retry.sh" "$venv/bin/pip" download -q --no-deps -d "$fla" fla-core==0.6.0
  "$venv/bin/python" -m zipfile -e "$fla"/fla_core-0.6.0-*.whl "$fla"
fi
export K3_FLA_SOURCE="$fla"

echo "== release build (warnings are errors)"
"$root/scripts/build.sh" "$root/build" -DK3_WERROR=ON
(cd "$root/build" && ctest -j "$jobs" --output-on-failure)

echo "== device check rehearsal (scripts/device-check.sh dry-run: the failure cases of a GPU window)"
"$root/scripts/device-check.sh" dry-run

echo "== sanitizer build (ASan + UBSan)"
"$root/scripts/build.sh" "$root/build-asan" -DK3_WERROR=ON -DK3_SANITIZE=ON -DK3_CUDA=OFF -DK3_BUILD_BENCH=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo
(cd "$root/build-asan" && ASAN_OPTIONS=detect_leaks=1 LSAN_OPTIONS="suppressions=$root/scripts/lsan-mpi.supp" \
  ctest -j "$jobs" --output-on-failure)

echo "== thread sanitizer build (TSan, clang-14 + libomp + Archer)"
"$root/scripts/build.sh" "$root/build-tsan" -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_C_COMPILER=clang-14 -DK3_WERROR=ON \
  -DK3_TSAN=ON -DK3_CUDA=OFF -DK3_MPI=OFF -DK3_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
archer=/usr/lib/llvm-14/lib/libarcher.so
[ -f "$archer" ] || { echo "k3 test: $archer missing (Debian package libomp-14-dev)" >&2; exit 1; }
(cd "$root/build-tsan" && OMP_TOOL_LIBRARIES="$archer" TSAN_OPTIONS="halt_on_error=1 ignore_noninstrumented_modules=1" \
  ctest -j "$jobs" --output-on-failure)

echo "== python package (pip install . into the virtual environment, then pytest)"
venv="$root/build-venv"
export K3_FLA_SOURCE="$venv/fla-core-0.6.0"
CMAKE_BUILD_PARALLEL_LEVEL="$jobs" "$venv/bin/pip" install -q --no-build-isolation "$root"
export K3_REQUIRE_TORCH=1
(cd "$root/python/tests" && "$venv/bin/python" -m pytest -q -rs)
# The oldest transformers k3.hf supports (5.17, the first with Kimi-Linear), in a second virtual
# environment layered over the first (its own site-packages first, then the first's: torch, k3).
old="$root/build-venv-tf517"
if [ ! -x "$old/bin/python" ]; then
  python3 -m venv "$old"
  "$venv/bin/python" -c "import site; print(site.getsitepackages()[0])" \
    >"$("$old/bin/python" -c "import site; print(site.getsitepackages()[0])")/zz_k3_base_venv.pth"
fi
"$root/scripts/pip-retry.sh" "$old/bin/pip" install -q "transformers==5.17.0"
echo "== transformers $("$old/bin/python" -c "import transformers; print(transformers.__version__)") (oldest supported)"
(cd "$root/python/tests" && "$old/bin/python" -m pytest -q -rs test_hf.py)
echo "== all tests passed"
