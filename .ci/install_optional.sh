#!/usr/bin/env bash
# Optional packages the tests use, installed without touching torch, with whatever else the
# caller asks pip for (dev.sh: tba editable with its extras) in the same resolve.
#   bash .ci/install_optional.sh CONSTRAINTS_FILE [PIP_ARGS...]
# --no-compile: Python writes the byte code of the modules a run imports when it first imports
# them (Note [Byte code is written] in dev.sh); compiling all of transformers, deepspeed and
# megatron at install time cost a fresh clone's set-up more than that.
set -euo pipefail
constraints=$1
shift

# In one resolve: pipeline engines for the integration tests (tested versions; megatron-core
# 0.17 needs Python >= 3.12); Trainer callbacks (tba[hf], tba[lightning]) at the versions their
# tests ran with, and PEFT for the LoRA-through-Trainer test.
pip install -q --no-compile -c "$constraints" "$@" \
  megatron-core==0.16.1 deepspeed==0.19.8 \
  accelerate==1.15.0 pytorch-lightning==2.6.6 peft==0.21.2

# kvikio for the SSD offloader's kvikio engine, minimal: --no-deps skips cupy and the ~1.4 GB of
# CUDA libraries; host-buffer I/O in compat mode works with this set (kvikio does not need cupy).
# Last: pip checks the dependencies of what it installed only when it resolved them, so the
# resolve above would report kvikio's cupy as missing (an ERROR line in every set-up).
pip install -q --no-compile --no-deps -c "$constraints" \
  kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 nvidia-cufile==1.20.0.107 \
  rapids-logger==0.3.0 cuda-pathfinder==1.9.0
