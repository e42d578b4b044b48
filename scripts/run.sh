#!/usr/bin/env bash
# k3's main job on this machine: install dependencies, build, show the machine and build facts,
# validate the kernels against their oracles (the MoE at the Kimi-K3 per-rank shape on the CPU
# backend), benchmark the Kimi-K3 MoE layer as fractions of the measured machine limits, and run a
# transformers Kimi-Linear model on k3 against stock (K3_SKIP_HF=1 skips that step).
# Takes about ten minutes on 2 cores (the first time: the torch download). Exits non-zero if any
# check fails.
# Usage: scripts/run.sh
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/setup.sh" || exit 1
# Only what the main job needs (the k3 tool and its libraries; no tests or microbenchmarks), with
# the compiler's progress lines so that a long CUDA compile is visibly moving.
echo "== build (build/, target k3; CUDA kernels are compiled too when nvcc exists: several minutes on 2 cores)"
mkdir -p "$root/build"
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=Release >"$root/build/configure.log" 2>&1 ||
  { cat "$root/build/configure.log"; echo "main job: cmake configure failed" >&2; exit 1; }
grep -E '^-- k3' "$root/build/configure.log" || true
cmake --build "$root/build" --target k3_cli -j "$(nproc 2>/dev/null || echo 2)" 2>&1 |
  grep --line-buffered -E '^\[ *[0-9]+%\]|error|Error'
[ "${PIPESTATUS[0]}" = 0 ] || { echo "main job: the build failed (see above)" >&2; exit 1; }
k3="$root/build/k3"
# Idle OpenMP threads sleep instead of spinning: on a shared or oversubscribed machine a spinning
# thread steals the core from the one holding the work (docs/cpu_moe.md). Override by exporting it.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
out="$root/build/results"
mkdir -p "$out"
failed=0
step() {
  echo
  echo "== k3 $*"
  "$k3" "$@" || failed=1
}
step info
step validate --op formats --output "$out/validate_formats.json"
step validate --op moe --suite smoke --backend cpu --output "$out/validate_moe_smoke.json"
step validate --op moe --suite real --backend cpu --recipe w4a8 --activation situ --output "$out/validate_moe_real.json"
step validate --op kda --suite smoke --output "$out/validate_kda.json"
step validate --op linear --suite smoke --output "$out/validate_linear.json"
echo
echo "== k3 bench moe --m 1,8,128 --recipe w4a8 --routing ep_mixed"
"$k3" bench moe --m 1,8,128 --recipe w4a8 --routing ep_mixed --output "$out/bench_moe.json" | tee "$out/bench_moe.txt" ||
  failed=1
echo
# One line for this machine: ISA level, M = 1 against the read bandwidth, M = 128 against the peak.
grep '^verdict: ' "$out/bench_moe.txt" | sed 's/^verdict: /machine verdict: /' || failed=1
# The dense MXFP8 linear layer at the seed's KDA output projection: decode against the read
# bandwidth, M = 256 against the level's peak (docs/linear.md).
step bench linear --shapes 1536x7168 --m 1,256 --rounds 2 --pool-mib 64 --output "$out/bench_linear.json"
# A picture of the sweep next to its JSON when matplotlib is there (optional: never a failure).
if python3 -c "import matplotlib" >/dev/null 2>&1; then
  python3 "$root/python/k3/plot.py" "$out/bench_moe.json" -o "$out/bench_moe.png" >/dev/null 2>&1 &&
    echo "plot: $out/bench_moe.png"
else
  echo "plot: skipped (no matplotlib; pip install matplotlib, then python -m k3 plot $out/bench_moe.json -o bench.png)"
fi
# A real model through k3: a transformers Kimi-Linear model (random weights, Kimi-Linear-48B's widths,
# 2 layers) generating with stock transformers and patched onto k3 (docs/transformers.md). Needs torch
# and transformers from PyPI and the Python package, in build-venv/ (shared with scripts/test.sh).
# K3_SKIP_HF=1 skips it.
if [ "${K3_SKIP_HF:-0}" != 1 ]; then
  echo
  echo "== a real model: Kimi-Linear in transformers on k3 (python -m k3 hf generate; installs torch + transformers)"
  venv="$root/build-venv"
  if { [ -x "$venv/bin/python" ] || python3 -m venv "$venv"; } &&
     "$root/scripts/pip-retry.sh" "$venv/bin/pip" install -q --upgrade pip &&
     "$root/scripts/pip-retry.sh" "$venv/bin/pip" install -q numpy "scikit-build-core>=0.10" "nanobind>=2.4" torch "transformers>=5.17,<6" &&
     CMAKE_BUILD_PARALLEL_LEVEL="$(nproc 2>/dev/null || echo 2)" "$venv/bin/pip" install -q --no-build-isolation "$root"; then
    "$venv/bin/python" -m k3 hf generate --layers 2 --new-tokens 32 --dense 2>&1 |
      grep -v -E 'falling back to its reference|Loading weights|Writing model shards'
    [ "${PIPESTATUS[0]}" = 0 ] || failed=1
  else
    echo "main job: installing torch / transformers / the k3 package failed" >&2
    failed=1
  fi
fi
echo "JSON records in build/results/. Full matrices: k3 validate --op all; full sweep: k3 bench moe --recipe both"
[ "$failed" = 0 ] && echo "main job: all checks passed" || echo "main job: SOME CHECKS FAILED"
exit "$failed"
