"""Smoke test: the hook-overhead benchmark runs at a tiny size and writes sane JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_hook_overhead_smoke(tmp_path: Path) -> None:
    out = tmp_path / "ho.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "hook_overhead.py"), "--blocks", "2",
         "--ops", "20", "--repeats", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    # sin saves its input and mul saves sin(x) (the weight is a parameter, not packed); the
    # very first sin reads an input that needs no grad and saves nothing.
    assert result["num_packed_per_step"] == 2 * 20 * 2 - 1
    assert result["step_s_with"] > 0 and result["step_s_without"] > 0
    assert "torch" in result["environment"] and "command" in result["environment"]
    assert "us per tensor" in proc.stdout
