#!/usr/bin/env bash
# Installs a CMake build of hattn into a temporary prefix, then builds and runs tests/consumer,
# a C++ project that finds it with find_package(hattn): the install rules and the package
# config work as a user's project would use them.
#
#   scripts/test_install.sh [BUILD_DIR]     (default: build; scripts/test.sh runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix/install" >/dev/null
cmake -S tests/consumer -B "$prefix/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$prefix/install" >"$prefix/configure.log" 2>&1 ||
  { cat "$prefix/configure.log"; exit 1; }
cmake --build "$prefix/consumer" >"$prefix/build.log" 2>&1 || { cat "$prefix/build.log"; exit 1; }
"$prefix/consumer/consumer" | tail -2
echo "test_install: find_package(hattn) from $(basename "$prefix")/install, built and ran tests/consumer"
