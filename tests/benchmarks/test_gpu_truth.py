"""benchmarks/gpu_truth.py: its tiny mode runs the GPU script's code on CPU (every phase and
strategy, the verdict, the archive), and its rules are checked on injected rows: a row meant
to offload that moved nothing fails, cache accounting more than 10% off the allocator is
flagged, a deciding row must state its decision."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import _truth_snapshot  # noqa: E402
import _truth_verdict as verdict  # noqa: E402

# The tiny run, with two faults planted from outside: the ssd strategy's offloader moves
# nothing (offloader="none") and recompute's set-up runs out of memory.
_DRIVER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {bench!r})
    import torch
    import _truth_run as run
    original_options, original_build = run.cache_options, run.build

    def cache_options(name, ctx):
        options = original_options(name, ctx)
        if name == "ssd":
            options = {{k: v for k, v in options.items() if k != "ssd_dirs"}}
            options["offloader"] = "none"
        return options

    def build(phase, name, ctx):
        if name == "recompute":
            raise torch.OutOfMemoryError("planted: CUDA out of memory")
        return original_build(phase, name, ctx)

    run.cache_options, run.build = cache_options, build
    import gpu_truth
    sys.exit(gpu_truth.main({argv!r}))
""")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("truth")
    argv = [str(out), "--tiny", "--steps", "5", "--warmup", "1", "--ssd-dir", str(out.parent / "ssd")]
    proc = subprocess.run([sys.executable, "-c", _DRIVER.format(bench=str(BENCH), argv=argv)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_truth.tar.gz", "summary.md"], proc.stderr[-3000:]
    with tarfile.open(out / "gpu_truth.tar.gz") as tar:
        names = tar.getnames()
        member = tar.extractfile("gpu_truth/results.json")
        assert member is not None
        results = json.load(member)
    assert {"gpu_truth/summary.md", "gpu_truth/progress.log", "gpu_truth/cache_summaries.txt",
            "gpu_truth/snapshots_skipped.txt"} <= set(names)
    return out, results, (out / "summary.md").read_text(), proc


def test_tiny_run_measures_every_strategy_and_fails_what_moved_nothing(tiny_run) -> None:
    out, results, summary, proc = tiny_run
    rows = {(r["phase"], r["name"]): r for r in results["rows"]}
    phases = {r["phase"] for r in results["rows"]}
    assert phases == {"main b8", "main b16", "hide", "compiled"}
    for phase in ("main b8", "main b16"):
        assert {name for p, name in rows if p == phase} == {"keep", "recompute", "host", "ssd", "host+ssd",
                                                             "defaults", "budget"}
        for name in ("host", "host+ssd", "budget"):
            row = rows[(phase, name)]
            assert row["status"] == "ok" and row["steps"] == 5, row
            assert row["offloaded_bytes"] > 0 and row["reloaded_bytes"] > 0, row
            # forced: every measured step sends the same blocks (a policy would skip some; a busy
            # machine may cancel a step's stores, which still sent them)
            assert all(s["num_offloaded"] + s["num_cancelled"] > 0 for s in row["samples"])
            assert row["steps_sending_nothing"] == 0
            if name != "budget":
                assert {s["blocks"] for s in row["samples"]} == {1} and row["blocks"] == "1 of 2"
            assert verdict.judge_row(row)[0] != "FAIL"
            assert row["act_peak_bytes"] > 0 and row["cache_peak_bytes"] > 0
        ssd = rows[(phase, "ssd")]  # planted: an offloader that moves nothing
        assert ssd["offloaded_bytes"] == 0 and verdict.judge_row(ssd)[0] == "FAIL"
        assert rows[(phase, "recompute")]["status"].startswith("OOM in set-up")  # planted; the run went on
        assert rows[(phase, "defaults")]["decision"].startswith("offload blocks [0, ")
        assert rows[(phase, "keep")]["act_peak_bytes"] > 0
    for name in ("compiled host", "compiled ssd"):
        assert rows[("compiled", name)]["offloaded_bytes"] > 0
    assert {name for p, name in rows if p == "hide"} == {"keep", "host", "defaults"}
    # The summary: environment header, a row per strategy with its verdict, the verdict rows.
    assert "- **device**: cpu" in summary and "- **torch**:" in summary and "gpu_truth.py" in summary
    assert "| ssd | FAIL |" in summary and "moved 0 bytes" in summary
    assert "| recompute | ERROR |" in summary
    assert "| no row meant to offload moved nothing; every deciding row stated its decision | FAIL | " \
           "main b8/ssd, main b16/ssd |" in summary
    assert "planner (before the run" in summary and "measured: host forced step" in summary
    assert "[gpu_truth" in proc.stdout and proc.returncode == 1


def _row(**kw) -> dict:
    base = dict(phase="p", name="host", status="ok", meant_to_offload=True, tba=True, decides=False, steps=5,
                step_s=1.0, act_peak_bytes=100, cache_peak_bytes=100, offloaded_bytes=10, reloaded_bytes=10,
                blocks="11 of 12", stall_s=0.0, decision=None)
    return {**base, **kw}


def test_zero_bytes_moved_fails_and_accounting_off_is_flagged() -> None:
    assert verdict.judge_row(_row()) == ("ok", [])
    status, why = verdict.judge_row(_row(offloaded_bytes=0, reloaded_bytes=0))
    assert status == "FAIL" and "moved 0 bytes" in why[0]
    assert verdict.judge_row(_row(reloaded_bytes=0))[0] == "FAIL"
    status, why = verdict.judge_row(_row(steps_sending_nothing=2))  # some steps kept everything
    assert status == "FAIL" and why == ["sent nothing to the offloader in 2 of 5 measured steps"]
    status, why = verdict.judge_row(_row(steps_all_cancelled=1))  # sent, but every store cancelled
    assert status == "FLAG" and why == ["every store cancelled in 1 of 5 measured steps (backward needed the tensors first)"]
    assert verdict.judge_row(_row(cache_peak_bytes=109))[0] == "ok"
    status, why = verdict.judge_row(_row(cache_peak_bytes=111))
    assert status == "FLAG" and "1.11x" in why[0]
    assert verdict.judge_row(_row(cache_peak_bytes=89))[0] == "FLAG"
    assert verdict.judge_row(_row(name="defaults", meant_to_offload=False, decides=True, offloaded_bytes=0))[0] == "FAIL"
    assert verdict.judge_row(_row(name="defaults", meant_to_offload=False, decides=True, offloaded_bytes=0,
                                  reloaded_bytes=0, decision="keep every block: over 5%"))[0] == "ok"
    assert verdict.judge_row(_row(status="OOM in measured step 0: ..."))[0] == "ERROR"
    # keep is not judged on the cache's count or bytes moved
    assert verdict.judge_row(_row(name="keep", meant_to_offload=False, tba=False, cache_peak_bytes=None,
                                  offloaded_bytes=None))[0] == "ok"


def test_targets() -> None:
    keep = _row(name="keep", meant_to_offload=False, tba=False, cache_peak_bytes=None)
    decided = dict(name="defaults", meant_to_offload=False, decides=True, decision="offload blocks [0, 3)")
    rows = [keep, _row(act_peak_bytes=40, cache_peak_bytes=40), _row(step_s=1.04, **decided)]
    got = {t: (s, d) for t, s, d in verdict.target_rows(rows, ["p"])}
    assert got["p: host forced <= 0.4x keep's activation peak"][0] == "PASS"
    assert got["p: defaults <= 1.05x keep's step time, decision stated"][0] == "PASS"
    assert got["cache accounting within 10% of the allocator on every tba row"][0] == "PASS"
    rows = [keep, _row(act_peak_bytes=41, cache_peak_bytes=30), _row(step_s=1.04, **dict(decided, decision=None))]
    got = {t: (s, d) for t, s, d in verdict.target_rows(rows, ["p"])}
    assert got["p: host forced <= 0.4x keep's activation peak"][0] == "FAIL"
    assert got["p: defaults <= 1.05x keep's step time, decision stated"][0] == "FAIL"
    assert got["cache accounting within 10% of the allocator on every tba row"][0] == "FAIL"
    assert got["no row meant to offload moved nothing; every deciding row stated its decision"][0] == "FAIL"
    # a host row that moved nothing cannot pass the peak target, whatever its peak
    rows = [keep, _row(act_peak_bytes=10, cache_peak_bytes=10, offloaded_bytes=0)]
    assert verdict.target_rows(rows, ["p"])[0][1] == "FAIL"
    assert verdict.target_rows([keep], ["p"])[0][1] == "SKIP"


def test_snapshot_timeline_replays_allocs_and_completed_frees() -> None:
    snapshot = {"device_traces": [[
        {"action": "alloc", "size": 100, "time_us": 1000},
        {"action": "segment_alloc", "size": 4096, "time_us": 1001},
        {"action": "alloc", "size": 50, "time_us": 2000},
        {"action": "free_requested", "size": 100, "time_us": 2500},
        {"action": "free_completed", "size": 100, "time_us": 3000},
    ]]}
    times, allocated = _truth_snapshot.timeline(snapshot, start_bytes=10)
    assert times == [0.0, 1.0, 2.0] and allocated == [110, 160, 60]
    assert _truth_snapshot.timeline({"device_traces": []}, 5) == ([], [])


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _fake_runner(name: str, clock: _Clock, step_s: float):
    import types

    import _truth_run as run

    def forward(input_ids, labels):
        clock.now += step_s
        return types.SimpleNamespace(loss=types.SimpleNamespace(backward=lambda: None))

    optimizer = types.SimpleNamespace(step=lambda: None, zero_grad=lambda set_to_none: None)
    r = run.Runner("p", name, model=object(), forward=forward, optimizer=optimizer)
    r.warmup.append({"time_s": step_s})
    return r


def test_a_slow_strategy_spends_its_own_time_share(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import _truth_run as run

    clock = _Clock()
    monkeypatch.setattr(run.time, "perf_counter", clock)
    # 5 bytes held before each step (weights, optimizer state), 12 at the step's peak: 7 of activations
    mem = types.SimpleNamespace(synchronize=lambda: None, reset_peak=lambda: None, allocated_bytes=lambda: 5,
                                peak_allocated_bytes=lambda: 12)
    fast, slow = _fake_runner("host", clock, 0.1), _fake_runner("ssd", clock, 10.0)
    run.measure([fast, slow], ids=None, mem=mem, steps=6, deadline=clock.now + 30, log=lambda line: None)  # type: ignore[arg-type]
    assert len(fast.samples) == 6 and len(slow.samples) == 1  # share 15 s: a second 10 s step would overrun it
    assert slow.notes == ["1 measured steps (fewer than 5: its time share, 15 s, was spent)"] and not fast.notes
    assert [(s["act_peak_bytes"], s["before_bytes"]) for s in fast.samples] == [(7, 5)] * 6
    late = _fake_runner("keep", clock, 0.1)
    run.measure([late], ids=None, mem=mem, steps=6, deadline=clock.now - 1, log=lambda line: None)  # type: ignore[arg-type]
    assert late.samples == [] and run.row(late, 2)["status"] == "no measured step (time budget)"


@pytest.mark.parametrize("gpu_gib", [80, 141])
def test_gpu_phases_fit_the_device_and_keep_dominates(gpu_gib: int) -> None:
    """The GPU sizes, chosen on CPU: every eager strategy's model plus keep's planned
    activations (x1.3) fit in 85% of the device; keep's activations are 20-30 GiB at the
    larger batch; the hide configuration is one the planner expects to hide (>= 80%)."""
    from _truth_phases import GIB, accounting, plan_phases, shape_of, state_bytes
    from _truth_run import EAGER

    from tba import plan

    total = gpu_gib * 10**9
    phases, notes = plan_phases(True, total, plan.HOST_LINKS["pcie5"], plan.GPU_PEAK_FLOPS["h100"])
    assert [p.name.split()[0] for p in phases] == ["main", "main", "hide", "compiled"]
    small, big, hide, compiled = phases
    per_sample = plan.activation_bytes(shape_of(big.model), 1, accounting(big.model, True))
    assert 20 * GIB <= big.batch * per_sample <= 30 * GIB and small.batch == big.batch // 2
    assert len(EAGER) * state_bytes(big.model, True) + 1.3 * big.batch * per_sample <= 0.85 * total
    assert big.batch * per_sample > 2 * state_bytes(big.model, True)  # activations are most of the peak
    assert hide.prediction is not None and hide.prediction["fraction_hidden"] >= 0.8
    assert 3 * state_bytes(hide.model, True) + 1.5 * hide.prediction["planned_activation_bytes"] < 0.8 * total
    assert compiled.model["layers"] == 3 and compiled.strategies == ("compiled keep", "compiled host", "compiled ssd")
    assert any("planner predicts" in n for n in notes)


@pytest.mark.gpu
def test_snapshot_timeline_matches_the_allocator_on_cuda(tmp_path: Path) -> None:
    import torch

    from tests.conftest import require_cuda

    require_cuda()
    from _truth_memory import CudaMemoryStats

    mem = CudaMemoryStats()
    mem.synchronize()
    before = mem.allocated_bytes()
    mem.reset_peak()

    def step() -> None:
        a = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        b = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
        del a, b

    snapshot, start = _truth_snapshot.record_step(step, tmp_path / "s.pickle")
    _, allocated = _truth_snapshot.timeline(snapshot, start)
    assert max(allocated) - start == 96 << 20 == mem.peak_allocated_bytes() - before
    assert (tmp_path / "s.pickle").stat().st_size > 0


def test_archive_leaves_out_the_largest_snapshots_over_its_limit(tmp_path: Path) -> None:
    import gpu_truth

    files = tmp_path / "gpu_truth"
    files.mkdir()
    (files / "summary.md").write_text("table\n")
    for name, size in (("snapshot_keep.pickle", 300_000), ("snapshot_host.pickle", 200_000)):
        (files / name).write_bytes(os.urandom(size))  # incompressible
    archive = tmp_path / "a.tar.gz"
    assert gpu_truth.write_archive(files, archive, 1 << 20) == []
    dropped = gpu_truth.write_archive(files, archive, 250_000)
    assert dropped == ["snapshot_keep.pickle (0.3 MiB)"] and archive.stat().st_size <= 250_000
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert "gpu_truth/snapshot_host.pickle" in names and "gpu_truth/archive_dropped.txt" in names
    assert "gpu_truth/snapshot_keep.pickle" not in names


def test_trim_frames_keeps_the_innermost_frames() -> None:
    frames = [{"name": f"f{i}"} for i in range(30)]
    snapshot = {"device_traces": [[{"action": "alloc", "size": 1, "frames": list(frames)}]],
                "segments": [{"blocks": [{"size": 1, "frames": list(frames)}]}]}
    _truth_snapshot.trim_frames(snapshot, max_frames=3)
    assert snapshot["device_traces"][0][0]["frames"] == frames[:3]
    assert snapshot["segments"][0]["blocks"][0]["frames"] == frames[:3]


def test_a_run_killed_mid_way_leaves_the_phases_it_finished(tmp_path: Path) -> None:
    # SIGKILL (no handler runs) when the second phase starts building: the first phase's
    # summary and archive were written when it ended.
    driver = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(BENCH)!r})
        import _truth_run as run
        original = run.build

        def build(phase, name, ctx):
            if phase == "main b16":
                os.kill(os.getpid(), signal.SIGKILL)
            return original(phase, name, ctx)

        run.build = build
        import gpu_truth
        gpu_truth.main([{str(tmp_path)!r}, "--tiny", "--phases", "main", "--steps", "2", "--warmup", "1",
                        "--ssd-dir", {str(tmp_path / "ssd")!r}])
    """)
    (tmp_path / "tmp").mkdir()  # the killed run's staging folder stays there, not in /tmp
    proc = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    assert proc.returncode == -9, proc.stderr[-2000:]
    summary = (tmp_path / "summary.md").read_text()
    assert "## main b8:" in summary and "## main b16" not in summary
    assert "(written after a phase: the run had not finished)" in summary
    with tarfile.open(tmp_path / "gpu_truth.tar.gz") as tar:
        member = tar.extractfile("gpu_truth/results.json")
        assert member is not None
        assert {r["phase"] for r in json.load(member)["rows"]} == {"main b8"}
