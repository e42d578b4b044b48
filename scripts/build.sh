#!/usr/bin/env bash
# Configures and builds k3. Usage: scripts/build.sh [BUILD_DIR] [extra cmake args...]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$root/build}"
shift || true
jobs="$(nproc 2>/dev/null || echo 2)"
log="$(mktemp)"
if ! cmake -S "$root" -B "$dir" -DCMAKE_BUILD_TYPE=Release "$@" >"$log" 2>&1; then
  cat "$log"
  echo "k3 build: cmake configure failed (see above)" >&2
  exit 1
fi
grep -E '^-- k3' "$log" || true
rm -f "$log"
cmake --build "$dir" -j "$jobs"
