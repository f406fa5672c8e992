#!/usr/bin/env bash
# The GPU truth in one command (benchmarks/gpu_truth.py): installs tba from files in this
# checkout (no package index), then measures keep, recompute, tba host / ssd / host+ssd forced,
# tba defaults and budget mode on the main job's GPT-2 from the CUDA allocator, in at most
# TRUTH_WALL_S seconds (default 480) including the install.
#
# Usage (on the GPU machine, from a copy of the repository):
#
#     bash benchmarks/gpu_truth.sh OUT_DIR [WHEEL_DIR]
#
#   OUT_DIR    gets exactly two files: summary.md (environment, tables, verdict rows) and
#              gpu_truth.tar.gz (summary, results.json, progress and install logs, the caches'
#              summaries, CUDA memory snapshots of a keep and a forced-host step, their PNG),
#              under 15 MiB (the largest snapshot left out, and named, above that).
#   WHEEL_DIR  as benchmarks/gpu_suite.sh (default $TBA_WHEEL_DIR, benchmarks/wheels/,
#              <repo>/.whl/): a tba-*.whl (else tba is built from this checkout), the kvikio set
#              for GPUDirect Storage, wheels of transformers/matplotlib if the machine lacks them.
#              If the install fails, tba runs from this checkout (PYTHONPATH, no native hook).
#
# Environment: PYTHON (default python3), TBA_SSD_DIR (SSD offloader directory; default
# /var/tmp/tba_truth_ssd), TRUTH_WALL_S (default 480), TRUTH_ARGS (more gpu_truth.py options).
# Exit status: 0 when every verdict row passed, 1 when one failed, other values on errors.

set -uo pipefail
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
# shellcheck source=benchmarks/_suite_install.sh
source "$SCRIPT_DIR/_suite_install.sh"
WHEELS="$(wheel_dir "${2:-}")"
PYTHON="${PYTHON:-python3}"
WALL_S="${TRUTH_WALL_S:-480}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/tba_truth.XXXXXX")"
VENV="$WORK/venv"
LOG="$WORK/install.log"
export TBA_TRUTH_LAUNCHER="bash benchmarks/gpu_truth.sh $* (wheels ${WHEELS:-none})"
export TBA_SSD_DIR="${TBA_SSD_DIR:-/var/tmp/tba_truth_ssd}"
mkdir -p "$TBA_SSD_DIR" || export TBA_SSD_DIR="$WORK/ssd"
echo "[gpu_truth.sh] out $OUT; wheels ${WHEELS:-<none>}; python $PYTHON; wall ${WALL_S}s; ssd $TBA_SSD_DIR"

export -f install
export WHEELS PYTHON VENV REPO SCRIPT_DIR
PY="$VENV/bin/python"
if timeout --kill-after=10 150 bash -c install >"$LOG" 2>&1; then
    echo "[gpu_truth.sh] installed in ${SECONDS}s: $(tail -n 1 "$LOG")"
else
    echo "[gpu_truth.sh] install failed (rc $?) after ${SECONDS}s, running tba from $REPO; tail of the log:"
    tail -n 5 "$LOG" | sed 's/^/    /'
    PY="$PYTHON"
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi

left=$((WALL_S - SECONDS - 10))
((left < 60)) && left=60
# The measurements get what is left less imports, the host-link probe and the archive; the
# script writes its archive on SIGTERM too (timeout's), with what it measured.
# shellcheck disable=SC2086 # TRUTH_ARGS is a list of options
timeout --kill-after=25 "$left" "$PY" "$SCRIPT_DIR/gpu_truth.py" "$OUT" --budget-s $((left - 60)) \
    --attach "$LOG" ${TRUTH_ARGS:-}
rc=$?
rm -rf "$WORK"
echo "[gpu_truth.sh] done in ${SECONDS}s (rc $rc): $OUT/summary.md, $OUT/gpu_truth.tar.gz"
exit $rc
