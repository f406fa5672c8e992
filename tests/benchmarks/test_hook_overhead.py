"""Smoke test: the hook-overhead benchmark runs at a tiny size and writes sane JSON and text (its
real-model part: test_hook_overhead_real.py, in the slow suite)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path / "ho.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "hook_overhead.py"), *args, "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "torch" in result["environment"] and "command" in result["environment"]
    assert out.with_suffix(".txt").read_text().startswith("device=")
    return proc, result


def test_hook_overhead_smoke(tmp_path: Path) -> None:
    """The tiny-op models, without the real model (transformers' import alone is most of the
    real model's time: this one runs in about 2 s quiet, so under load too)."""
    proc, result = _run(tmp_path, "--blocks", "2", "--ops", "20", "--rounds", "2", "--warmup", "3",
                        "--large-ops", "1", "--real-batches", "")
    assert "real" not in result
    # sin saves its input and mul saves sin(x) (the weight is a parameter, not packed); the
    # very first sin reads an input that needs no grad and saves nothing.
    assert result["tiny"]["_counts"]["num_packed_per_step"] == 2 * 20 * 2 - 1
    assert result["large_1MiB"]["_counts"]["num_packed_per_step"] == 2 * 1 * 2 - 1
    for size, tensor_bytes in (("tiny", 8 * 4), ("large_1MiB", 1 << 20)):
        packed = result[size]["_counts"]["num_packed_per_step"]
        for name in ("no hooks", "bare hooks", "save_on_cpu", "python floor", "tba none",
                     "tba host", "tba ssd"):
            assert result[size][name]["step_s"] > 0
        for name in ("tba host", "tba ssd"):
            row = result[size][name]
            # keep_last_modules=0, min_offload_bytes=0: every saved tensor goes to the offloader.
            # In the timed steps its store either ran or was cancelled because backward needed
            # the tensor first (all of them, on a busy machine): which one is the machine's
            # timing, and a store still running when its step ends counts in a later step. Once
            # the settled steps have run, every store of the timed steps has ended, one way or
            # the other, whatever the machine's load.
            assert row["sent_per_timed_step"] == packed, (size, name, row)
            # The settled step's stores all completed before backward: every tensor was written
            # and read back.
            assert row["settled_offloaded_bytes"] == row["settled_reloaded_bytes"] == packed * tensor_bytes, (
                size, name, row)
    assert "x save_on_cpu" in proc.stdout and "x bare hooks" in proc.stdout
