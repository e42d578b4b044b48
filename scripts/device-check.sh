#!/usr/bin/env bash
# GPU check of k3's CUDA backend. A GPU window is rare and short (docs/cuda_moe.md, "Checking it
# on a device"): this script gets one try, so it fails loudly while building, checks before it spends
# device time, cannot hang, and leaves a summary that is read in ten seconds.
#
#   scripts/device-check.sh build     # here: build build-device/ (CUDA sm_90a, Release, only the
#                                     # targets k3_cli and k3_cuda_tests) and gather what the run
#                                     # needs in build-device/carry/ (binaries, libgomp / libcrypto,
#                                     # the fla-core wheel, MANIFEST.txt); refuses to finish when
#                                     # CUTLASS is missing or `k3 info` lacks a MoE path
#   scripts/device-check.sh run       # on the GPU machine, from build-device/carry/ only
#   scripts/device-check.sh dry-run   # here: rehearses the failure cases with stand-ins (a build
#                                     # failure, a missing carried binary, a missing library, a
#                                     # step that hangs past SIGTERM, a bench without its
#                                     # baseline) and checks each one's summary and $OUT; CI runs it
#
# With the device tool: `bash scripts/device-check.sh build` here, then
#   run(command="bash scripts/device-check.sh run", carry=["build-device/carry"], timeout_s=600)
#
# The run: one deadline, K3_CHECK_BUDGET_S (default 540 s) from its start. The steps' limits plus
# a 5 s kill grace each sum to at most the budget less 10 s for the summary (scaled down when the
# budget is smaller), in this order: probes, CUDA tests (MoE, then the rest, then NCCL at world
# size 1), k3 validate (moe, kda), k3's benchmarks (moe, kda), and fla last. Every step runs under
# `timeout -k 5`, line-buffered; its output goes straight to $OUT/logs.txt. The summary
# ($OUT/summary.txt, rewritten after every step) has the device, driver and CUDA version, per
# step PASS / FAIL / TIMEOUT (with the test it hung in) / SKIPPED (with why), the seconds used and
# the gtest counts, then the headline figures. $OUT holds at most 7 files (summary.txt, logs.txt
# and five JSON files), within what the device tool brings back (8 files, 16 MiB each).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bdir="${K3_DEVICE_BUILD_DIR:-$root/build-device}"
mode="${1:-}"

say() { printf '%s\n' "$*"; }

# ------------------------------------------------------------------------------------------ build
build_fail() {
  say "device-check build: FAILED: $*" >&2
  exit 1
}

