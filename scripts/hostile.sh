#!/usr/bin/env bash
# Replays the hostile-input cases in one command: malformed / hostile safetensors headers and
# config.json files, absurd KDA shapes and cu_seqlens, malformed `kda run` input files and their
# fuzzer corpus, NaN / Inf in every KDA input (one policy on every backend), a softmax router
# config with and without routing, bad K3_ISA and flag values, control
# characters in tensor names, the output-file safety tests (atomic writes, output = input,
# FIFOs, /dev/null), a peer that hangs, stops or dies in each phase of `k3 moe run --distributed`
# (mpirun, when the build has MPI); then, when the Python package is installed in build-venv (scripts/test.sh
# makes it), the Python-boundary cases (python/tests/test_hostile.py). Prints one line per suite
# and the total count; exits non-zero on any failure.
# Usage: scripts/hostile.sh [BUILD_DIR]   (default: build; builds k3_tests there first)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
if [[ ! -d "$build" ]]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DK3_CUDA=OFF -DK3_BUILD_BENCH=OFF >/dev/null
fi
cmake --build "$build" --target k3_tests k3_cli -j "${K3_BUILD_JOBS:-1}" >/dev/null

filter='HostileCli.*:HostileEpFlags.*:HostileSafetensors.*:HostileConfig.*'
filter+=':SafetensorsMalformed.*:SafetensorsCorpus.*:ModelConfigCorpus.*:ModelConfig.MistypedAndInconsistentValues'
filter+=':OutputFiles.*:MoeOutputFiles.*:AtomicFile.*:AtomicFileDeathTest.*'
filter+=':KdaRun.ErrorsNameTheTensor:KdaCli.BenchRejectsBadOptions'
filter+=':KdaNonfinite.*:KdaInputCorpus.*:SafetensorsView.*:MoeCli.SoftmaxScoringRunsGivenIdsAndRefusesLogitsToRoute'
filter+=':MoeDistributed.EveryPhaseFailsBoundedWhenAPeerHangsStopsOrDies:MoeDistributed.ADeadOrHungRankFailsTheJobWithinBoundedTime'

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
status=0
"$build/tests/k3_tests" --gtest_filter="$filter" --gtest_brief=1 >"$log" 2>&1 || status=$?
grep -E '^\[  (FAILED|PASSED)|^\[==========\]' "$log" || true
passed="$(grep -oE '^\[  PASSED  \] [0-9]+' "$log" | grep -oE '[0-9]+$' || echo 0)"
failed="$(grep -cE '^\[  FAILED  \] [A-Za-z]' "$log" || true)"
echo "hostile cases: ${passed} passed, ${failed} failed"
if [[ $status -ne 0 ]]; then
  grep -B2 -A20 -E '^\[  FAILED  \]' "$log" | head -200
fi
venv="$root/build-venv"
if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c "import k3, pytest" 2>/dev/null; then
  py=0
  (cd "$root/python/tests" && "$venv/bin/python" -m pytest -q test_hostile.py) >"$log" 2>&1 || py=$?
  echo "python boundary cases: $(tail -1 "$log")"
  [[ $py -eq 0 ]] || { cat "$log"; status=$py; }
else
  echo "python boundary cases: skipped (no k3 in build-venv: scripts/test.sh installs it)"
fi
exit $status
