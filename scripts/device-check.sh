#!/usr/bin/env bash
# GPU check of k3's CUDA backend, sized to finish within 8 minutes on one H200.
#
#   scripts/device-check.sh build   # on the build machine: configure + build build-device/ (CUDA,
#                                   # sm_90a only, Release) and gather what the run needs in
#                                   # build-device/carry/ (k3, k3_cuda_tests, the fla-core wheel)
#   scripts/device-check.sh run     # on the GPU machine: CUDA tests, k3 validate --backend cuda (moe,
#                                   # kda), k3 bench moe / kda --backend cuda with their baselines,
#                                   # fla's Triton KDA on the same inputs; a table last
#   scripts/device-check.sh         # both, on a machine that has a GPU and the build dependencies
#
# With the device tool: run `build` here, then run
#   `bash scripts/device-check.sh run` with carry=["build-device/carry"]
# (the whole build folder is far above the tool's 64 MiB carry limit; carry/ is ~25 MB).
# Logs go to a scratch folder; at exit the summary, the JSON of each step and one archive of all
# logs are copied to $OUT (or build-device/out when $OUT is unset): 7 files, within the tool's
# limit of 8 files coming back. The run phase has one deadline
# (K3_CHECK_BUDGET_S, default 420 s): each step gets its own limit or what is left, whichever is
# smaller, so the whole check fits an 8-minute device window with the machine's start-up.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bdir="$root/build-device"
mode="${1:-all}"

