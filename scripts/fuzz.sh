#!/usr/bin/env bash
# Fuzz the safetensors header parser with libFuzzer (clang-14, ASan + UBSan).
#   scripts/fuzz.sh [SECONDS] [extra libFuzzer flags...]      (default 60 s)
# Builds build-fuzz/fuzz/fuzz_safetensors, seeds it with tests/data/safetensors_corpus (read only)
# and keeps the inputs it discovers in build-fuzz/corpus; crashers land in build-fuzz/artifacts/.
# A crasher, once fixed, belongs in tests/data/safetensors_corpus (bad_* or valid_*), where the
# unit test SafetensorsCorpus.ReplaysEveryFile replays it on every build.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
[ $# -gt 0 ] && shift
cmake -S . -B build-fuzz -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_C_COMPILER=clang-14 -DK3_FUZZ=ON -DK3_CUDA=OFF \
  -DK3_BUILD_TESTS=OFF -DK3_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-fuzz --target fuzz_safetensors -j2
mkdir -p build-fuzz/corpus build-fuzz/artifacts
exec ./build-fuzz/fuzz/fuzz_safetensors build-fuzz/corpus tests/data/safetensors_corpus \
  -dict=fuzz/safetensors.dict -max_len=4096 -timeout=5 -rss_limit_mb=2048 -max_total_time="$secs" \
  -artifact_prefix=build-fuzz/artifacts/ -print_final_stats=1 "$@"