build() {
  local carry="$bdir/carry" log
  # Stale outputs first: nothing from an earlier build may be carried by mistake.
  rm -rf "$carry" "$bdir/k3" "$bdir/tests/k3_cuda_tests"
  mkdir -p "$bdir"
  log="$bdir/build.log"
  : >"$log"
  # K3_SKIP_SETUP=1: the dependencies and the CUTLASS headers are already there (checked below).
  if [ "${K3_SKIP_SETUP:-0}" != 1 ]; then
    "$root/scripts/setup.sh" >>"$log" 2>&1 || { tail -20 "$log"; build_fail "scripts/setup.sh (log: $log)"; }
    "$root/scripts/fetch-cutlass.sh" >>"$log" 2>&1 ||
      { tail -5 "$log"; build_fail "the CUTLASS headers could not be fetched: prefill-sm90 would not be built (log: $log)"; }
  fi
  # No MPI: the GPU machine has no libmpi, and the carried binaries must start there.
  # shellcheck disable=SC2086  # K3_DEVICE_CMAKE_ARGS: extra arguments, split on purpose
  cmake -S "$root" -B "$bdir" -DCMAKE_BUILD_TYPE=Release -DK3_CUDA=ON -DK3_CUDA_ARCHS=90a -DK3_BUILD_BENCH=OFF \
    -DK3_WERROR=ON -DK3_MPI=OFF ${K3_DEVICE_CMAKE_ARGS:-} >>"$log" 2>&1 ||
    { tail -30 "$log"; build_fail "cmake configure (log: $log)"; }
  # Before the long compile: CUTLASS must be there, or prefill-sm90 would silently not be built
  # and its tests would skip on the GPU.
  grep -q "k3: CUTLASS headers .*building the CUTLASS MoE kernels" "$log" ||
    build_fail "CUTLASS headers missing: $(grep -m1 'k3: CUTLASS headers' "$log" || echo 'no CUTLASS line in the configure log') (log: $log)"
  cmake --build "$bdir" -j "$(nproc 2>/dev/null || echo 2)" --target k3_cli k3_cuda_tests >>"$log" 2>&1 ||
    { grep -E "error|Error" "$log" | head -20; build_fail "cmake --build --target k3_cli k3_cuda_tests (log: $log)"; }
  local bin
  for bin in "$bdir/k3" "$bdir/tests/k3_cuda_tests"; do
    [ -x "$bin" ] || build_fail "$bin was not built"
  done
  # Every MoE path must be in the build (CUTLASS's prefill-sm90 above all).
  local info
  info="$("$bdir/k3" info 2>&1)" || build_fail "k3 info failed: $info"
  local path
  for path in "decode-splitk" "prefill," "prefill-sm90 (CUTLASS"; do
    grep -q -- "$path" <<<"$info" || build_fail "k3 info does not list the MoE path '$path': $(grep 'moe paths' <<<"$info")"
  done
  mkdir -p "$carry/tests" "$carry/lib" "$carry/wheels"
  cp "$bdir/k3" "$carry/k3"
  cp "$bdir/tests/k3_cuda_tests" "$carry/tests/k3_cuda_tests"
  strip --strip-debug "$carry/k3" "$carry/tests/k3_cuda_tests" || build_fail "strip"
  chmod +x "$carry/k3" "$carry/tests/k3_cuda_tests"
  # libgomp and libcrypto travel with the binaries (the GPU image need not have this build's).
  local lib
  for lib in $(ldd "$carry/k3" "$carry/tests/k3_cuda_tests" | awk '/libgomp|libcrypto/ && $3 ~ /^\// {print $3}' | sort -u); do
    cp -L "$lib" "$carry/lib/"
  done
  # flash-linear-attention's Triton KDA kernels for the side-by-side step (pure Python; the GPU
  # machine has torch and Triton but cannot download). Optional: the fla step says when it is absent.
  python3 -m pip download --no-deps -q -d "$carry/wheels" "fla-core==0.6.0" >>"$log" 2>&1 ||
    say "fla-core wheel not downloaded: the fla step will say SKIPPED"
  {
    say "k3 device-check carry, built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$root" diff --quiet 2>/dev/null || echo ' (uncommitted changes)')"
    for bin in "$carry/k3" "$carry/tests/k3_cuda_tests"; do
      say "$(basename "$bin"): sha256 $(sha256sum "$bin" | cut -c1-16), NEEDED: $(readelf -d "$bin" | awk '/NEEDED/ {gsub(/[][]/, "", $5); printf "%s ", $5}')"
      say "  highest symbol versions: $(objdump -T "$bin" | grep -o 'GLIBC_[0-9.]*' | sort -V | tail -1) $(objdump -T "$bin" | grep -o 'GLIBCXX_[0-9.]*' | sort -V | tail -1) $(objdump -T "$bin" | grep -o 'CXXABI_[0-9.]*' | sort -V | tail -1)"
    done
    say "carried libraries: $(cd "$carry/lib" && ls | tr '\n' ' ')"
    say "$info" | grep -E "cuda archs|moe paths"
  } >"$carry/MANIFEST.txt"
  cat "$carry/MANIFEST.txt"
  du -sh "$carry"
  local kb
  kb=$(du -sk "$carry" | cut -f1)
  [ "$kb" -lt 49152 ] || build_fail "build-device/carry is ${kb} KiB: with the working tree it would pass the tool's 64 MiB carry limit"
  say "device-check build: OK ($carry)"
}

# -------------------------------------------------------------------------------------------- run
out=""
scratch=""
skip_on_3=""   # step: the SKIPPED reason for exit code 3 (fla)
summary=""     # the table rows so far
head_lines=""  # device / build lines
deadline=0
declare -a plan_names=() plan_limits=()
declare -A limit_of=()

