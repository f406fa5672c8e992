#!/usr/bin/env bash
# Set up a fresh machine and run tba's main job or its tests (the README's two commands).
#   bash .ci/dev.sh main [rok_curve.py args...]   # ROK benchmark: PNG + CSV + JSON under out/rok
#   bash .ci/dev.sh test [pytest args...]         # the test suite
#   bash .ci/dev.sh types                         # the type checker (mypy; config in pyproject.toml)
#   bash .ci/dev.sh load [pytest args...]         # the tests marked timing, under injected CPU load
# Set-up is idempotent: a virtual environment in .venv with torch 2.13.0 (never upgraded),
# tba installed editable with the extras the command needs (main: bench; test and types: test,
# bench, release, typecheck and the optional packages the tests use).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-}
shift || true
case "$what" in main|test|types|load) ;; *) echo "usage: bash .ci/dev.sh main|test|types|load [args...]" >&2; exit 2 ;; esac

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
python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" >"$constraints"
if [ "$what" = main ]; then
  pip install -q --no-compile -c "$constraints" -e ".[bench]"
  rm -f "$constraints"  # exec skips the EXIT trap
  exec python benchmarks/rok_curve.py "$@"
fi
# types, test and load share one environment: mypy checks tba against the packages the tests use.
pip install -q -c "$constraints" -e ".[test,bench,release,typecheck]"
bash .ci/install_optional.sh "$constraints"
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
exec python -m pytest -q -p no:cacheprovider "$@"
