#!/usr/bin/env bash
# GPU suite: install tba from local wheels (no network), run the GPU tests and the GPU
# benchmarks, and collect everything in one results directory, within 10 minutes.
#
# Usage (on the GPU machine, from a copy of the repository, wheels beside this script):
#
#     bash benchmarks/gpu_suite.sh RESULTS_DIR [WHEEL_DIR]
#
#   RESULTS_DIR  created if missing; gets env.txt, pytest-gpu.log/.xml, io_bandwidth.json,
#                rok_cuda/ (rok_curve.{csv,json,png}), overhead/ (same, one batch),
#                adaptive_offload.json, hook_overhead.json, *.log,
#                and summary.txt (one line per stage: status, seconds).
#   WHEEL_DIR    wheels to install from (pip --no-index --find-links). Default: $TBA_WHEEL_DIR,
#                else benchmarks/wheels/, else <repo>/.whl/, else the directory of this script.
#                Expected there: a tba-*.whl (else tba is built from this checkout, which needs
#                scikit-build-core and cmake installed), wheels for whatever of transformers,
#                pytest, matplotlib the machine lacks, and for GPUDirect Storage the
#                --no-deps set kvikio-cu13, libkvikio-cu13, rapids-logger, cuda-pathfinder
#                (+ nvidia-cufile if missing). torch is never installed or upgraded.
#
# Environment: PYTHON (default python3; its torch must see the GPU), TBA_SSD_DIR (drive for
# the SSD offloader and the I/O benchmark; default the temp dir), SUITE_BUDGET_S (default 570).
#
# Stage time limits come out of one budget: each stage gets what its share allows and what is
# left, so the whole suite ends in time even when a stage hangs. Stages run even if an
# earlier one failed; the exit status is non-zero if any stage failed.

set -uo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
RESULTS="$(mkdir -p "$1" && cd "$1" && pwd)"
WHEELS="${2:-${TBA_WHEEL_DIR:-}}"
if [[ -z "$WHEELS" ]]; then
    for d in "$SCRIPT_DIR/wheels" "$REPO/.whl" "$SCRIPT_DIR"; do
        if compgen -G "$d/*.whl" >/dev/null; then WHEELS="$d"; break; fi
    done
fi
PYTHON="${PYTHON:-python3}"
BUDGET_S="${SUITE_BUDGET_S:-570}"
START_S=$SECONDS
SUMMARY="$RESULTS/summary.txt"
: >"$SUMMARY"
FAILED=0

log() { echo "[gpu_suite $((SECONDS - START_S))s] $*" | tee -a "$RESULTS/suite.log" >&2; }

# limit SHARE_S: seconds a stage may take, at most what is left of the budget (min 10).
limit() {
    local left=$((BUDGET_S - (SECONDS - START_S)))
    local want=$1
    ((want > left)) && want=$left
    ((want < 10)) && want=10
    echo "$want"
}

# stage NAME SECONDS CMD...: run with a hard time limit, log output, record status.
stage() {
    local name=$1 secs=$2
    shift 2
    local t0=$SECONDS rc
    log "stage $name (limit ${secs}s): $*"
    timeout --kill-after=15 "$secs" "$@" >"$RESULTS/$name.log" 2>&1
    rc=$?
    local status=ok
    if ((rc == 124 || rc == 137)); then status="timeout after ${secs}s"; elif ((rc != 0)); then status="failed rc=$rc"; fi
    [[ $status != ok ]] && FAILED=1
    printf '%-14s %-24s %4ds  %s\n' "$name" "$status" $((SECONDS - t0)) "$*" >>"$SUMMARY"
    log "stage $name: $status ($((SECONDS - t0))s); tail of $name.log:"
    tail -n 5 "$RESULTS/$name.log" | sed 's/^/    /' >&2
    return 0
}

