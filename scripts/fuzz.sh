#!/usr/bin/env bash
# Fuzz k3's parsers of untrusted files with libFuzzer (clang-14, ASan + UBSan):
#   scripts/fuzz.sh [SECONDS] [TARGET] [extra libFuzzer flags...]
#   SECONDS default 60; TARGET: safetensors (default: the safetensors header parser), model_config
#   (config.json) or kda_input (the `k3 kda run` input file: safetensors -> KDA tensors -> references)
# Builds build-fuzz/fuzz/fuzz_TARGET (K3_FUZZ_BUILD: another build folder), seeds it with
# tests/data/TARGET_corpus (read only), keeps the
# inputs it discovers in fuzz/corpus/TARGET (in the repository: commit it so the corpus grows from
# session to session; minimize with `build-fuzz/fuzz/fuzz_TARGET -merge=1 NEW_DIR fuzz/corpus/TARGET`);
# crashers land in build-fuzz/artifacts/.
# A crasher, once fixed, belongs in tests/data/TARGET_corpus (bad_* or valid_*), which the unit
# tests replay on every build (SafetensorsCorpus / ModelConfigCorpus / KdaInputCorpus.ReplaysEveryFile).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
target=${2:-safetensors}
[ $# -gt 0 ] && shift
[ $# -gt 0 ] && shift
case "$target" in
  safetensors) dict=(-dict=fuzz/safetensors.dict) ;;
  kda_input) dict=(-dict=fuzz/kda_input.dict) ;;
  model_config) dict=() ;;
  *) echo "scripts/fuzz.sh: unknown target '$target' (safetensors, model_config or kda_input)" >&2; exit 2 ;;
esac
build="${K3_FUZZ_BUILD:-build-fuzz}"
cmake -S . -B "$build" -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_C_COMPILER=clang-14 -DK3_FUZZ=ON -DK3_CUDA=OFF \
  -DK3_BUILD_TESTS=OFF -DK3_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" --target "fuzz_$target" -j "${K3_BUILD_JOBS:-2}"
mkdir -p "fuzz/corpus/$target" "$build/artifacts"
exec "./$build/fuzz/fuzz_$target" "fuzz/corpus/$target" "tests/data/${target}_corpus" "${dict[@]}" \
  -max_len=4096 -timeout=5 -rss_limit_mb=2048 -max_total_time="$secs" -artifact_prefix="$build/artifacts/" \
  -print_final_stats=1 "$@"
