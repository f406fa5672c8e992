#!/usr/bin/env bash
# Optional packages the tests use when present (installed without touching torch).
#   bash .ci/install_optional.sh CONSTRAINTS_FILE
set -euo pipefail
constraints=$1
: "$constraints"
