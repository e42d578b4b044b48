#!/usr/bin/env bash
# Fetches the pinned CUTLASS headers from PyPI (nvidia-cutlass, NVIDIA's wheel, which carries the
# C++ headers under cutlass_library/source/include), checks the wheel's SHA-256 and unpacks the
# headers into <repo>/.cache/cutlass-<version>/include. Idempotent; called by scripts/setup.sh.
# Usage: scripts/fetch-cutlass.sh [DEST_ROOT]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
version=4.2.0.0
sha256=f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6
dest="${1:-$root/.cache}/cutlass-$version"
if [ -f "$dest/include/cutlass/version.h" ]; then
  echo "k3 setup: CUTLASS $version headers present in $dest/include"
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$root/scripts/pip-retry.sh" python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "nvidia-cutlass==$version"
wheel="$(ls "$tmp"/nvidia_cutlass-"$version"-*.whl)"
got="$(sha256sum "$wheel" | cut -d' ' -f1)"
if [ "$got" != "$sha256" ]; then
  echo "k3 setup: $wheel has SHA-256 $got, expected $sha256 (pinned nvidia-cutlass $version); refusing it" >&2
  exit 1
fi
mkdir -p "$tmp/x"
python3 - "$wheel" "$tmp/x" <<'PY'
import sys, zipfile
prefix = "cutlass_library/source/include/"
with zipfile.ZipFile(sys.argv[1]) as z:
    names = [n for n in z.namelist() if n.startswith(prefix) and not n.endswith("/")]
    if not names:
        sys.exit("k3 setup: the nvidia-cutlass wheel has no " + prefix)
    for n in names:
        z.extract(n, sys.argv[2])
PY
mkdir -p "$dest"
rm -rf "$dest/include"
mv "$tmp/x/cutlass_library/source/include" "$dest/include"
echo "k3 setup: CUTLASS $version headers unpacked into $dest/include"
