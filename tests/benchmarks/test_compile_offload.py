"""Smoke test: benchmarks/compile_offload.py runs at a tiny size and writes sane JSON and text;
its CUDA paths choose the GPU model and refuse a machine without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a subprocess that imports transformers and compiles three strategies
def test_compile_offload_smoke(tmp_path: Path) -> None:
    out = tmp_path / "co.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_offload.py"), "--quick", "--inner",
         "aot_eager", "--strategies", "keep,tba-host,torch-offload,eager-keep,eager-host", "--ssd-dir", str(tmp_path),
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["strategies"]
    assert rows["keep"]["status"] == "ok" and rows["keep"]["step_time_ratio"] == 1.0
    host = rows["tba-host"]
    assert host["status"] == "ok" and host["offloaded_bytes_per_step"] > 0, host
    assert host["peak_bytes"] > 0 and host["peak_ratio"] > 0 and host["step_time_ratio"] > 0
    eager = rows["eager-host"]  # against eager-keep, not against the compiled keep
    assert rows["eager-keep"]["step_time_ratio"] == 1.0
    assert eager["offloaded_bytes_per_step"] > 0 and eager["step_time_ratio"] == (
        eager["step_s"] / rows["eager-keep"]["step_s"])
    assert rows["torch-offload"]["status"].startswith("not run: PyTorch's pass is Inductor's")
    assert "torch" in result["environment"] and "command" in result["environment"]
    assert out.with_suffix(".txt").read_text().startswith("device=")
    assert "x keep" in proc.stdout


def test_cuda_paths_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import compile_offload as bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench._parse(["--device", "cuda"])

    class Properties:
        total_memory = 80 << 30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Properties())
    args = bench._parse(["--device", "cpu"])
    args.device = "cuda"
    spec = bench._model_spec(args)
    assert spec["layers"] == 12 and spec["attn_implementation"] == "sdpa"
