#!/usr/bin/env bash
# GPU suite: one command, one verdict. Installs tba from local wheels (no network), then runs
# and judges, in this order so that a timeout costs numbers, not the verdict:
#   environment  versions, GPU, BAR1, PCIe link, allocator settings, kvikio mode, filesystem of
#                TBA_SSD_DIR (tmpfs/overlay refused for SSD checks), O_DIRECT probe
#   correctness  the GPU tests (bit-exact twins, offloaders, hook): pytest -m gpu, TBA_REQUIRE_GPU=1
#   memory       reserved / active / allocated peaks host (forced, adaptive=False) vs keep, flat
#                over 20 steps, allocation retries, pinned bytes vs peak held, bytes moved (0 fails)
#                (benchmarks/_verdict_memory.py)
#   malloc hook  registered, no failures, no registrations per step after warm-up, shortfall
#                vs memory_reserved (benchmarks/_verdict_hook.py under LD_PRELOAD)
#   performance  keep vs host vs ssd forced step time (an offload row that moved 0 bytes fails),
#                hook on/off step time, host stores vs raw copy
#                engine, SSD engines vs raw drive, adaptive vs keep, hook overhead per tensor
# It runs end to end without a GPU too: GPU rows SKIP with the reason (tests/benchmarks).
# The allocator's activation peaks of every strategy (forced, default and budget policies,
# compiled) are benchmarks/gpu_truth.sh's, a separate one-run command (docs/gpu.md).
#
# Usage (on the GPU machine, from a copy of the repository, wheels beside this script):
#
#     bash benchmarks/gpu_suite.sh RESULTS_DIR [WHEEL_DIR]
#
#   RESULTS_DIR  created if missing; gets verdict.json and summary.txt (PASS/FAIL/SKIP rows with
#                numbers; the exit status is non-zero if any row FAILs), rows.jsonl, stages.jsonl,
#                env.txt, pytest-gpu.xml, memory.json, hook_on.json, hook_off.json,
#                io_bandwidth.json, overhead/, adaptive_offload.json, hook_overhead.json, *.log.
#   WHEEL_DIR    wheels to install from (pip --no-index --find-links). Default: $TBA_WHEEL_DIR,
#                else benchmarks/wheels/, else <repo>/.whl/, else the directory of this script.
#                Expected there: a tba-*.whl (else tba is built from this checkout, which needs
#                scikit-build-core and cmake installed), wheels for whatever of transformers,
#                pytest, matplotlib the machine lacks, and for GPUDirect Storage the
#                --no-deps set kvikio-cu13, libkvikio-cu13, rapids-logger, cuda-pathfinder
#                (+ nvidia-cufile if missing). torch is never installed or upgraded.
#
# Environment: PYTHON (default python3), TBA_SSD_DIR (drive for the SSD offloader and the I/O
# benchmark; default the temp dir), SUITE_BUDGET_S (default 570), SUITE_SKIP_INSTALL=1 (use
# PYTHON as it is), SUITE_TINY=1 (tiny sizes: the suite's own CPU test).
#
# Stage time limits come out of one budget: each stage gets what its share allows and what is
# left, so the whole suite ends in time even when a stage hangs.

set -uo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,40p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
RESULTS="$(mkdir -p "$1" && cd "$1" && pwd)"
# shellcheck source=benchmarks/_suite_install.sh
source "$SCRIPT_DIR/_suite_install.sh"
WHEELS="$(wheel_dir "${2:-}")"
PYTHON="${PYTHON:-python3}"
BUDGET_S="${SUITE_BUDGET_S:-570}"
TINY="${SUITE_TINY:-0}"
START_S=$SECONDS
STAGES="$RESULTS/stages.jsonl"
: >"$STAGES"
: >"$RESULTS/rows.jsonl"
rm -f "$RESULTS/ssd_refused.txt" "$RESULTS/verdict.json" "$RESULTS/summary.txt"

log() { echo "[gpu_suite $((SECONDS - START_S))s] $*" | tee -a "$RESULTS/suite.log" >&2; }

