"""The SSD offloader under the tensor cache: BERT/T5 bit-exact, disk use over 30 GPT-2 steps,
and I/O faults surfacing in (or kept out of) the training step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tba
from tests import models
from tests.twin import assert_bytes_moved, run_twins

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = {"offloader": "ssd", "ssd_engine": "posix", "offload_devices": ("cpu",), "min_offload_bytes": 0}


@pytest.mark.parametrize("name", ["bert", "t5"])
def test_bert_t5_bit_exact(tmp_path: Path, name: str) -> None:
    make_model, make_batch = {"bert": (models.bert, models.lm_batch), "t5": (models.t5, models.t5_batch)}[name]
    cache = run_twins(make_model, make_batch, steps=3, settle=True, ssd_dirs=(str(tmp_path),), **OPTIONS)
    total = assert_bytes_moved(cache)
    assert total.num_io_errors == 0
    assert list(tmp_path.iterdir()) == []


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def test_thirty_gpt2_steps_keep_disk_bounded(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=128, n_embd=128, n_layer=4, n_head=4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (4, 64))
    peak_disk, step_bytes = 0, 0
    with tba.configure_tensor_cache(model, ssd_dirs=(str(tmp_path),), **OPTIONS) as cache:
        for step in range(30):
            loss = model(input_ids=ids, labels=ids).loss
            peak_disk = max(peak_disk, _disk_bytes(tmp_path))  # mid-step: everything written
            loss.backward()
            opt.step()
            opt.zero_grad()
            peak_disk = max(peak_disk, _disk_bytes(tmp_path))
            stats = cache.stats()
            step_bytes = max(step_bytes, stats.offloaded_bytes + stats.kept_bytes)
        assert cache.stats(cumulative=True).num_steps == 30
    assert step_bytes > 0
    assert peak_disk <= 1.5 * step_bytes, (peak_disk, step_bytes)
    assert list(tmp_path.iterdir()) == []  # gone after close()


_FAULT_SCRIPT = """
import json, resource, signal, sys, warnings
import torch
import tba
from tests import models
from tests.twin import assert_bytes_moved, run_twins

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
mode, directory = sys.argv[1], sys.argv[2]
options = dict(offloader="ssd", ssd_engine="posix", ssd_dirs=(directory,), offload_devices=("cpu",),
               min_offload_bytes=0, on_io_error=mode)
result = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        cache = run_twins(lambda: models.Stack(num_blocks=4, width=256), lambda s: torch.randn(64, 16),
                          steps=3, **options)
        result["bit_exact"] = True
        result["io_errors"] = cache.stats(cumulative=True).num_io_errors
    except tba.OffloadIOError as exc:
        result["raised"] = {"errno": exc.errno, "path": exc.path, "text": str(exc)}
result["warnings"] = [str(w.message) for w in caught if "on_io_error" in str(w.message)]
print(json.dumps(result))
"""


@pytest.mark.parametrize("mode", ["raise", "keep"])
def test_file_size_limit_in_training(tmp_path: Path, mode: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_FAULT_SCRIPT), mode, str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if mode == "raise":
        raised = result.get("raised")
        assert raised is not None, result
        assert raised["errno"] == 27 and "File too large" in raised["text"]  # EFBIG
        assert raised["path"]
    else:
        assert result.get("bit_exact") is True, result
        assert result["io_errors"] > 0
        assert len(result["warnings"]) == 1
    assert list(tmp_path.iterdir()) == []