# The planned limits (seconds), in run order; scaled so that sum(limit + 5) <= budget - 10.
plan_steps() {
  plan_names=(probe_smi probe_info moe_tests cuda_tests nccl validate_moe validate_kda bench_moe bench_kda fla)
  plan_limits=(10 10 25 20 15 40 50 60 35 200)
  local budget="$1" sum=0 i
  for i in "${!plan_limits[@]}"; do sum=$((sum + plan_limits[i] + 5)); done
  local room=$((budget - 10))
  local total=0
  for i in "${!plan_names[@]}"; do
    local l=${plan_limits[i]}
    if [ "$sum" -gt "$room" ]; then l=$(((plan_limits[i] + 5) * room / sum - 5)); fi
    [ "$l" -lt 1 ] && l=1
    limit_of[${plan_names[i]}]=$l
    total=$((total + l + 5))
  done
  # The 1 s floor of the short steps may overshoot: take it back from the longest step.
  while [ "$total" -gt "$room" ]; do
    local longest=${plan_names[0]} n
    for n in "${plan_names[@]}"; do [ "${limit_of[$n]}" -gt "${limit_of[$longest]}" ] && longest=$n; done
    [ "${limit_of[$longest]}" -le 1 ] && break
    limit_of[$longest]=$((limit_of[$longest] - 1))
    total=$((total - 1))
  done
}

write_summary() {
  [ -n "$out" ] || return 0
  {
    say "k3 device check — $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    printf '%s' "$head_lines"
    printf '%-14s %5s  %-9s  %s\n' "step" "secs" "gtest p/f/s" "status"
    printf '%s' "$summary"
  } >"$out/summary.txt.tmp" && mv "$out/summary.txt.tmp" "$out/summary.txt"
}

add_row() {  # name status secs [counts: passed/failed/skipped]
  summary+="$(printf '%-14s %5s  %-9s  %s' "$1" "$3" "${4:--}" "$2")"$'\n'
  write_summary
}

abort_run() {  # one-line reason: nothing else will run (the EXIT trap writes the summary)
  add_row "ABORTED" "$1" 0
  say "device-check: ABORTED: $1" >>"$out/logs.txt"
  exit 1
}

# gtest counts of a log: "passed/failed/skipped", or empty when it printed none.
gtest_counts() {
  local p f s
  p=$(grep -oE '^\[  PASSED  \] [0-9]+ test' "$1" | grep -oE '[0-9]+' | tail -1)
  f=$(grep -oE '^\[  FAILED  \] [0-9]+ test' "$1" | grep -oE '[0-9]+' | tail -1)
  s=$(grep -oE '^\[  SKIPPED \] [0-9]+ test' "$1" | grep -oE '[0-9]+' | tail -1)
  [ -z "$p$f$s" ] && return 0
  say "${p:-0}/${f:-0}/${s:-0}"
}

# The test a gtest log was in when it stopped: the last [ RUN ] without its [ OK ] / [ FAILED ].
last_running_test() {
  awk '/^\[ RUN      \]/ {t = $4; open = 1} /^\[       OK \]|^\[  FAILED  \]|^\[  SKIPPED \]/ {if ($4 == t) open = 0}
       END {if (open) print t}' "$1"
}