# limit SHARE_S: seconds a stage may take, at most what is left of the budget (min 10). A tiny
# run is the suite's own CPU test, on a CI machine that may be busy with other work: its stages
# get 4x their share (the budget still bounds the suite).
limit() {
    local left=$((BUDGET_S - (SECONDS - START_S)))
    local want=$1
    ((TINY)) && want=$((want * 4))
    ((want > left)) && want=$left
    ((want < 10)) && want=10
    echo "$want"
}

record() { printf '{"name": "%s", "status": "%s", "seconds": %d}\n' "$1" "$2" "$3" >>"$STAGES"; }

# stage NAME SECONDS CMD...: run with a hard time limit, log output, record its outcome.
stage() {
    local name=$1 secs=$2
    shift 2
    local t0=$SECONDS rc
    log "stage $name (limit ${secs}s): $*"
    timeout --kill-after=15 "$secs" "$@" >"$RESULTS/$name.log" 2>&1
    rc=$?
    local status=ok
    if ((rc == 124 || rc == 137)); then status="timeout after ${secs}s"; elif ((rc != 0)); then status="failed rc=$rc"; fi
    record "$name" "$status" $((SECONDS - t0))
    log "stage $name: $status ($((SECONDS - t0))s); tail of $name.log:"
    tail -n 5 "$RESULTS/$name.log" | sed 's/^/    /' >&2
    return 0
}

# skip NAME REASON: record a stage that is not run, and why (its rows SKIP with the reason).
skip() {
    record "$1" "skipped: $2" 0
    log "stage $1 skipped: $2"
}

# verdict SECTION: turn what the stages wrote into rows (benchmarks/_verdict.py).
verdict() {
    timeout 120 "$PY" "$SCRIPT_DIR/_verdict.py" "$RESULTS" "$1" >>"$RESULTS/verdict.log" 2>&1 ||
        log "verdict $1 failed (rc $?): see verdict.log"
}

# ---- install ---------------------------------------------------------------------------
VENV="$RESULTS/venv"
log "results in $RESULTS; wheels from ${WHEELS:-<none>}; python $PYTHON; budget ${BUDGET_S}s; tiny=$TINY"
if [[ "${SUITE_SKIP_INSTALL:-0}" == 1 ]]; then
    skip install "SUITE_SKIP_INSTALL=1"
else
    export -f install
    export WHEELS PYTHON VENV REPO SCRIPT_DIR
    stage install "$(limit 120)" bash -c install
fi
PY="$VENV/bin/python"
[[ -x "$PY" ]] || PY="$PYTHON"

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
    nvidia-smi 2>&1 || echo "nvidia-smi unavailable"
    "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
    "$PY" -m pip list --disable-pip-version-check 2>/dev/null
    df -h "${TBA_SSD_DIR:-${TMPDIR:-/tmp}}" 2>&1
} >"$RESULTS/env.txt"

export CUFILE_LOGFILE_PATH="$RESULTS/cufile.log"
cd "$REPO" || exit 1
HAS_CUDA=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
NO_GPU="no CUDA device (torch.cuda.is_available() is False)"

# ---- environment -----------------------------------------------------------------------
verdict env
SSD_REFUSED=""
[[ -f "$RESULTS/ssd_refused.txt" ]] && SSD_REFUSED="$(cat "$RESULTS/ssd_refused.txt")"

# ---- correctness: the GPU tests --------------------------------------------------------
if ((HAS_CUDA)); then
    stage pytest-gpu "$(limit 180)" env TBA_REQUIRE_GPU=1 "$PY" -m pytest -m gpu -q -p no:cacheprovider \
        --junitxml="$RESULTS/pytest-gpu.xml"
else
    skip pytest-gpu "$NO_GPU"
fi
verdict correctness

# ---- memory ----------------------------------------------------------------------------
if ((HAS_CUDA)); then
    if ((TINY)); then mem_args=(--steps 6 --warmup 2 --width 256 --batch 256 --copy-mib 16); else mem_args=(); fi
    stage memory "$(limit 90)" "$PY" benchmarks/_verdict_memory.py "${mem_args[@]}" --out "$RESULTS/memory.json"
else
    skip memory "$NO_GPU"
fi
verdict memory

