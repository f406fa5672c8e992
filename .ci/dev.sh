#!/usr/bin/env bash
# Set up a fresh machine and run tba's main job or its tests (the README's two commands).
#   bash .ci/dev.sh main [rok_curve.py args...]   # ROK benchmark: PNG + CSV + JSON under out/rok
#   bash .ci/dev.sh test [pytest args...]         # the everyday tests: every test not marked slow
#   bash .ci/dev.sh test-slow [pytest args...]    # the tests marked slow (CI runs both: .ci/run)
#   bash .ci/dev.sh types                         # the type checker (mypy; config in pyproject.toml)
#   bash .ci/dev.sh load [pytest args...]         # the tests marked timing, under injected CPU load
# Set-up is idempotent: a virtual environment in .venv with torch 2.13.0 (never upgraded),
# tba installed editable with the extras the command needs (main: bench; test, test-slow and
# types: test, bench, release, typecheck and the optional packages the tests use).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-}
shift || true
case "$what" in main|test|test-slow|types|load) ;; *) echo "usage: bash .ci/dev.sh main|test|test-slow|types|load [args...]" >&2; exit 2 ;; esac

# Note [Byte code is written]: Python may write the byte code of what it imports (a shell with
# PYTHONDONTWRITEBYTECODE=1 forbids it). torch is installed without byte code (--no-compile
# below), so with it forbidden every Python process compiles torch's modules again: ~2.5 s of
# CPU per process that imports torch, and the tests start well over a hundred (workers,
# benchmark smoke runs, CLI checks). Written once, the byte code lands in .venv and in
# __pycache__ folders that git ignores.
unset PYTHONDONTWRITEBYTECODE
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# --no-compile: byte-compiling all of torch and transformers at install takes longer than
# compiling, at first import, the modules a run imports.
if ! python -c "import torch" 2>/dev/null; then
  pip install -q --no-compile torch==2.13.0
fi
# Pin whatever torch is installed so no dependency can upgrade it.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
# From the installed package's metadata: importing torch here, before numpy is installed,
# printed torch's "Failed to initialize NumPy" warning in every fresh set-up.
python -c "from importlib.metadata import version; print('torch==' + version('torch').split('+')[0])" >"$constraints"
if [ "$what" = main ]; then
  pip install -q --no-compile -c "$constraints" -e ".[bench]"
  rm -f "$constraints"  # exec skips the EXIT trap
  exec python benchmarks/rok_curve.py "$@"
fi
# types and the tests (test, test-slow, load) share one environment: mypy checks tba against the
# packages the tests use.
bash .ci/install_optional.sh "$constraints" -e ".[test,bench,release,typecheck]"
rm -f "$constraints"
if [ "$what" = types ]; then
  exec python -m mypy "$@"  # files and strictness: [tool.mypy] in pyproject.toml
fi
if [ "$what" = load ]; then
  # Busy processes on every core (tests/load.py) while the tests that wait on tba's workers run:
  # a test that passes only when the workers keep up fails here (docs/testing.md).
  # Only the files that hold such tests are collected (collecting the whole suite imports
  # every optional package, which on a busy machine costs more than the tests).
  mapfile -t files < <(grep -rlE --include='*.py' '^@pytest\.mark\.timing' tests | sort)
  exec python -m pytest -q -p no:cacheprovider -p tests.load -m timing "${files[@]}" "$@"
fi
# The everyday suite leaves out the tests marked slow (interrupt sweeps at every line, the wheel,
# the type checker's strictness, ...); test-slow runs exactly those, so the two run every test
# once. A -m of the caller's own comes later on the command line and wins.
if [ "$what" = test-slow ]; then
  exec python -m pytest -q -p no:cacheprovider -m slow "$@"
fi
exec python -m pytest -q -p no:cacheprovider -m "not slow" "$@"