# step NAME KIND COMMAND...: runs COMMAND under its limit (or what is left before the deadline),
# line-buffered, output appended to $OUT/logs.txt; records a row. KIND: gtest (counts, the hung
# test) or plain. Returns the command's exit code (124 on a timeout).
step() {
  local name="$1" kind="$2"
  shift 2
  local limit=${limit_of[$name]:-30} now left
  now=$(date +%s)
  left=$((deadline - now - 5 - 10))
  if [ "$left" -lt 1 ]; then
    add_row "$name" "SKIPPED (no time left before the deadline)" 0
    return 125
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local log="$scratch/$name.log"
  say "== $name (limit ${limit} s): $*" | tee -a "$out/logs.txt"
  local t0=$SECONDS rc
  timeout -k 5 "$limit" stdbuf -oL -eL "$@" 2>&1 | stdbuf -oL tee "$log" >>"$out/logs.txt"
  rc=${PIPESTATUS[0]}
  local secs=$((SECONDS - t0)) status counts=""
  [ "$kind" = gtest ] && counts="$(gtest_counts "$log")"
  case "$rc" in
    0) status=PASS ;;
    124 | 137)
      status="TIMEOUT after ${limit} s"
      if [ "$kind" = gtest ]; then
        local hung
        hung="$(last_running_test "$log")"
        [ -n "$hung" ] && status+=" in $hung"
      fi ;;
    3) status="${skip_on_3:+SKIPPED ($skip_on_3)}"; status="${status:-FAIL (rc 3)}" ;;
    *) status="FAIL (rc $rc)" ;;
  esac
  if [ "$rc" = 0 ] && [ "$kind" = gtest ] && [ -n "$counts" ] && [ "${counts##*/}" != 0 ]; then
    status="PASS (${counts##*/} skipped: see logs.txt)"
  fi
  say "-- $name: $status in ${secs} s ${counts:+(gtest $counts)}" | tee -a "$out/logs.txt"
  add_row "$name" "$status" "$secs" "$counts"
  return "$rc"
}

# Headline figures from the JSON written so far (python3 is the GPU image's; 20 s at most).
headlines() {
  timeout -k 2 20 python3 - "$out" <<'PY' 2>&1 || say "(headline figures unavailable)"
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except Exception:
        return None
b = load("bench.json")
if b:
    print("MoE (k3 bench moe --backend cuda):   M   median ms   % copy BW   vs cuBLAS BF16")
    for r in b.get("records", []):
        if "error" in r:
            print(f"  {r.get('recipe', '?'):6s} {r.get('m', '?'):>6}   FAILED: {r['error'][:80]}")
            continue
        base = r.get("cublas_bf16_median_s")
        vs = f"{base / r['timing']['median_s']:.2f}x" if base else "n/a (" + r.get("cublas_unavailable", "?")[:60] + ")"
        print(f"  {r['recipe']:6s} {r['m']:>6}   {r['timing']['median_s'] * 1e3:9.3f}   {100 * r['fraction_of_copy_bandwidth']:8.1f} %   {vs}")
k = load("bench_kda.json")
f = load("fla_kda.json") or {}
speed = f.get("steps", {}).get("speed", {})
if k:
    print("KDA (k3 bench kda --backend cuda, fla from fla_kda.json):")
    for r in k.get("records", []):
        if r.get("kind") == "prefill":
            ch = r.get("chunked", {})
            rec = r.get("recurrent", {})
            fl = speed.get("chunk_kda", {})
            fla = f"   fla chunk_kda T={fl['T']}: {fl['median_s'] * 1e3:.3f} ms" if fl and fl.get("T") == r["T"] else ""
            ms = lambda d: f"{d['median_s'] * 1e3:.3f} ms" if "median_s" in d else "n/a"
            print(f"  prefill T={r['T']} H={r['H']}: chunked {ms(ch)}, recurrent {ms(rec)}{fla}")
        elif r.get("kind") == "decode":
            if "error" in r:
                print(f"  decode N={r['N']} {r['state_dtype']}: FAILED {r['error'][:80]}")
                continue
            fl = speed.get("fused_recurrent_kda_decode", {})
            fla = (f"   fla fused_recurrent N={fl['N']}: {fl['median_s'] * 1e3:.3f} ms"
                   if fl and fl.get("N") == r["N"] and r["state_dtype"] == "fp32" else "")
            print(f"  decode N={r['N']} {r['state_dtype']}: {r['timing']['median_s'] * 1e3:.3f} ms, "
                  f"{100 * r['fraction_of_copy_bw']:.1f} % of copy BW{fla}")
s = f.get("steps", {}).get("same_inputs", {})
if s:
    print("KDA error vs FP32 reference: k3 o", s.get("k3_o_err_ratio_vs_fp32_ref", "n/a"),
          " fla o", s.get("fla_o_err_ratio_vs_fp32_ref", "n/a"), (" fla: " + f["error"]) if "error" in f else "")
PY
}

finished=0
finish() {
  [ -n "$out" ] && [ "$finished" = 0 ] || return 0
  finished=1
  local figures
  figures="$(headlines)"
  summary+=$'\n'"$figures"$'\n'
  write_summary
  say
  cat "$out/summary.txt"
  rm -rf "$scratch"
}

