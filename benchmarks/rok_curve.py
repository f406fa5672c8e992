#!/usr/bin/env python
"""ROK curve: activation peak vs model throughput for Recompute, Offload and Keep.

Command lines (from the repository root, venv active):

    # Default CPU sweep (GPT-2, 6 layers x 128 wide, seq 128; batches 1,2,4,8; 6 strategies x 3
    # interleaved passes; docs/rok.md gives its time):
    python benchmarks/rok_curve.py
    # -> out/rok/rok_curve.{png,csv,json}, rok_summary.txt, rok_samples.csv, logs/sweep.log

    # The committed CPU reference run (benchmarks/results/cpu_rok_curve/) is the default run's
    # rok_curve.png, rok_curve.csv and rok_summary.txt (bash .ci/dev.sh main in a fresh clone).

    # GPU sweep, GPT sized to the GPU (what benchmarks/gpu_suite.sh runs):
    python benchmarks/rok_curve.py --device cuda --out results/rok_cuda --time-budget-s 300

    # Overhead at a fixed batch (step time vs keep, per pass, is the overhead):
    python benchmarks/rok_curve.py --device cuda --batch-sizes 8 --strategies keep,offload-host,offload-ssd \
        --steps 10 --repeats 5 --out results/overhead

    # Smoke run (tests/benchmarks/test_rok_curve.py): tiny model, 2 batches, 2 passes of 1+2 steps:
    python benchmarks/rok_curve.py --quick --out /tmp/rok

The sweep itself lives in the package (``tba.rok``; ``tba rok`` is the same command once tba
is installed); its docstring and docs/rok.md describe the method.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tba from this checkout when not installed

from tba.rok import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(prog="python benchmarks/rok_curve.py"))