build() {
  "$root/scripts/setup.sh"
  # No MPI: the GPU machine has no libmpi, and the carried binaries must start there.
  "$root/scripts/build.sh" "$bdir" -DK3_CUDA=ON -DK3_CUDA_ARCHS=90a -DK3_BUILD_BENCH=OFF -DK3_WERROR=ON -DK3_MPI=OFF
  # flash-linear-attention's Triton KDA kernels for the side-by-side step (pure Python; the GPU
  # machine has torch and Triton but cannot download).
  mkdir -p "$bdir/wheels"
  python3 -m pip download --no-deps -q -d "$bdir/wheels" "fla-core==0.6.0" ||
    echo "fla-core wheel not downloaded: the fla step will report it"
  # What the GPU machine needs, and nothing else (the tool carries at most 64 MiB in all).
  rm -rf "$bdir/carry"
  mkdir -p "$bdir/carry/tests" "$bdir/carry/wheels"
  cp "$bdir/k3" "$bdir/carry/k3"
  cp "$bdir/tests/k3_cuda_tests" "$bdir/carry/tests/k3_cuda_tests"
  strip --strip-debug "$bdir/carry/k3" "$bdir/carry/tests/k3_cuda_tests" 2>/dev/null || true
  cp "$bdir"/wheels/*.whl "$bdir/carry/wheels/" 2>/dev/null || true
  du -sh "$bdir/carry/k3" "$bdir/carry/tests/k3_cuda_tests" "$bdir/carry/wheels" "$bdir/carry"
  local kb
  kb=$(du -sk "$bdir/carry" | cut -f1)
  [ "$kb" -lt 49152 ] || echo "WARNING: build-device/carry is ${kb} KiB; with the working tree it may exceed the 64 MiB carry limit"
}

deadline=0
# step_limit WANTED: seconds for the next step, at most what is left before the deadline (>= 1).
step_limit() {
  local left=$((deadline - $(date +%s) - 5))
  [ "$left" -lt 1 ] && left=1
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}

summary=()
final_out=""
out=""
# At exit (also after a step ran out of time): the table, then at most 8 files into $OUT.
finish() {
  echo
  echo "== summary"
  for line in "${summary[@]}"; do echo "$line"; done
  [ -n "$out" ] && [ -d "$out" ] || return
  printf "%s\n" "${summary[@]}" >"$out/summary.txt"
  mkdir -p "$final_out"
  cp "$out/summary.txt" "$final_out/" 2>/dev/null
  for j in validate.json bench.json validate_kda.json bench_kda.json fla_kda.json; do
    [ -f "$out/$j" ] && cp "$out/$j" "$final_out/"
  done
  tar czf "$final_out/device-check-logs.tgz" -C "$out" --exclude='*.safetensors' --exclude='fla_pkg' . 2>/dev/null
  echo "results in $final_out: $(ls "$final_out" | tr '\n' ' ')"
}

run_checks() {
  final_out="${OUT:-$bdir/out}"
  out="$(mktemp -d "${TMPDIR:-/tmp}/k3-device-check.XXXXXX")"
  # The carried folder (device tool) or the build folder (scripts/device-check.sh on a GPU machine).
  local cdir="$bdir/carry"
  [ -x "$cdir/k3" ] || cdir="$bdir"
  local k3="$cdir/k3" tests="$cdir/tests/k3_cuda_tests" rc=0
  deadline=$(( $(date +%s) + ${K3_CHECK_BUDGET_S:-420} ))
  trap finish EXIT
  # NCCL for the world-size-1 transport tests: the pip wheel's library when torch's image has it.
  if [ -z "${K3_NCCL_LIBRARY:-}" ]; then
    local nccl
    nccl="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)"
    [ -n "$nccl" ] && [ -f "$nccl" ] && export K3_NCCL_LIBRARY="$nccl"
  fi
  echo "== machine"
  nvidia-smi -L 2>&1 | head -4
  ldd "$k3" | grep -E "not found" && echo "missing shared libraries (see above)"
  "$k3" info | tee "$out/info.txt"
  # The MoE tests run once per kernel path (decode, decode-splitk, prefill, prefill-sm90), so they
  # get their own step: a timeout there still leaves the other tests their time, and the reverse.
  local moe_filter='*CudaMoe*:*Sm120*:*Splitk*:*SplitK*'
  echo "== CUDA unit tests: fused MoE, every path"
  timeout "$(step_limit 120)" "$tests" --gtest_brief=1 --gtest_filter="$moe_filter" 2>&1 | tee "$out/cuda_tests_moe.txt" | tail -25
  local moe_tests_rc=${PIPESTATUS[0]}
  summary+=("$(printf "%-38s %s" "cuda unit tests: moe (every path)" "$([ "$moe_tests_rc" = 0 ] && echo PASS || echo "FAIL (rc $moe_tests_rc)")")")
  echo "== CUDA unit tests: the rest (KDA, MX, routing, EP seam, IPC)"
  timeout "$(step_limit 100)" "$tests" --gtest_brief=1 --gtest_filter="-NcclDevice.*:CudaEpDevice.DispatchExperts*:$moe_filter" 2>&1 | tee "$out/cuda_tests.txt" | tail -25
  local tests_rc=${PIPESTATUS[0]}
  summary+=("$(printf "%-38s %s" "cuda unit tests: the rest" "$([ "$tests_rc" = 0 ] && echo PASS || echo "FAIL (rc $tests_rc)")")")
  [ "$moe_tests_rc" = 0 ] || tests_rc=$moe_tests_rc
  echo "== NCCL transport + device all-reduce + GPU EP, world size 1 (K3_NCCL_LIBRARY=${K3_NCCL_LIBRARY:-unset})"
  timeout "$(step_limit 30)" "$tests" --gtest_filter='NcclDevice.*:CudaEpDevice.DispatchExperts*' 2>&1 | tee "$out/nccl_tests.txt" | tail -12
  local nccl_rc=${PIPESTATUS[0]}
  summary+=("$(printf "%-38s %s" "nccl world size 1" "$([ "$nccl_rc" = 0 ] && (grep -q SKIPPED "$out/nccl_tests.txt" && echo SKIPPED || echo PASS) || echo "FAIL (rc $nccl_rc)")")")
  echo "== k3 validate --op moe --suite all --backend cuda"
  timeout "$(step_limit 70)" "$k3" validate --op moe --suite all --backend cuda --output "$out/validate.json" >"$out/validate.txt" 2>&1
  local validate_rc=$?
  tail -15 "$out/validate.txt"
  summary+=("$(printf "%-38s %s" "k3 validate --backend cuda" "$([ "$validate_rc" = 0 ] && echo PASS || echo "FAIL (rc $validate_rc)")")")
  echo "== k3 bench moe --backend cuda"
  timeout "$(step_limit 60)" "$k3" bench moe --backend cuda --m 1,8,128,2048,8192 --recipe w4a8 --routing ep_mixed \
    --output "$out/bench.json" >"$out/bench.txt" 2>&1
  local bench_rc=$?
  summary+=("$(printf "%-38s %s" "k3 bench moe --backend cuda" "$([ "$bench_rc" = 0 ] && echo ran || echo "FAIL (rc $bench_rc)")")")
  tail -20 "$out/bench.txt"
  echo "== k3 validate --op kda --backend cuda"
  timeout "$(step_limit 40)" "$k3" validate --op kda --backend cuda --output "$out/validate_kda.json" \
    >"$out/validate_kda.txt" 2>&1
  local vkda_rc=$?
  tail -15 "$out/validate_kda.txt"
  summary+=("$(printf "%-38s %s" "k3 validate --op kda --backend cuda" "$([ "$vkda_rc" = 0 ] && echo PASS || echo "FAIL (rc $vkda_rc)")")")
  echo "== k3 bench kda --backend cuda"
  timeout "$(step_limit 40)" "$k3" bench kda --backend cuda --prefill-t 1024 8192 --decode-n 1 64 --iters 3 \
    --output "$out/bench_kda.json" >"$out/bench_kda.txt" 2>&1
  local bkda_rc=$?
  tail -14 "$out/bench_kda.txt"
  summary+=("$(printf "%-38s %s" "k3 bench kda --backend cuda" "$([ "$bkda_rc" = 0 ] && echo ran || echo "FAIL (rc $bkda_rc)")")")
  echo "== fla (Triton) chunk_kda / fused_recurrent_kda, same inputs as k3 kda run --backend cuda"
  local fla_dir="$out/fla_pkg" fla_rc=3
  mkdir -p "$fla_dir"
  for w in "$cdir"/wheels/*.whl; do [ -f "$w" ] && python3 -m zipfile -e "$w" "$fla_dir"; done
  PYTHONPATH="$fla_dir${PYTHONPATH:+:$PYTHONPATH}" timeout "$(step_limit 60)" \
    python3 "$root/scripts/fla_kda_compare.py" --k3 "$k3" --out "$out" >"$out/fla.txt" 2>&1
  fla_rc=$?
  rm -rf "$fla_dir"
  tail -12 "$out/fla.txt"
  summary+=("$(printf "%-38s %s" "fla side by side" "$([ "$fla_rc" = 0 ] && echo ran || echo "FAIL (rc $fla_rc)")")")
  [ "$tests_rc" = 0 ] && [ "$nccl_rc" = 0 ] && [ "$validate_rc" = 0 ] && [ "$bench_rc" = 0 ] &&
    [ "$vkda_rc" = 0 ] && [ "$bkda_rc" = 0 ] || rc=1
  return $rc
}

case "$mode" in
  build) build ;;
  run) run_checks ;;
  all) build && run_checks ;;
  *) echo "usage: $0 [build|run]" >&2; exit 2 ;;
esac
