"""The hook-overhead benchmark's real-model part (the main job's GPT-2) runs and writes sane rows;
apart from test_hook_overhead.py so that file stays quick under load (transformers' import alone
takes seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.test_hook_overhead import _run


@pytest.mark.slow  # imports transformers and builds the main job's GPT-2
def test_hook_overhead_real_model(tmp_path: Path) -> None:
    proc, result = _run(tmp_path, "--no-tiny", "--real-batches", "1", "--real-rounds", "1",
                        "--real-warmup", "1")
    assert "tiny" not in result
    real = result["real"]["1"]
    for name in ("plain", "save_on_cpu", "tba none", "tba host"):
        assert real[name]["step_s"] > 0 and real[name]["x_plain"] > 0
    assert real["tba none"]["packed_per_step"] > 0  # tba manages the GPT-2's saves
    assert "real model: GPT-2" in proc.stdout