# ---- install ---------------------------------------------------------------------------
VENV="$RESULTS/venv"
install() {
    set -e
    "$PYTHON" -m venv --system-site-packages "$VENV"
    local py="$VENV/bin/python"
    local pip=("$py" -m pip install --no-index --disable-pip-version-check)
    if [[ -n "$WHEELS" ]]; then
        pip+=(--find-links "$WHEELS")
        # kvikio without its CUDA-toolkit dependency chain (see TBA_NOTES: ~6 MB instead of 1.4 GB).
        local gds=()
        for name in kvikio_cu13 libkvikio_cu13 rapids_logger cuda_pathfinder nvidia_cufile; do
            compgen -G "$WHEELS/${name}-*.whl" >/dev/null && gds+=("${name//_/-}")
        done
        if ((${#gds[@]})); then "${pip[@]}" --no-deps "${gds[@]}"; fi
    fi
    local target="tba"
    if [[ -z "$WHEELS" ]] || ! compgen -G "$WHEELS/tba-*.whl" >/dev/null; then
        echo "no tba wheel in '${WHEELS:-<none>}': building tba from $REPO (needs scikit-build-core, cmake)"
        pip+=(--no-build-isolation)
        target="$REPO"
    fi
    # The extras bring pytest, transformers and matplotlib; without their wheels, tba alone.
    "${pip[@]}" "$target[test,bench]" || {
        echo "WARNING: extras [test,bench] not installable from the wheels; installing tba alone"
        "${pip[@]}" "$target"
    }
    "$py" - <<'EOF'
import torch, tba
assert torch.cuda.is_available(), "torch.cuda.is_available() is False: no usable GPU for this python"
print("tba", tba.__version__, "from", tba.__file__, "| torch", torch.__version__, "cuda", torch.version.cuda,
      "|", torch.cuda.get_device_name(0))
EOF
}
log "results in $RESULTS; wheels from ${WHEELS:-<none>}; python $PYTHON; budget ${BUDGET_S}s"
export -f install
export WHEELS PYTHON VENV REPO
stage install "$(limit 120)" bash -c install
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

# ---- GPU tests -------------------------------------------------------------------------
stage pytest-gpu "$(limit 180)" env TBA_REQUIRE_GPU=1 "$PY" -m pytest -m gpu -q -p no:cacheprovider \
    --junitxml="$RESULTS/pytest-gpu.xml"

# ---- benchmarks ------------------------------------------------------------------------
stage io_bandwidth "$(limit 75)" "$PY" benchmarks/io_bandwidth.py --size-mib 256 --runs 5 \
    --out "$RESULTS/io_bandwidth.json"

# ROK: the sweep stops starting points after --time-budget-s and still writes its files.
rok_s=$(limit 220)
stage rok_cuda "$rok_s" "$PY" benchmarks/rok_curve.py --device cuda --out "$RESULTS/rok_cuda" \
    --time-budget-s $((rok_s - 60)) --timeout-s 90

ovh_s=$(limit 120)
stage overhead "$ovh_s" "$PY" benchmarks/rok_curve.py --device cuda --batch-sizes 8 \
    --strategies keep,offload-host,offload-ssd --warmup 3 --steps 8 --out "$RESULTS/overhead" \
    --time-budget-s $((ovh_s > 70 ? ovh_s - 40 : 30)) --timeout-s 60

# Adaptive on/off vs keep on a GPT-style MLP stack where activations dominate (issue target:
# >= 40% lower activation peak than keep at <= 5% longer step with the host offloader).
stage adaptive "$(limit 90)" "$PY" benchmarks/adaptive_offload.py --device cuda --blocks 8 \
    --width 2048 --batch 8192 --write-mib-s 0 --max-inflight-mib 4096 --steps 8 --warmup 3 \
    --out "$RESULTS/adaptive_offload.json"

stage hook_overhead "$(limit 45)" "$PY" benchmarks/hook_overhead.py --out "$RESULTS/hook_overhead.json"

log "done in $((SECONDS - START_S))s"
cat "$SUMMARY" >&2
exit $FAILED
