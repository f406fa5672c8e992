# shellcheck shell=bash
# Shared by benchmarks/gpu_suite.sh and benchmarks/gpu_truth.sh (sourced, not run): where the
# wheels are, and the install into a virtual environment that sees the machine's torch.
#
#   wheel_dir [DIR]  prints the wheel folder: DIR, else $TBA_WHEEL_DIR, else benchmarks/wheels/,
#                    <repo>/.whl/ or benchmarks/ (the first holding a *.whl); empty if none.
#   install          makes $VENV from $PYTHON (benchmarks/_suite_venv.py), installs from $WHEELS
#                    with pip --no-index: the kvikio set --no-deps, then tba[test,bench] (a
#                    tba-*.whl, else built from $REPO), tba alone when the extras' wheels are
#                    missing. Needs VENV, PYTHON, WHEELS, REPO, SCRIPT_DIR. torch is never
#                    installed or upgraded.

wheel_dir() {
    local wheels="${1:-${TBA_WHEEL_DIR:-}}"
    if [[ -z "$wheels" ]]; then
        for d in "$SCRIPT_DIR/wheels" "$REPO/.whl" "$SCRIPT_DIR"; do
            if compgen -G "$d/*.whl" >/dev/null; then wheels="$d"; break; fi
        done
    fi
    echo "$wheels"
}

install() {
    set -e
    # Sees PYTHON's packages also when PYTHON is a venv's (Note [A venv made from a venv]).
    "$PYTHON" "$SCRIPT_DIR/_suite_venv.py" "$VENV"
    local py="$VENV/bin/python"
    local pip=("$py" -m pip install --no-index --disable-pip-version-check)
    if [[ -n "$WHEELS" ]]; then
        pip+=(--find-links "$WHEELS")
        # kvikio without its CUDA-toolkit dependency chain (~6 MB instead of ~1.4 GB of CUDA libraries).
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
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no usable GPU (GPU rows will SKIP)"
print("tba", tba.__version__, "from", tba.__file__, "| torch", torch.__version__, "cuda", torch.version.cuda,
      "|", gpu)
EOF
}
