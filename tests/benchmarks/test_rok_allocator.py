"""Note [The allocator is the activation axis on CUDA] (tba/rok/_allocator.py), on the CPU: a
fake allocator stands in for torch.cuda, so the choice of the source, the peak minus the
baseline and the warning where tba's accounting differs by more than 10% are tested here."""

from __future__ import annotations

import doctest
import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake

pytest.importorskip("transformers")

from tba.rok import _allocator, _plot, _report, _summary  # noqa: E402
from tba.rok import _cli as _rok_cli  # noqa: E402
from tba.rok import _schedule as _rok_schedule  # noqa: E402
from tba.rok import _worker as _rok_worker  # noqa: E402
from tests.benchmarks.rok_spec import spec  # noqa: E402

BASELINE = 10 << 20


class FakeAllocator:
    """An allocator whose peak in measured step ``i`` is ``BASELINE + step_peaks[i]``; logs
    every call, so a test sees when the baseline and the peaks were read."""

    name = "fake.max_memory_allocated"

    def __init__(self, step_peaks: list[int]) -> None:
        self.step_peaks = step_peaks
        self.step = 0
        self.log: list[str] = []
        self.tensor_bytes_at_baseline: list[int] = []

    def synchronize(self) -> None:
        self.log.append("sync")

    def allocated_bytes(self) -> int:
        self.log.append("allocated")
        self.tensor_bytes_at_baseline.append(_live_tensor_bytes())
        return BASELINE

    def reserved_bytes(self) -> int:
        return BASELINE + (1 << 20)

    def reset_peak(self) -> None:
        self.log.append("reset")
        self.step += 1

    def peak_allocated_bytes(self) -> int:
        self.log.append("peak")
        return BASELINE + self.step_peaks[self.step - 1]

    def peak_reserved_bytes(self) -> int:
        return BASELINE + (1 << 20) + 2 * self.step_peaks[self.step - 1]


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor Python holds now (what a CPU "allocator"
    would hold after set-up: weights, gradients, optimizer state). Tensors without data (the
    fake tensors an earlier test's compile left for the collector) hold no bytes."""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not is_fake(obj):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_cuda_reads_torch_cuda_and_cpu_reads_no_allocator() -> None:
    assert _allocator.memory_stats_for("cpu") is None
    stats = _allocator.memory_stats_for("cuda")
    assert isinstance(stats, _allocator.CudaMemoryStats) and "max_memory_allocated" in stats.name
    assert not torch.cuda.is_initialized()  # made, not read: no CUDA touched


@pytest.mark.parametrize(("strategy", "counted_source"), [("keep", "meter"), ("offload-host", "cache")])
def test_the_allocators_peak_over_the_baseline_is_the_axis(strategy: str, counted_source: str) -> None:
    peaks = [3 << 20, 5 << 20, 4 << 20]  # the second measured step peaks highest
    fake = FakeAllocator(peaks)
    row = _rok_worker.run_point(spec(strategy=strategy, steps=3, warmup_steps=1), memory_stats=fake)
    assert row["status"] == "ok", row
    assert row["activation_peak_source"] == "allocator" and row["allocator_source"].startswith(fake.name)
    assert row["activation_peak_bytes"] == row["cuda_max_allocated_delta_bytes"] == max(peaks)
    assert row["allocator_activation_peak_per_step"] == peaks
    assert row["cuda_max_reserved_delta_bytes"] == 2 * max(peaks)
    # The baseline is read once, before the first measured step; each measured step (and no
    # warm-up or accounting step) resets the peak before it and reads it after.
    assert fake.log.index("allocated") < fake.log.index("reset") and fake.log.count("allocated") == 1
    # ... after set-up: weights, gradients and AdamW's two moments exist (4x the weights).
    model = _rok_worker.build_model(spec()["model"], "cpu", "float32")
    weights = sum(p.nbytes for p in model.parameters())
    assert fake.tensor_bytes_at_baseline[0] >= 4 * weights + _live_tensor_bytes() - weights, (
        fake.tensor_bytes_at_baseline, weights)
    resets = [e for e in fake.log if e in ("reset", "peak")]
    assert resets == ["reset", "peak"] * 3, fake.log
    # tba's accounting beside it, the same number as without an allocator.
    plain = _rok_worker.run_point(spec(strategy=strategy, steps=3, warmup_steps=1))
    assert row["counted_activation_peak_source"] == counted_source == plain["activation_peak_source"]
    counted = row["counted_activation_peak_bytes"]
    assert counted > 0 and row["counted_vs_allocator"] == counted / max(peaks)
    if strategy == "keep":  # the meter's count is exact: the same in both runs
        assert counted == plain["activation_peak_bytes"] == plain["counted_activation_peak_bytes"]
    else:
        assert counted == row["cache_peak_resident_bytes"] and row["cache_offloaded_bytes"] > 0
    assert "counted_vs_allocator" not in plain and "allocator_source" not in plain


def _samples() -> list[dict[str, Any]]:
    """Two passes at b=4 with allocator peaks and accounting: keep 0.80x (the step's
    temporaries), offload-host 0.96x, offload-ssd 1.20x (accounting above the allocator),
    budget 1.08x: keep and offload-ssd are more than 10% apart."""
    counted = {"keep": 800, "offload-host": 480, "offload-ssd": 480, "budget": 432}
    allocator = {"keep": 1000, "offload-host": 500, "offload-ssd": 400, "budget": 400}
    out = []
    for repeat in (0, 1):
        for s in counted:
            mib = 2**20
            out.append({"repeat": repeat, "strategy": s, "batch_size": 4, "status": "ok",
                        "step_time_s": 1.0 + 0.01 * repeat, "model_flops_per_s": 1e9, "tokens_per_s": 100.0,
                        **_allocator.activation_columns(counted[s] * mib, "meter" if s == "keep" else "cache",
                                                        allocator[s] * mib)})
    return out


def test_summary_and_figure_warn_where_accounting_and_allocator_differ_by_more_than_10_percent(
        tmp_path: Path) -> None:
    samples = _samples()
    points = _summary.aggregate(samples)
    summary = _summary.summarize(samples, points, None)
    assert summary["activation_source"] == "allocator" and summary["accounting_tolerance"] == 0.10
    flagged = [gap.split(":")[0] for gap in summary["accounting_gaps"]]
    assert flagged == ["keep b=4", "offload-ssd b=4"], summary["accounting_gaps"]
    keep = next(p for p in points if p["strategy"] == "keep")
    assert keep["counted_vs_allocator"] == pytest.approx(0.8) and keep["counted_activation_peak_source"] == "meter"
    config = dict(strategies=list(dict.fromkeys(s["strategy"] for s in samples)), repeats=2)
    text = _report.format_summary(summary, points, config, cuda=True)
    assert "WARNING allocator vs tba's accounting differ by more than 10% at 2 points" in text
    assert "  offload-ssd b=4: allocator 400.0 MiB, cache accounting 480.0 MiB (1.20x the allocator)" in text
    assert "accounting 800.0 MiB (meter, 0.80x)" in text and "max_memory_allocated" in _report.device_caption(True)
    series = _plot.plot_series(points, summary, cuda=True)
    assert series["allocator"] and series["secondary_key"] == "counted_activation_peak_bytes"
    assert {s: c["gaps"] for s, c in series["curve"].items()} == {
        "keep": [True], "offload-host": [False], "offload-ssd": [True], "budget": [False]}
    assert series["accounting_warning"].startswith("WARNING (red rings)") and "offload-ssd b=4" in \
        series["accounting_warning"]
    assert series["secondary"]["keep"]["y"] == [800.0]
    env = dict(device="cuda", gpu="fake GPU", cuda="12.8", torch=torch.__version__, tba="test", transformers="x",
               python="3", command="tba rok --device cuda")
    config.update(model=dict(layers=2, hidden=32, seq_len=16, vocab=16), dtype="bfloat16", steps=2, warmup_steps=1)
    drawn = _plot.plot(tmp_path / "rok.png", points, summary, env, config, [])
    assert (tmp_path / "rok.png").stat().st_size > 10_000 and drawn["accounting_warning"] == series["accounting_warning"]


def test_within_10_percent_is_said_and_the_cpu_axis_has_no_such_block() -> None:
    samples = [s for s in _samples() if s["strategy"] in ("offload-host", "budget")]
    points = _summary.aggregate(samples)
    summary = _summary.summarize(samples, points, None)
    assert summary["accounting_gaps"] == []
    config = dict(strategies=["offload-host", "budget"], repeats=2)
    assert "allocator vs tba's accounting: within 10% at every point" in _report.format_summary(
        summary, points, config, cuda=True)
    assert _plot.plot_series(points, summary, cuda=True)["accounting_warning"] is None
    # Without an allocator (the CPU) the axis is the accounting: no comparison, no warning.
    cpu = [dict(s, **_allocator.activation_columns(s["counted_activation_peak_bytes"], "cache", None))
           for s in samples]
    for s in cpu:
        s.pop("counted_vs_allocator")
    cpu_points = _summary.aggregate(cpu)
    cpu_summary = _summary.summarize(cpu, cpu_points, None)
    assert cpu_summary["activation_source"] == "accounting" and cpu_summary["accounting_gaps"] == []
    assert "allocator" not in _report.format_summary(cpu_summary, cpu_points, config, cuda=False)
    assert all("counted_vs_allocator" not in p for p in cpu_points)
    assert _plot.plot_series(cpu_points, cpu_summary, cuda=False)["secondary_key"] == "process_rss_peak_bytes"


def test_a_point_whose_allocator_saw_no_growth_is_flagged() -> None:
    gap = _allocator.accounting_gap({"strategy": "keep", "batch_size": 2, "activation_peak_source": "allocator",
                                     "activation_peak_bytes": 0, "counted_activation_peak_bytes": 2**20})
    assert gap is not None and "no growth over set-up" in gap


def test_the_budget_is_a_fraction_of_keeps_accounting_not_of_the_allocator() -> None:
    samples = [{"repeat": 0, "strategy": "keep", "batch_size": 4, "status": "ok",
                **_allocator.activation_columns(600, "meter", 1000)}]
    assert _rok_cli._budget_for(_rok_schedule.Sample(0, 4, "budget"), samples, 0.5) == 300


def test_docstring_examples_run() -> None:
    result = doctest.testmod(_allocator, raise_on_error=False, verbose=False)
    assert result.attempted > 0 and result.failed == 0
