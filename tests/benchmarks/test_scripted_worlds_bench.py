"""Smoke test: benchmarks/scripted_worlds.py runs at a tiny size (the loop alone and in a real
cache) and writes sane JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "worlds.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scripted_worlds.py"), *args, "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_scripted_worlds_smoke(tmp_path: Path) -> None:
    result = _run(tmp_path, "--seeds", "2", "--kinds", "quiet,drift", "--boundaries", "3,9")
    quiet, drift = result["rows"]
    assert quiet["kind"] == "quiet" and quiet["checks"] == 4
    assert quiet["at_best"] + quiet["one_below"] + quiet["lower"] + quiet["above"] == 4
    assert quiet["above"] == 0 and 12 <= quiet["median_steps"] <= 60
    assert drift["kind"] == "drift" and drift["checks"] == 2  # boundary 9 only: 8 to 11 drift
    assert {"device", "torch", "tba", "command"} <= result["environment"].keys()


def test_scripted_worlds_in_a_cache_smoke(tmp_path: Path) -> None:
    result = _run(tmp_path, "--cache", "--seeds", "1", "--kinds", "quiet", "--boundaries", "4")
    (row,) = result["rows"]
    assert row["checks"] == 1 and row["at_best"] + row["one_below"] == 1
