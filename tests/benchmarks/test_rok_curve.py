"""Smoke test of benchmarks/rok_curve.py (--quick) and unit tests of its schedule, spread and summary."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

import tba  # noqa: E402
from tba.rok import _cli as _rok_cli  # noqa: E402
from tba.rok import _plot as _rok_plot  # noqa: E402
from tba.rok import _report as _rok_report  # noqa: E402
from tba.rok import _schedule as _rok_schedule  # noqa: E402
from tba.rok import _spread as _rok_spread  # noqa: E402
from tba.rok import _summary as _rok_summary  # noqa: E402
from tba.rok import _warmup as _rok_warmup  # noqa: E402
from tba.rok import _worker as _rok_worker  # noqa: E402
from tests.benchmarks.rok_spec import spec as _spec  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
HAS_BUDGET = "activation_budget_bytes" in {f.name for f in tba.TensorCacheConfig.__dataclass_fields__.values()}


def test_quick_run_writes_csv_json_png(tmp_path):
    every = ",".join(_rok_worker.STRATEGIES)  # recompute+offload is not in the default sweep
    proc = subprocess.run([sys.executable, str(BENCH / "rok_curve.py"), "--quick", "--strategies", every, "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "== ROK curve ==" in out and "torch " in out and "== summary ==" in out and "load average" in out
    assert "overhead at equal batch" in out and "throughput at equal activation budget" in out
    with open(tmp_path / "rok_curve.csv") as f:
        points = list(csv.DictReader(f))
    assert {"strategy", "batch_size", "num_samples", "activation_peak_bytes", "step_time_s", "step_time_s_mean",
            "step_time_s_min", "step_time_s_max", "model_flops_per_s", "model_flops_per_s_spread", "tokens_per_s",
            "cache_peak_resident_bytes", "process_rss_peak_bytes", "activation_peak_source"} <= set(points[0])
    documented = (Path(__file__).resolve().parents[2] / "docs" / "rok.md").read_text()
    assert all(f"`{column}`" in documented for column in points[0]), "docs/rok.md describes every column"
    assert {(r["strategy"], r["batch_size"]) for r in points} == {
        (s, b) for s in _rok_worker.STRATEGIES for b in ("1", "2")}
    for r in points:
        if r["strategy"] in ("keep", "recompute", "adaptive"):  # need no optional offloader: must always run
            assert r["status"] == "ok", r
        assert r["status"] == "ok" or r["status"].startswith(("unavailable:", "failed:")), r
        if r["status"] == "ok":
            assert int(r["num_samples"]) == 2  # --quick: two passes
            assert float(r["activation_peak_bytes"]) > 0 and float(r["process_rss_peak_bytes"]) > 0
            lo, med, hi = (float(r[f"model_flops_per_s{x}"]) for x in ("_min", "", "_max"))
            assert 0 < lo <= med <= hi and float(r["step_time_s"]) > 0
    with open(tmp_path / "rok_samples.csv") as f:
        samples = list(csv.DictReader(f))
    assert len(samples) == 2 * len(points) and {s["repeat"] for s in samples} == {"0", "1"}
    report = json.loads((tmp_path / "rok_curve.json").read_text())
    env = report["environment"]
    assert env["torch"] and env["tba"] and env["python"] and "--quick" in env["command"] and env["load_avg_start"]
    assert report["config"]["repeats"] == 2 and len(report["samples"]) == len(samples)
    rec = report["summary"]["equal_batch"]["recompute"]["1"]["step_time_vs_keep"]
    assert len(rec["ratios"]) == 2 and rec["ratio"]["min"] <= rec["ratio"]["median"] <= rec["ratio"]["max"]
    adaptive = next(p for p in report["rows"] if p["strategy"] == "adaptive" and p["batch_size"] == 2)
    assert adaptive["decision_tail_start"] is not None and adaptive["warmup_steps_run"] >= 3
    for budget in (s for s in report["samples"] if s["strategy"] == "budget" and s["status"] == "ok"):
        keep = next(s for s in report["samples"] if s["strategy"] == "keep" and s["batch_size"] == budget["batch_size"])
        assert budget["activation_budget_bytes"] == int(0.5 * keep["activation_peak_bytes"])
    assert report["summary"]["headline"].startswith("at b=2: recompute: ")
    assert "headline, at b=2" in out and "at the largest batch (b=2)" in out and "above keep's activation peak" in out
    summary_txt = (tmp_path / "rok_summary.txt").read_text()
    assert "== ROK curve ==" in summary_txt and "headline, at b=2" in summary_txt and str(tmp_path) not in summary_txt
    keep_curve = report["plot"]["curve"]["keep"]
    assert keep_curve["batch_sizes"] == [1, 2] and len(keep_curve["yerr"]) == 2 and len(keep_curve["yerr"][0]) == 2
    png = (tmp_path / "rok_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (tmp_path / "logs" / "sweep.log").read_text().count("pass 2 starts") == 1


def test_unavailable_offloader_is_a_row_not_a_crash():
    spec = _spec(strategy="offload-ssd", ssd_dir="/proc/no/such/dir", model=dict(layers=1, hidden=32, heads=2,
                                                                                 seq_len=8, vocab=16), batch_size=1)
    row = _rok_worker.run_point(spec)
    assert row["status"].startswith("unavailable: ValueError"), row
    ok = _rok_worker.run_point(dict(spec, strategy="recompute"))
    assert ok["status"] == "ok" and ok["model_flops_per_s"] > 0


def test_schedule_interleaves_strategies():
    # Note [Interleaved samples]: passes outermost; within a pass and batch every strategy once,
    # back to back; the order rotates each pass; keep first in the first pass.
    strategies, batches = ["keep", "recompute", "offload-ssd", "budget"], [2, 8]
    sched = _rok_schedule.interleaved(strategies, batches, 3)
    assert len(sched) == 3 * 2 * 4 and len(set(sched)) == len(sched)
    assert [s.repeat for s in sched] == sorted(s.repeat for s in sched)
    for i in range(0, len(sched), 4):
        group = sched[i:i + 4]
        assert len({(s.repeat, s.batch_size) for s in group}) == 1 and sorted(s.strategy for s in group) == sorted(
            strategies)
    firsts = [sched[i].strategy for i in range(0, len(sched), 4)]
    assert firsts == ["keep", "keep", "recompute", "recompute", "offload-ssd", "offload-ssd"]
    for s in strategies:  # every strategy takes a different place in each pass
        assert len({[x.strategy for x in sched if x.repeat == r and x.batch_size == 2].index(s)
                    for r in range(3)}) == 3
    with pytest.raises(ValueError, match="repeats=0"):
        _rok_schedule.interleaved(strategies, batches, 0)


def test_meaningless_comparison_warning():
    # Note [When a comparison means nothing]
    warn = _rok_spread.comparison_warning
    assert warn([0.98, 0.99, 1.0]) is None  # tight: "no difference" is a result
    assert warn([0.60, 0.70, 0.72]) is None  # wide but far from 1: slower, clearly
    assert warn([1.45, 1.52, 1.60]) is None
    assert "cannot tell" in warn([0.9, 1.52, 2.1])  # the summary that said "152% of keep"
    assert "cannot tell" in warn([0.92, 0.97, 1.03])  # 11% spread hides a 3% difference
    assert "one sample" in warn([1.2])
    assert "no pair" in warn([])
    assert warn([0.97, 1.0, 1.03], noise_floor=0.07) is None
    s = _rok_spread.spread([3.0, 1.0, 2.0, 10.0])
    assert (s.n, s.median, s.mean, s.min, s.max) == (4, 2.5, 4.0, 1.0, 10.0) and s.relative == pytest.approx(3.6)


def _sample(strategy, b, repeat, peak, step_s, flops_per_step=100.0):
    return {"repeat": repeat, "strategy": strategy, "batch_size": b, "status": "ok", "activation_peak_bytes": peak,
            "step_time_s": step_s, "model_flops_per_s": flops_per_step * b / step_s, "tokens_per_s": b / step_s}


def _injected():
    samples = []
    for r, drift in enumerate((1.0, 1.5, 1.0)):  # pass 1 ran while the machine was busy: everything slower
        samples += [
            _sample("keep", 4, r, 400, 1.0 * drift), _sample("keep", 8, r, 800, 2.0 * drift),
            _sample("keep", 16, r, 1600, 4.0 * drift),
            _sample("recompute", 4, r, 150, 1.3 * drift), _sample("recompute", 8, r, 250, 2.6 * drift),
            _sample("recompute", 16, r, 450, 5.2 * drift),
            _sample("offload-ssd", 4, r, 200, 1.02 * drift), _sample("offload-ssd", 8, r, 350 + 500 * (r == 2),
                                                                     (2.0, 3.3, 1.4)[r]),
        ]
    samples.append({"repeat": 0, "strategy": "offload-ssd", "batch_size": 16, "status": "failed: timeout after 300 s"})
    samples.append({"repeat": 0, "strategy": "offload-host", "batch_size": 4,
                    "status": "unavailable: ValueError: no host pool"})
    return samples


def test_aggregate_points_carry_the_spread():
    points = {(p["strategy"], p["batch_size"]): p for p in _rok_summary.aggregate(_injected())}
    keep8 = points[("keep", 8)]
    assert keep8["num_samples"] == 3 and keep8["num_failed"] == 0
    assert (keep8["step_time_s"], keep8["step_time_s_min"], keep8["step_time_s_max"]) == (2.0, 2.0, 3.0)
    assert keep8["step_time_s_mean"] == pytest.approx(7 / 3) and keep8["step_time_s_spread"] == pytest.approx(0.5)
    assert keep8["model_flops_per_s_min"] == pytest.approx(800 / 3) and keep8["model_flops_per_s"] == 400
    assert points[("offload-ssd", 16)]["status"].startswith("failed") and points[("offload-ssd", 16)][
        "num_samples"] == 0
    assert points[("offload-ssd", 8)]["activation_peak_bytes_max"] == 850


def test_summary_in_both_framings_uses_the_spread():
    samples = _injected()
    s = _rok_summary.summarize(samples, _rok_summary.aggregate(samples), None)
    # Overhead at equal batch, per pass: the drift of pass 1 cancels (recompute is 1.30x in every pass).
    rec = s["equal_batch"]["recompute"]["8"]["step_time_vs_keep"]
    assert rec["ratios"] == pytest.approx([1.3, 1.3, 1.3]) and rec["warning"] is None
    assert s["equal_batch"]["recompute"]["8"]["peak_vs_keep"]["ratio"]["median"] == pytest.approx(250 / 800)
    ssd = s["equal_batch"]["offload-ssd"]["8"]["step_time_vs_keep"]
    assert ssd["ratio"]["min"] == pytest.approx(0.7) and ssd["ratio"]["max"] == pytest.approx(1.1)
    assert "cannot tell" in ssd["warning"]
    assert any(w.startswith("offload-ssd b=8, step time vs keep") for w in s["warnings"])
    assert not any(w.startswith("recompute") for w in s["warnings"])
    # Throughput at equal activation budget (keep's peak at its median batch 8 = 800 B): a batch
    # fits only if every sample fits, so offload-ssd's b=8 (one pass at 850 B) does not.
    assert s["budget_bytes"] == 800 and "median batch 8" in s["budget_source"]
    fits = s["equal_budget"]
    assert fits["keep"]["largest_batch"] == 8 and fits["recompute"]["largest_batch"] == 16
    assert fits["offload-ssd"]["largest_batch"] == 4
    rel = fits["recompute"]["throughput_vs_keep"]
    assert rel["ratios"] == pytest.approx([(1600 / 5.2) / (800 / 2.0)] * 3) and rel["warning"] is None
    assert s["unavailable"] == {"offload-host": "unavailable: ValueError: no host pool"}
    text = _rok_report.format_summary(s, _rok_summary.aggregate(samples), {"repeats": 3}, cuda=False)
    assert "1.30x (1.30..1.30)" in text and "0.70..1.10) ?" in text and "31% (31%..31%)" in text
    assert "b=16" in text and "offload-host" in text and "warnings (2)" in text
    assert _rok_summary.summarize(samples, _rok_summary.aggregate(samples), 300)["equal_budget"]["keep"][
        "largest_batch"] is None


def test_one_sample_per_point_warns_for_every_comparison():
    samples = [s for s in _injected() if s["repeat"] == 0]
    s = _rok_summary.summarize(samples, _rok_summary.aggregate(samples), None)
    assert s["warnings"] and all("one sample" in w for w in s["warnings"])
    text = _rok_report.format_summary(s, _rok_summary.aggregate(samples), {"repeats": 1}, cuda=False)
    assert "every comparison rests on one sample" in text


def test_plot_series_has_error_bars():
    samples = _injected()
    points = _rok_summary.aggregate(samples)
    series = _rok_plot.plot_series(points, _rok_summary.summarize(samples, points, None), cuda=False)
    keep = series["curve"]["keep"]
    assert keep["batch_sizes"] == [4, 8, 16] and keep["n"] == [3, 3, 3]
    i = keep["batch_sizes"].index(8)
    assert keep["y"][i] == pytest.approx(400 / 1e9)
    assert keep["yerr"][0][i] == pytest.approx((400 - 800 / 3) / 1e9) and keep["yerr"][1][i] == pytest.approx(0)
    ssd = series["overhead"]["offload-ssd"]
    assert ssd["batch_sizes"] == [4, 8] and ssd["meaningless"] == [False, True]
    assert ssd["yerr"][0][1] == pytest.approx(1.0 - 0.7) and ssd["yerr"][1][1] == pytest.approx(0.1)


def _budget_cut(samples):
    """Only pass 0 ran: the time budget skipped the other two (as the H100 run's summary)."""
    out = [s for s in samples if s["repeat"] == 0]
    for r in (1, 2):
        out += [{"repeat": r, "strategy": s["strategy"], "batch_size": s["batch_size"],
                 "status": "skipped: time budget of 138 s spent"} for s in samples if s["repeat"] == 0]
    return out


def test_points_not_run_are_not_failures_and_the_passes_are_those_that_ran():
    # Issue 30: a point whose other passes the time budget skipped read "n=1 (2 failed)", and
    # the figure said "median of 3 interleaved passes" when one had run.
    samples = _budget_cut([s for s in _injected() if s["strategy"] in ("keep", "recompute")])
    points = _rok_summary.aggregate(samples)
    keep8 = next(p for p in points if (p["strategy"], p["batch_size"]) == ("keep", 8))
    assert (keep8["num_samples"], keep8["num_failed"], keep8["num_skipped"]) == (1, 0, 2)
    summary = _rok_summary.summarize(samples, points, None)
    assert summary["num_passes_run"] == 1
    text = _rok_report.format_summary(summary, points, {"repeats": 3}, cuda=False)
    assert "n=1 (2 not run: time budget of 138 s spent)" in text and "failed" not in text
    assert "1 pass of 3 planned (the others not run); a ratio is per pass" in text
    title = _rok_plot.plot_series(points, summary, cuda=False, planned_passes=3)["title"]
    assert "1 pass of 3 planned (the others not run): no spread" in title and "median" not in title
    # A failure stays a failure beside them.
    samples.append({"repeat": 1, "strategy": "keep", "batch_size": 16, "status": "failed: timeout after 90 s"})
    points = _rok_summary.aggregate(samples)
    keep16 = next(p for p in points if (p["strategy"], p["batch_size"]) == ("keep", 16))
    assert (keep16["num_samples"], keep16["num_failed"], keep16["num_skipped"]) == (1, 1, 2)
    full = _rok_summary.summarize(_injected(), _rok_summary.aggregate(_injected()), None)
    assert _rok_plot.plot_series(_rok_summary.aggregate(_injected()), full, cuda=False, planned_passes=3)[
        "title"].endswith("median of 3 interleaved passes, bars = min..max")


def test_plot_says_when_a_policy_lies_on_keep(tmp_path):
    # Issue 30: adaptive keeping every block measures keep's activations at about keep's
    # throughput; its points and "b=" labels lay on keep's. The legend says so and its labels
    # go below its points.
    samples = [s for s in _injected() if s["strategy"] in ("keep", "recompute")]
    for r in range(3):
        for b, peak, step_s in ((4, 400, 1.03), (8, 800, 2.05), (16, 1400, 3.0)):
            samples.append(dict(_sample("adaptive", b, r, peak, step_s * (1.5 if r == 1 else 1.0)),
                                decision_tail_start=0 if b < 16 else 3, decision_num_blocks=12))
    samples = [dict(s, process_rss_peak_bytes=2 * s["activation_peak_bytes"]) for s in samples]
    points = _rok_summary.aggregate(samples)
    summary = _rok_summary.summarize(samples, points, None)
    series = _rok_plot.plot_series(points, summary, cuda=False, planned_passes=3)
    adaptive, keep = series["curve"]["adaptive"], series["curve"]["keep"]
    assert adaptive["on"] == ["keep", "keep", None] and keep["on"] == [None, None, None]
    assert adaptive["kept_every_block"] == [4, 8]
    assert adaptive["legend"] == "adaptive (kept every block at b=4, 8; on keep's points at b=4, 8)"
    assert keep["legend"] == "keep" and series["curve"]["recompute"]["on"] == [None, None, None]
    env = {"device": "cpu", "cpu": "test CPU", "num_cpus": 2, "torch": "t", "tba": "t", "transformers": "t",
           "python": "3", "command": "python benchmarks/rok_curve.py"}
    config = {"repeats": 3, "model": {"layers": 2, "hidden": 8, "seq_len": 4, "vocab": 16}, "dtype": "float32",
              "steps": 2, "warmup_steps": 1}
    drawn = _rok_plot.plot(tmp_path / "rok.png", points, summary, env, config, [])
    assert (tmp_path / "rok.png").stat().st_size > 0 and drawn["curve"]["adaptive"]["legend"] == adaptive["legend"]


def test_strategy_options():
    assert _rok_worker.cache_options(_spec(strategy="recompute")) is None
    assert _rok_worker.cache_options(_spec(strategy="keep", adaptive=True)) is None  # plain PyTorch
    assert _rok_worker.cache_options(_spec(strategy="offload-host"))["adaptive"] is False
    adaptive = _rok_worker.cache_options(_spec(strategy="adaptive"))  # tba's default policy: no adaptive option
    assert adaptive["offloader"] == "ssd" and "adaptive" not in adaptive
    assert _rok_worker.cache_options(_spec(strategy="adaptive", device="cuda"))["offloader"] == "host"
    with pytest.raises(ValueError, match="activation_budget_bytes"):
        _rok_worker.cache_options(_spec(strategy="budget"))
    budget = _rok_worker.cache_options(_spec(strategy="budget", activation_budget_bytes=1234))
    assert budget["activation_budget_bytes"] == 1234 and budget["offloader"] == "ssd"


def test_budget_is_a_fraction_of_keeps_cache_peak():
    samples = [{"repeat": 0, "strategy": "keep", "batch_size": 4, "status": "ok", "activation_peak_bytes": 1000},
               {"repeat": 0, "strategy": "keep", "batch_size": 8, "status": "failed: x"}]
    sample = _rok_schedule.Sample(0, 4, "budget")
    assert _rok_cli._budget_for(sample, samples, 0.5) == 500
    assert _rok_cli._budget_for(_rok_schedule.Sample(0, 8, "budget"), samples, 0.5) is None


def test_default_sweep_leaves_out_recompute_and_offload_only():
    args = _rok_cli._parse_args([], "tba rok")
    assert args.strategies == [s for s in _rok_worker.STRATEGIES if s != "recompute+offload"]


def test_strategy_order_and_budget_needs_keep(capsys):
    args = _rok_cli._parse_args(["--strategies", "adaptive,recompute,keep"], "tba rok")
    assert args.strategies == ["keep", "recompute", "adaptive"]
    with pytest.raises(SystemExit):
        _rok_cli._parse_args(["--strategies", "budget,offload-ssd"], "tba rok")
    assert "the budget strategy needs keep" in capsys.readouterr().err


def test_adaptive_strategy_decides_before_it_is_measured():
    row = _rok_worker.run_point(_spec(strategy="adaptive", steps=2, warmup_steps=0, batch_size=4,
                                      model=dict(layers=6, hidden=64, heads=2, seq_len=64, vocab=64)))
    assert row["status"] == "ok", row
    assert row["decision_tail_start"] is not None and row["decision_num_blocks"] == 6 and row["decision_reason"]
    assert row["warmup_steps_run"] >= tba.TensorCacheConfig().profile_step + 1 and "decision_unsettled" not in row
    # Measured steps run the settled decision: no closed-loop keep step among them. A step that
    # offloads sends stores (each ran, or was cancelled because backward needed its tensor
    # first: on a busy machine, maybe all of them); a keep step sends none. (When the decision
    # keeps every block, a store of the last offloading step that finished late counts in the
    # step it finished in, so a keep step may show one: only offloading decisions are checked.)
    assert row["decision_tail_start_per_step"] == [row["decision_tail_start"]] * 2
    if row["decision_tail_start"] > 0:
        assert len(row["cache_offloaded_bytes_per_step"]) == len(row["cache_num_cancelled_per_step"]) == 2, row
        assert all(b > 0 or c > 0 for b, c in zip(row["cache_offloaded_bytes_per_step"],
                                                  row["cache_num_cancelled_per_step"])), row


@pytest.mark.skipif(not HAS_BUDGET, reason="this tba has no activation_budget_bytes option")
def test_budget_strategy_meets_its_budget(monkeypatch):
    # A store queued or running holds its tensor in memory: on a busy machine, stores that have
    # not run would lift the peak over any budget. With at most one store in flight
    # (max_inflight_bytes=1: a save waits for the store before it), the cache's peak follows the
    # boundary whatever the machine's speed, and every step completes stores.
    options = _rok_worker.cache_options
    monkeypatch.setattr(_rok_worker, "cache_options",
                        lambda spec: None if options(spec) is None else {**options(spec), "max_inflight_bytes": 1})
    spec = _spec(model=dict(layers=6, hidden=64, heads=2, seq_len=64, vocab=64), batch_size=4, steps=2,
                 policy_offloader="host")
    keep = _rok_worker.run_point(spec)
    assert keep["status"] == "ok" and keep["activation_peak_bytes"] > 0
    budget = int(0.75 * keep["activation_peak_bytes"])
    row = _rok_worker.run_point(dict(spec, strategy="budget", activation_budget_bytes=budget))
    assert row["status"] == "ok", row
    assert row["activation_budget_bytes"] == budget and row["offloader"] == "host"
    assert len(row["cache_offloaded_bytes_per_step"]) == 2 and all(b > 0 for b in row["cache_offloaded_bytes_per_step"]), row
    assert row["cache_peak_resident_bytes"] <= budget and row["budget_met"] is True
    assert row["decision_tail_start"] is not None and "budget" in row["decision_reason"]


def test_docstring_examples_run():
    import doctest

    for module in (_rok_schedule, _rok_spread, _rok_warmup, _rok_summary, _rok_cli):
        result = doctest.testmod(module, raise_on_error=False, verbose=False)
        assert result.attempted > 0 and result.failed == 0, module.__name__


class _ScriptedCache:
    """A cache double whose decision and offloaded bytes follow a script, one entry per step."""

    def __init__(self, script):
        self.script, self.step = script, 0
        self.config = tba.TensorCacheConfig(offload_devices=("cpu",))  # profile_step 2

    @property
    def adaptive_decision(self):
        tail = self.script[self.step - 1][0] if self.step else None
        return None if tail is None else type("Decision", (), {"tail_start": tail})()

    def stats(self):
        offloaded = self.script[self.step - 1][1]
        return tba.CacheStats(num_offloaded=int(offloaded > 0), offloaded_bytes=offloaded)


class _MeasuringCache(_ScriptedCache):
    """A closed-loop decision: entries ``(tail_start, offloaded_bytes, settled_at_step)``."""

    @property
    def adaptive_decision(self):
        entry = self.script[self.step - 1] if self.step else (None,)
        if entry[0] is None:
            return None
        return type("Decision", (), {"tail_start": entry[0], "max_probe_steps": 60,
                                     "settled_at_step": entry[2]})()


class _CancellingCache(_ScriptedCache):
    """Entries ``(tail_start, offloaded_bytes, num_cancelled)``."""

    def stats(self):
        _, offloaded, cancelled = self.script[self.step - 1]
        return tba.CacheStats(num_offloaded=int(offloaded > 0), offloaded_bytes=offloaded, num_cancelled=cancelled)


def _warmup_steps(script, measured=2, strategy="adaptive", adaptive=False, cache_type=_ScriptedCache):
    # The worker's loop: warm up until _Warmup says enough, then the measured steps.
    cache = cache_type(script)
    spec = _spec(strategy=strategy, warmup_steps=1, adaptive=adaptive)
    warmup = _rok_warmup.Warmup(1, cache, _rok_worker.deciding(_rok_worker.cache_options(spec)))
    i = 0
    while i < warmup.steps + measured:
        cache.step += 1  # the step runs
        if i < warmup.steps:
            warmup.after_step(i + 1)
        i += 1
    return warmup


def test_warmup_waits_for_the_policy_to_settle():
    # Note [Warm up until the policy settles]: profile (step 2), the closed loop alternating keep
    # steps (nothing offloaded) with steps offloading [0, 11), backing off to [0, 9), settling.
    loop = [(None, 100), (11, 100), (11, 0), (11, 80), (11, 0), (11, 90), (11, 0), (9, 50), (9, 0), (9, 70),
            (9, 0), (9, 60), (9, 0), (9, 40), (9, 85)]
    warmup = _warmup_steps(loop + [(9, 85)] * 2)
    assert warmup.steps == len(loop) and not warmup.unsettled  # offloaded bytes vary; the decision held
    assert _warmup_steps([(None, 0), (3, 10), (3, 12)] + [(3, 9)] * 2).steps == 3  # the earliest: profile_step + 1
    assert _warmup_steps([(None, 10)] + [(0, 0)] * 5).steps == 3  # settled on keeping every block
    assert _warmup_steps([(None, 10)] + [(None, 10)] * 3, strategy="offload-ssd").steps == 1  # not a policy
    assert _warmup_steps([(None, 10)] + [(None, 10)] * 3, strategy="keep", adaptive=True).steps == 1
    assert _warmup_steps([(None, 10)] + [(5, 0), (5, 9), (5, 9)], strategy="offload-ssd", adaptive=True).steps == 4
    moving = _warmup_steps([(None, 10)] + [(4, 0), (4, 10)] * _rok_warmup.MAX_EXTRA_WARMUP)
    assert moving.steps == 3 + _rok_warmup.MAX_EXTRA_WARMUP and "still moving" in moving.unsettled


def test_a_step_whose_stores_were_all_cancelled_is_an_offloading_step():
    # On a busy machine backward may cancel every store of a step (it needed the tensors before
    # the stores ran): that step ran the decision like the others, not as a keep step.
    script = [(None, 10, 0), (5, 9, 0), (5, 0, 7), (5, 9, 0), (5, 9, 0)]
    assert _warmup_steps(script, cache_type=_CancellingCache).steps == 3  # settled at the earliest
    assert _rok_warmup.sent_to_offloader(tba.CacheStats(num_cancelled=1))
    assert not _rok_warmup.sent_to_offloader(tba.CacheStats(kept_bytes=100))


def test_warmup_waits_while_the_closed_loop_measures():
    # Runs of two keep steps (steps 2-3) and two offloading steps (4-5) look alike pairwise;
    # the decision's settled_at_step (None while measuring) keeps the warm-up going to step 6.
    script = [(None, 10, None), (5, 0, None), (5, 0, None), (5, 9, None), (5, 9, None)]
    warmup = _warmup_steps(script + [(5, 9, 5)] * 4, cache_type=_MeasuringCache)
    assert warmup.steps == 6 and not warmup.unsettled
    # ... as long as a check may measure: an unsettled point is the policy's fault, not the warm-up's.
    from tba.cache.policy.closed_loop import MAX_PROBE_STEPS

    assert _rok_warmup.MAX_EXTRA_WARMUP >= MAX_PROBE_STEPS + 2
