#!/usr/bin/env bash
# Installs the k3 build tree BUILD into a fresh prefix and builds three outside consumers against
# it: CMake + k3::k3 (shared), CMake + k3::static, and pkg-config + g++ (shared). Each must run
# and match the FP64 oracle. Usage: tests/consumer/run.sh BUILD_DIR
set -euo pipefail
build="$(cd "$1" && pwd)"
src="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
test -x "$work/prefix/bin/k3"
"$work/prefix/bin/k3" --version
for variant in shared static; do
  static=OFF
  [ "$variant" = static ] && static=ON
  cmake -S "$src" -B "$work/$variant" -DCMAKE_PREFIX_PATH="$work/prefix" -DUSE_STATIC=$static \
    -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$work/$variant" >/dev/null
  echo "consumer ($variant, CMake):"
  LD_LIBRARY_PATH="$work/prefix/lib" "$work/$variant/consumer"
done
pcdir="$(dirname "$(find "$work/prefix" -name k3.pc | head -1)")"
# shellcheck disable=SC2046
g++ -O1 "$src/main.cpp" -o "$work/pc_consumer" $(PKG_CONFIG_PATH="$pcdir" pkg-config --cflags --libs k3)
echo "consumer (shared, pkg-config):"
LD_LIBRARY_PATH="$(PKG_CONFIG_PATH="$pcdir" pkg-config --variable=libdir k3)" "$work/pc_consumer"
