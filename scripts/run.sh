#!/usr/bin/env bash
# k3's main job on this machine: install dependencies, build, show the machine and build facts,
# then validate the kernels against their oracles.
# Usage: scripts/run.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh" "$root/build" >/dev/null
k3="$root/build/k3"
echo "== k3 info"
"$k3" info
echo
echo "== k3 validate --op all"
"$k3" validate --op all --output "$root/build/validate.json"
echo "(records written to build/validate.json)"
