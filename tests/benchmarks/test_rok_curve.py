"""Smoke test of benchmarks/rok_curve.py (--quick) and unit tests of its summary."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from tba.rok import _report as _rok_report  # noqa: E402
from tba.rok import _worker as _rok_worker  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_quick_run_writes_csv_json_png(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH / "rok_curve.py"), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== ROK curve ==" in proc.stdout and "torch " in proc.stdout and "== summary ==" in proc.stdout
    with open(tmp_path / "rok_curve.csv") as f:
        rows = list(csv.DictReader(f))
    assert {"strategy", "batch_size", "activation_peak_bytes", "step_time_s", "model_flops_per_s",
            "tokens_per_s", "cache_peak_resident_bytes"} <= set(rows[0])
    assert {(r["strategy"], r["batch_size"]) for r in rows} == {
        (s, b) for s in _rok_worker.STRATEGIES for b in ("1", "2")}
    for r in rows:
        if r["strategy"] in ("keep", "recompute"):  # need no offloader: must always run
            assert r["status"] == "ok", r
        assert r["status"] == "ok" or r["status"].startswith(("unavailable:", "failed:")), r
        if r["status"] == "ok":
            assert float(r["step_time_s"]) > 0 and float(r["model_flops_per_s"]) > 0
    report = json.loads((tmp_path / "rok_curve.json").read_text())
    env = report["environment"]
    assert env["torch"] and env["tba"] and env["python"] and "--quick" in env["command"]
    assert report["summary"]["relative_to_keep"]["keep"]["1"]["peak_vs_keep"] == pytest.approx(1.0)
    png = (tmp_path / "rok_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_unavailable_offloader_is_a_row_not_a_crash():
    spec = dict(device="cpu", model=dict(layers=1, hidden=32, heads=2, seq_len=8, vocab=16), dtype="float32",
                strategy="offload-ssd", batch_size=1, steps=1, warmup_steps=0, min_offload_bytes=0,
                keep_last_modules=1, adaptive=False, ssd_dir="/proc/no/such/dir", num_threads=None,
                mmap_threshold_bytes=None)
    row = _rok_worker.run_point(spec)
    assert row["status"].startswith("unavailable: ValueError"), row
    ok = _rok_worker.run_point(dict(spec, strategy="recompute"))
    assert ok["status"] == "ok" and ok["model_flops_per_s"] > 0


def _row(strategy, b, peak, flops):
    return {"strategy": strategy, "batch_size": b, "status": "ok", "activation_peak_bytes": peak,
            "model_flops_per_s": flops, "step_time_s": 1.0}


def test_summary_relative_numbers_and_budget():
    rows = [
        _row("keep", 4, 400, 100.0), _row("keep", 8, 800, 110.0), _row("keep", 16, 1600, 120.0),
        _row("recompute", 4, 150, 75.0), _row("recompute", 8, 250, 80.0), _row("recompute", 16, 450, 90.0),
        _row("offload-ssd", 4, 200, 99.0), _row("offload-ssd", 8, 350, 109.0),
        {"strategy": "offload-ssd", "batch_size": 16, "status": "failed: timeout after 300 s"},
        {"strategy": "offload-host", "batch_size": 4, "status": "unavailable: ValueError: no host pool"},
    ]
    s = _rok_report.summarize(rows, None)
    assert s["shared_batches"] == [4, 8] and s["largest_shared_batch"] == 8
    assert s["relative_to_keep"]["offload-ssd"]["8"] == {"peak_vs_keep": 350 / 800, "throughput_vs_keep": 109 / 110}
    assert s["budget_bytes"] == 800 and "median batch 8" in s["budget_source"]
    fits = s["largest_batch_within_budget"]
    assert fits["keep"]["largest_batch"] == 8 and fits["recompute"]["largest_batch"] == 16
    assert fits["offload-ssd"]["largest_batch"] == 8
    assert s["unavailable"] == {"offload-host": "unavailable: ValueError: no host pool"}
    text = _rok_report.format_summary(s, rows, cuda=False)
    assert "b=8" in text and "offload-host" in text and "44%" in text
    assert _rok_report.summarize(rows, 300)["largest_batch_within_budget"]["keep"]["largest_batch"] is None