run_checks() {
  out="${OUT:-$bdir/out}"
  mkdir -p "$out" || { say "device-check: cannot create \$OUT = $out"; exit 1; }
  rm -f "$out"/summary.txt "$out"/logs.txt "$out"/*.json
  scratch="$(mktemp -d "${TMPDIR:-/tmp}/k3-device-check.XXXXXX")"
  : >"$out/logs.txt"
  local budget="${K3_CHECK_BUDGET_S:-540}"
  if ! [[ "$budget" =~ ^[0-9]+$ ]] || [ "$budget" -lt 120 ]; then
    say "device-check: K3_CHECK_BUDGET_S = '$budget' must be a whole number of seconds >= 120 (ten steps and the summary)" |
      tee "$out/summary.txt"
    exit 2
  fi
  deadline=$(($(date +%s) + budget))
  plan_steps "$budget"
  head_lines="budget ${budget} s; limits: $(for n in "${plan_names[@]}"; do printf '%s %s, ' "$n" "${limit_of[$n]}"; done)"$'\n'
  write_summary
  trap 'finish' EXIT
  trap 'say "device-check: interrupted" >>"$out/logs.txt"; exit 130' INT TERM

  # Checks before spending: only the carried folder, its binaries runnable, their libraries found.
  local carry="$bdir/carry"
  local k3="$carry/k3" tests="$carry/tests/k3_cuda_tests"
  local bin
  for bin in "$k3" "$tests"; do
    [ -f "$bin" ] || abort_run "missing carried binary $bin (build with 'scripts/device-check.sh build'; carry build-device/carry)"
    chmod +x "$bin" 2>/dev/null
    [ -x "$bin" ] || abort_run "carried binary $bin is not executable"
  done
  [ -f "$carry/MANIFEST.txt" ] && head_lines+="build: $(head -1 "$carry/MANIFEST.txt")"$'\n'
  # Libraries: the carried ones, then torch's NVIDIA wheels (cuBLAS, NCCL) when the image has them.
  local libpath="$carry/lib" d
  for d in $(timeout -k 2 15 python3 -c 'import nvidia, os; [print(os.path.join(p, n, "lib")) for p in nvidia.__path__ for n in sorted(os.listdir(p)) if os.path.isdir(os.path.join(p, n, "lib"))]' 2>/dev/null); do
    libpath+=":$d"
  done
  export LD_LIBRARY_PATH="$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if [ -z "${K3_NCCL_LIBRARY:-}" ]; then
    local nccl
    nccl="$(tr ':' '\n' <<<"$libpath" | while read -r d; do [ -f "$d/libnccl.so.2" ] && echo "$d/libnccl.so.2" && break; done)"
    [ -n "$nccl" ] && export K3_NCCL_LIBRARY="$nccl"
  fi
  local missing
  missing="$(ldd "$k3" "$tests" 2>&1 | grep 'not found' | sort -u | tr -s ' \t' ' ' | tr '\n' ';')"
  [ -z "$missing" ] || abort_run "shared libraries not found:${missing}"

  # The device, driver and CUDA version.
  step probe_smi plain nvidia-smi -L || abort_run "nvidia-smi failed: no GPU or no driver (see logs.txt)"
  local gpu driver cudav
  gpu="$(timeout -k 2 10 nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)"
  driver="$(timeout -k 2 10 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)"
  cudav="$(timeout -k 2 10 nvidia-smi 2>/dev/null | grep -oE 'CUDA Version: [0-9.]+' | head -1)"
  head_lines+="device: ${gpu:-?}; driver ${driver:-?}; ${cudav:-CUDA version ?}"$'\n'
  step probe_info plain "$k3" info --json || abort_run "k3 info failed (see logs.txt)"
  grep -q '"runnable": true' "$scratch/probe_info.log" ||
    abort_run "k3 info lists no runnable CUDA device: $(grep -o '"devices_note": "[^"]*"' "$scratch/probe_info.log" | head -1)"
  write_summary

  # Correctness first, then k3's own performance, then the peers.
  local moe_filter='*CudaMoe*:*Sm120*:*Splitk*:*SplitK*' rc=0
  step moe_tests gtest "$tests" --gtest_filter="$moe_filter" || rc=1
  step cuda_tests gtest "$tests" --gtest_filter="-NcclDevice.*:CudaEpDevice.DispatchExperts*:$moe_filter" || rc=1
  step nccl gtest "$tests" --gtest_filter='NcclDevice.*:CudaEpDevice.DispatchExperts*' || rc=1
  step validate_moe plain "$k3" validate --op moe --suite all --backend cuda --output "$out/validate.json" || rc=1
  step validate_kda plain "$k3" validate --op kda --backend cuda --output "$out/validate_kda.json" || rc=1
  step bench_moe plain "$k3" bench moe --backend cuda --m 1,8,128,2048,8192 --recipe both --routing ep_mixed \
    --output "$out/bench.json" || rc=1
  step bench_kda plain "$k3" bench kda --backend cuda --prefill-t 1024 8192 --decode-n 1 64 --iters 3 \
    --output "$out/bench_kda.json" || rc=1
  # fla last: unpack the carried wheel; its first call compiles Triton kernels (quick cases only).
  local fla_dir="$scratch/fla_pkg" w have_wheel=0
  mkdir -p "$fla_dir"
  for w in "$carry"/wheels/*.whl; do
    [ -f "$w" ] && python3 -m zipfile -e "$w" "$fla_dir" && have_wheel=1
  done
  # Exit 3: k3 passed but fla is not importable; the row says so instead of FAIL.
  skip_on_3="fla not importable$([ "$have_wheel" = 0 ] && echo ': no wheel carried'); k3's error saved"
  step fla plain env PYTHONUNBUFFERED=1 PYTHONPATH="$fla_dir${PYTHONPATH:+:$PYTHONPATH}" \
    python3 "$root/scripts/fla_kda_compare.py" --k3 "$k3" --out "$scratch" --json "$out/fla_kda.json" --quick
  local fla_rc=$?
  skip_on_3=""
  [ "$fla_rc" = 0 ] || [ "$fla_rc" = 3 ] || rc=1
  return $rc
}

# ---------------------------------------------------------------------------------------- dry-run
# Stand-ins for the GPU machine: a fake nvidia-smi on PATH, and a carry folder whose k3 /
# k3_cuda_tests are scripts that behave like the real ones in each rehearsed case.
dry_fail=0
dry_check() {  # CASE FILE PATTERN: the summary of CASE must contain PATTERN
  if grep -qE -- "$3" "$2"; then
    say "dry-run $1: OK   ($(grep -E -- "$3" "$2" | head -1 | tr -s ' '))"
  else
    say "dry-run $1: WRONG: the summary lacks /$3/:"
    sed 's/^/    /' "$2"
    dry_fail=1
  fi
}

# $OUT must come back whole: at most 8 files, 16 MiB each, 2 folders down, names in [A-Za-z0-9._-].
dry_check_out() {
  local o="$2" n big deep bad
  n=$(find "$o" -type f | wc -l)
  big=$(find "$o" -type f -size +16M | wc -l)
  deep=$(find "$o" -mindepth 4 | wc -l)
  bad=$(find "$o" -mindepth 1 | sed "s|^$o/||" | grep -c '[^A-Za-z0-9._/-]')
  if [ "$n" -le 8 ] && [ "$big" = 0 ] && [ "$deep" = 0 ] && [ "$bad" = 0 ] && [ -f "$o/summary.txt" ]; then
    say "dry-run $1: OK   (\$OUT: $n files: $(cd "$o" && ls | tr '\n' ' '))"
  else
    say "dry-run $1: WRONG: \$OUT has $n files, $big over 16 MiB, $deep too deep, $bad badly named, summary $([ -f "$o/summary.txt" ] && echo present || echo missing)"
    dry_fail=1
  fi
}

make_standins() {  # DIR: fake nvidia-smi, k3 and k3_cuda_tests (behaviour from $DRY_CASE)
  local d="$1"
  mkdir -p "$d/bin" "$d/build/carry/tests" "$d/build/carry/lib" "$d/build/carry/wheels"
  cat >"$d/bin/nvidia-smi" <<'SH'
#!/usr/bin/env bash
case "$*" in
  -L) echo "GPU 0: NVIDIA H200 (UUID: GPU-dry-run)" ;;
  *name,memory.total*) echo "NVIDIA H200, 143771 MiB" ;;
  *driver_version*) echo "580.159.04" ;;
  *) echo "| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 13.0 |" ;;
esac
SH
  cat >"$d/build/carry/k3" <<'SH'
#!/usr/bin/env bash
out=""; prev=""
for a in "$@"; do [ "$prev" = --output ] && out="$a"; prev="$a"; done
case "$1 $2" in
  "info --json") echo '{"cuda": {"devices": [{"name": "NVIDIA H200", "runnable": true}]}}' ;;
  "validate --op") echo "moe smoke ... PASS"; echo '{"records": []}' >"$out" ;;
  "bench moe")
    echo "measuring the device copy bandwidth ..."
    echo '{"copy_bandwidth_Bps": 4.3e12, "records": [{"recipe": "w4a8", "m": 1, "timing": {"median_s": 0.0004}, "fraction_of_copy_bandwidth": 0.71, "cublas_bf16_median_s": null, "cublas_unavailable": "cuBLAS (for the BF16 baseline) could not be opened; tried libcublas.so.13"}]}' >"$out"
    echo "w4a8 1 decode ... n/a (cuBLAS baseline unavailable)" ;;
  "bench kda")
    echo '{"records": [{"kind": "decode", "N": 1, "state_dtype": "fp32", "H": 96, "timing": {"median_s": 0.00005}, "fraction_of_copy_bw": 0.5}]}' >"$out" ;;
  "kda run") exit 1 ;;
  *) echo "k3 stand-in: $*" ;;
esac
SH
  cat >"$d/build/carry/tests/k3_cuda_tests" <<'SH'
#!/usr/bin/env bash
echo "[==========] Running 3 tests from 1 test suite."
echo "[ RUN      ] CudaMoe.DecodeMatchesOracle"
echo "[       OK ] CudaMoe.DecodeMatchesOracle (5 ms)"
if [ "${DRY_CASE:-}" = hang ] && [[ "$*" == *CudaMoe* ]] && [[ "$*" != *-NcclDevice* ]]; then
  echo "[ RUN      ] CudaMoe.PrefillSm90HangsForever"
  trap '' TERM   # survives SIGTERM: only timeout's SIGKILL ends it
  while :; do sleep 1; done
fi
echo "[ RUN      ] CudaMoe.Skipped"
echo "[  SKIPPED ] CudaMoe.Skipped (0 ms)"
echo "[==========] 3 tests from 1 test suite ran. (6 ms total)"
echo "[  PASSED  ] 2 tests."
echo "[  SKIPPED ] 1 test, listed below:"
SH
  chmod +x "$d/bin/nvidia-smi" "$d/build/carry/k3" "$d/build/carry/tests/k3_cuda_tests"
  echo "k3 device-check carry (dry-run stand-ins)" >"$d/build/carry/MANIFEST.txt"
}

dry_run() {
  local self="$root/scripts/device-check.sh" base o
  base="$(mktemp -d "${TMPDIR:-/tmp}/k3-dry-run.XXXXXX")"
  say "device-check dry-run in $base"

  # 1. A build failure: no CUTLASS headers (or, where nvcc is absent, no CUDA compiler) stops the
  # build after configure, before the long compile; the stale outputs of an earlier build
  # (a carry folder, a k3 binary) are gone, so nothing old can be carried.
  o="$base/build_fail"
  mkdir -p "$o/build/carry" "$o/build/tests"
  echo stale >"$o/build/carry/k3"
  echo stale >"$o/build/k3"
  K3_SKIP_SETUP=1 K3_DEVICE_BUILD_DIR="$o/build" K3_DEVICE_CMAKE_ARGS="-DK3_CUTLASS_INCLUDE_DIR=$o/no-cutlass" \
    timeout -k 5 300 bash "$self" build >"$o/build.txt" 2>&1
  local brc=$?
  if [ "$brc" != 0 ] && grep -qE "device-check build: FAILED: (CUTLASS headers missing|cmake configure)" "$o/build.txt" &&
    [ ! -e "$o/build/carry" ] && [ ! -e "$o/build/k3" ]; then
    say "dry-run build-failure: OK   (exit $brc: $(grep -m1 'device-check build: FAILED' "$o/build.txt" | cut -c1-110))"
  else
    say "dry-run build-failure: WRONG (exit $brc):"
    tail -5 "$o/build.txt" | sed 's/^/    /'
    dry_fail=1
  fi

  # 2-5: the run with stand-ins.
  local case
  for case in missing-binary missing-library hang no-baseline; do
    o="$base/$case"
    mkdir -p "$o/out"
    make_standins "$o"
    case "$case" in
      missing-binary) rm -f "$o/build/carry/tests/k3_cuda_tests" ;;
      missing-library)  # a real ELF whose library is gone
        printf 'int k3_dry(void);\nint main(void) { return k3_dry(); }\n' >"$o/main.c"
        printf 'int k3_dry(void) { return 0; }\n' >"$o/lib.c"
        cc -shared -fPIC -o "$o/libk3dry.so" "$o/lib.c" && cc -o "$o/build/carry/k3" "$o/main.c" -L"$o" -lk3dry &&
          rm -f "$o/libk3dry.so" || say "dry-run missing-library: cannot compile the stand-in (no C compiler?)" ;;
    esac
    PATH="$o/bin:$PATH" DRY_CASE="$case" OUT="$o/out" K3_DEVICE_BUILD_DIR="$o/build" K3_CHECK_BUDGET_S=120 \
      timeout -k 5 180 bash "$self" run >"$o/run.txt" 2>&1
    local rrc=$?
    case "$case" in
      missing-binary) dry_check "$case" "$o/out/summary.txt" "ABORTED .*missing carried binary .*k3_cuda_tests" ;;
      missing-library) dry_check "$case" "$o/out/summary.txt" "ABORTED .*shared libraries not found: *libk3dry.so => not found" ;;
      hang)
        dry_check "$case" "$o/out/summary.txt" "moe_tests +[0-9]+ +- +TIMEOUT after [0-9]+ s in CudaMoe.PrefillSm90HangsForever"
        dry_check "$case-then-the-rest" "$o/out/summary.txt" "cuda_tests +[0-9]+ +2/0/1 +PASS \(1 skipped"
        dry_check "$case-device-line" "$o/out/summary.txt" "device: NVIDIA H200, 143771 MiB; driver 580.159.04; CUDA Version: 13.0" ;;
      no-baseline)
        dry_check "$case" "$o/out/summary.txt" "w4a8 +1 +0.400 +71.0 % +n/a \(cuBLAS \(for the BF16 baseline\) could not be opened"
        dry_check "$case-bench-step" "$o/out/summary.txt" "bench_moe +[0-9]+ +- +PASS"
        dry_check "$case-fla-last" "$o/out/summary.txt" "^fla +[0-9]+ +- +FAIL \(rc 1\)" ;;
    esac
    [ "$rrc" != 124 ] || { say "dry-run $case: WRONG: the run itself hung (killed after 180 s)"; dry_fail=1; }
    dry_check_out "$case-out" "$o/out"
  done
  # The budget adds up: the limits plus grace never exceed the budget (default and a small one).
  local b
  for b in 540 200 120; do
    plan_steps "$b"
    local total=0 n
    for n in "${plan_names[@]}"; do total=$((total + limit_of[$n] + 5)); done
    if [ "$total" -le $((b - 10)) ]; then
      say "dry-run budget-$b: OK   (limits + grace = $total s <= $((b - 10)) s)"
    else
      say "dry-run budget-$b: WRONG: limits + grace = $total s > $((b - 10)) s"
      dry_fail=1
    fi
  done
  if [ "$dry_fail" = 0 ]; then
    say "device-check dry-run: every case gave its expected summary"
    rm -rf "$base"
    return 0
  fi
  say "device-check dry-run: FAILED (files kept in $base)"
  return 1
}

case "$mode" in
  build) build ;;
  run) run_checks ;;
  dry-run) dry_run ;;
  *) say "usage: $0 build | run | dry-run" >&2; exit 2 ;;
esac