# ---- malloc hook -----------------------------------------------------------------------
if ((HAS_CUDA)); then
    if ((TINY)); then hook_args=(--steps 6 --warmup 2 --width 256 --batch 256); else hook_args=(); fi
    # `--env` gives LD_PRELOAD and, with the nvidia-cufile wheel, TBA_HOOK_CUFILE_LIBRARY.
    if hook_env=$("$PY" -m tba.malloc_hook --env 2>"$RESULTS/hook_env.log"); then
        # shellcheck disable=SC2086 # hook_env is a list of NAME=VALUE words
        stage hook_on "$(limit 60)" env $hook_env "$PY" benchmarks/_verdict_hook.py "${hook_args[@]}" \
            --out "$RESULTS/hook_on.json"
    else
        record hook_on "failed: $(tail -n 1 "$RESULTS/hook_env.log")" 0
    fi
    stage hook_off "$(limit 60)" "$PY" benchmarks/_verdict_hook.py "${hook_args[@]}" --out "$RESULTS/hook_off.json"
else
    skip hook_on "$NO_GPU"
    skip hook_off "$NO_GPU"
fi
verdict hook

# ---- performance -----------------------------------------------------------------------
if ((HAS_CUDA)) && ((!TINY)); then
    ovh_s=$(limit 120)
    ssd_strategy=",offload-ssd"
    [[ -n "$SSD_REFUSED" ]] && ssd_strategy=""
    stage overhead "$ovh_s" "$PY" benchmarks/rok_curve.py --device cuda --batch-sizes 8 \
        --strategies "keep,offload-host$ssd_strategy" --repeats 2 --warmup 3 --steps 8 \
        --out "$RESULTS/overhead" \
        --time-budget-s $((ovh_s > 70 ? ovh_s - 40 : 30)) --timeout-s 60
elif ((HAS_CUDA)); then
    skip overhead "SUITE_TINY=1"
else
    skip overhead "$NO_GPU"
fi

device=cpu
((HAS_CUDA)) && device=cuda
if [[ -n "$SSD_REFUSED" ]]; then
    skip io_bandwidth "$SSD_REFUSED"
elif ((TINY)); then
    stage io_bandwidth "$(limit 60)" "$PY" benchmarks/io_bandwidth.py --size-mib 8 --runs 2 --engines posix \
        --device "$device" --out "$RESULTS/io_bandwidth.json"
else
    stage io_bandwidth "$(limit 75)" "$PY" benchmarks/io_bandwidth.py --size-mib 256 --runs 5 \
        --device "$device" --out "$RESULTS/io_bandwidth.json"
fi

# Adaptive on/off vs keep on a GPT-style MLP stack where activations dominate (target: >= 40%
# lower activation peak than keep at <= 5% longer step with the host offloader).
if ((TINY)); then
    stage adaptive "$(limit 60)" "$PY" benchmarks/adaptive_offload.py --device "$device" --blocks 3 \
        --width 64 --batch 64 --write-mib-s 0 --steps 3 --warmup 1 --out "$RESULTS/adaptive_offload.json"
else
    stage adaptive "$(limit 90)" "$PY" benchmarks/adaptive_offload.py --device "$device" --blocks 8 \
        --width 2048 --batch 8192 --write-mib-s 0 --max-inflight-mib 4096 --steps 8 --warmup 3 \
        --out "$RESULTS/adaptive_offload.json"
fi

if ((TINY)); then
    stage hook_overhead "$(limit 45)" "$PY" benchmarks/hook_overhead.py --blocks 2 --ops 20 --rounds 2 --warmup 3 \
        --large-ops 1 --out "$RESULTS/hook_overhead.json"
else
    stage hook_overhead "$(limit 45)" "$PY" benchmarks/hook_overhead.py --out "$RESULTS/hook_overhead.json"
fi
verdict performance

# The full ROK sweep is a figure, not a verdict row: it runs only with budget to spare.
if ((HAS_CUDA)) && ((!TINY)) && ((BUDGET_S - (SECONDS - START_S) >= 150)); then
    rok_s=$(limit 220)
    stage rok_cuda "$rok_s" "$PY" benchmarks/rok_curve.py --device cuda --out "$RESULTS/rok_cuda" \
        --time-budget-s $((rok_s - 60)) --timeout-s 90
fi

# ---- verdict ---------------------------------------------------------------------------
log "done in $((SECONDS - START_S))s"
"$PY" "$SCRIPT_DIR/_verdict.py" "$RESULTS" finish >&2
exit $?
