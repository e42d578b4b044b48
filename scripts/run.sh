#!/usr/bin/env bash
# k3's main job on this machine: install dependencies, build, show the machine and build facts,
# validate the kernels against their oracles (the MoE at the Kimi-K3 per-rank shape on the CPU
# backend), and benchmark the Kimi-K3 MoE layer as fractions of the measured machine limits.
# Takes a few minutes on 2 cores. Exits non-zero if any check fails.
# Usage: scripts/run.sh
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/setup.sh" || exit 1
"$root/scripts/build.sh" "$root/build" >/dev/null || exit 1
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
echo
echo "== k3 bench moe --m 1,8,128 --recipe w4a8 --routing ep_mixed"
"$k3" bench moe --m 1,8,128 --recipe w4a8 --routing ep_mixed --output "$out/bench_moe.json" | tee "$out/bench_moe.txt" ||
  failed=1
echo
# One line for this machine: ISA level, M = 1 against the read bandwidth, M = 128 against the peak.
grep '^verdict: ' "$out/bench_moe.txt" | sed 's/^verdict: /machine verdict: /' || failed=1
echo "JSON records in build/results/. Full matrices: k3 validate --op all; full sweep: k3 bench moe --recipe both"
[ "$failed" = 0 ] && echo "main job: all checks passed" || echo "main job: SOME CHECKS FAILED"
exit "$failed"
