"""Smoke test: the host-offload probe (a GPU diagnostic) runs on CPU at a tiny size and writes
its JSON: per mode the step times, the cache's counters and the profiler's copy rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_host_offload_probe_smoke(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "host_offload_probe.py"), "--quick", "--warmup", "1",
         "--steps", "2", "--modes", "keep,host-fixed", "--out", str(out)],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    keep, host = result["modes"]
    assert (keep["mode"], host["mode"]) == ("keep", "host-fixed")
    assert len(keep["step_s"]) == len(host["step_s"]) == 2 and host["median_step_s"] > 0
    assert "offloaded_bytes" not in keep and host["offloaded_bytes"] >= 0
    assert any(row["name"] == "aten::copy_" for row in host["copies"])
    assert "offloaded MiB" in host["summary"]
    assert {"device", "torch", "tba", "command"} <= result["environment"].keys()
    assert "host-fixed: median step" in proc.stdout
