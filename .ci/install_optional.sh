#!/usr/bin/env bash
# Optional packages the tests use, installed without touching torch.
#   bash .ci/install_optional.sh CONSTRAINTS_FILE
set -euo pipefail
constraints=$1

# kvikio for the SSD offloader's kvikio engine, minimal: --no-deps skips cupy and the ~1.4 GB of
# CUDA libraries; host-buffer I/O in compat mode works with this set (kvikio does not need cupy).
pip install -q --no-deps -c "$constraints" \
  kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 nvidia-cufile==1.20.0.107 \
  rapids-logger==0.3.0 cuda-pathfinder==1.9.0

# Pipeline engines for the integration tests (tested versions; megatron-core 0.17 needs
# Python >= 3.12).
pip install -q -c "$constraints" megatron-core==0.16.1 deepspeed==0.19.8

# Trainer callbacks (tba[hf], tba[lightning]) at the versions their tests ran with, and PEFT for
# the LoRA-through-Trainer test.
pip install -q -c "$constraints" accelerate==1.15.0 pytorch-lightning==2.6.6 peft==0.21.2
