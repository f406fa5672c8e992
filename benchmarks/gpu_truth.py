#!/usr/bin/env python
"""The GPU truth in one run: every memory figure from the allocator, forced and default
policies side by side, and no row that passes on a run that moved nothing.

    bash benchmarks/gpu_truth.sh OUT_DIR                 # on the GPU machine: install, then this
    python benchmarks/gpu_truth.py OUT_DIR               # this alone (tba importable)
    python benchmarks/gpu_truth.py OUT_DIR --tiny        # the same code on CPU in seconds (tests)

Leaves two files in OUT_DIR: ``summary.md`` (environment, one table per phase, verdict rows)
and ``gpu_truth.tar.gz`` (summary, results.json with every step, progress log, the caches'
summaries, the CUDA memory snapshots of one keep and one forced-host step and their PNG).

Per step: ``reset_peak_memory_stats()`` before, ``max_memory_allocated()`` after, minus
``memory_allocated()`` before (weights, gradients and AdamW state of every live model: the
optimizer stepped once at set-up so its state exists) = the step's activation peak. Phases:
the main job's GPT-2 at two batch sizes (keep, recompute, host / ssd / host+ssd forced with
``adaptive=False``, tba defaults, budget mode at 50% of keep's peak), a configuration the
planner expects to hide (keep, host forced, defaults; prediction beside measurement), and
compiled keep (Inductor) vs ``backend="tba"`` host and ssd forced. In a phase every strategy
is its own model, warmed up (the pool grown, a policy's decision settled) and then measured one
step of each in turn; step time is the median. The time budget (``--budget-s``) is shared out
over the phases, so the run ends in time; a strategy that raises is its row's status.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))  # tba from this checkout when not installed

import torch  # noqa: E402

import _truth_run as run  # noqa: E402
import _truth_snapshot as snap  # noqa: E402
import _truth_verdict as verdict  # noqa: E402
from _environment import command_line, describe  # noqa: E402
from _truth_memory import CudaMemoryStats, MemoryStats, ProcessHeap, describe_source  # noqa: E402
from _truth_phases import Phase, accounting, plan_phases, predict_hide, shape_of  # noqa: E402
from tba import plan  # noqa: E402

GIB = 2**30


class Progress:
    def __init__(self, path: Path) -> None:
        self.start = time.perf_counter()
        self.path = path

    def __call__(self, line: str) -> None:
        text = f"[gpu_truth {time.perf_counter() - self.start:5.0f}s] {line}"
        print(text, flush=True)
        with open(self.path, "a") as f:
            f.write(text + "\n")


def _filesystem(path: str) -> str:
    """The mount and filesystem type ``path`` lies on (from /proc/mounts)."""
    best = ("?", "?")
    try:
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, fstype = line.split()[:3]
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[0]):
                    best = (mount, fstype)
    except OSError:
        pass
    return f"{best[1]} at {best[0]}"


def run_phase(phase: Phase, args: argparse.Namespace, mem: MemoryStats, files: Path, log: Progress,
              deadline: float) -> list[dict[str, Any]]:
    cuda = args.device == "cuda"
    planned = plan.activation_bytes(shape_of(phase.model), phase.batch, accounting(phase.model, cuda))
    ctx = run.Context(device=args.device, dtype="bfloat16" if cuda else "float32", model=phase.model,
                      batch=phase.batch, tiny=args.tiny, ssd_dir=args.ssd_dir,
                      min_offload_bytes=(1 << 20) if cuda else 16 << 10, host_budget_bytes=max(1 << 20, planned // 2),
                      inner="inductor" if cuda else "aot_eager")
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, phase.model["vocab"], (phase.batch, phase.model["seq_len"]), generator=g).to(args.device)
    log(f"phase {phase.name}: model {phase.model}, batch {phase.batch}, {len(phase.strategies)} strategies, "
        f"{deadline - time.perf_counter():.0f} s")
    runners: list[run.Runner] = []
    start = time.perf_counter()
    # Warm-up gets 55% of the phase; a deciding policy (defaults, budget) twice a fixed row's
    # share: its decision settles over a profile and a closed-loop check of several steps.
    weights = {name: 2 if name in run.DECIDES else 1 for name in phase.strategies}
    warm_unit = 0.55 * (deadline - start) / sum(weights.values())
    for name in phase.strategies:
        r = run.Runner(phase.name, name)
        if time.perf_counter() > deadline:
            r.status = "not run: the phase's time budget was spent"
        else:
            def setup(r: run.Runner = r, name: str = name) -> None:
                built = run.build(phase.name, name, ctx)
                r.model, r.forward, r.optimizer, r.cache, r.notes = (built.model, built.forward, built.optimizer,
                                                                       built.cache, built.notes)
                run.warm_up(r, ids, mem, args.warmup, min(deadline, time.perf_counter() + warm_unit * weights[name]))

            if run.guarded(r, "set-up and warm-up", setup, log):
                w = r.warmup[-1]
                log(f"{phase.name}/{name}: warmed up in {len(r.warmup)} steps, last {w['time_s'] * 1e3:.0f} ms, "
                    f"activation peak {w['act_peak_bytes'] / GIB:.3f} GiB"
                    + (f", offloaded {w['offloaded_bytes'] / GIB:.3f} GiB" if "offloaded_bytes" in w else ""))
        if name in ("keep", "compiled keep") and r.ok and len(r.warmup) < 2:
            # budget mode's 50% is of a warm step's peak (the first one allocates once-only buffers)
            def warm_step(r: run.Runner = r) -> None:
                r.warmup.append(run.timed_step(r, ids, mem))

            run.guarded(r, "warm-up", warm_step, log)
        if name in ("keep", "compiled keep") and r.ok:
            peak = r.warmup[-1]["act_peak_bytes"]
            if not cuda or peak <= 0:  # RSS is noisy: a spike must not lift the budget over what keep saves
                peak = min(peak, planned) if peak > 0 else planned
            ctx.budget_bytes = max(1, peak // 2)
        runners.append(r)
    run.measure(runners, ids, mem, args.steps, deadline, log)
    if phase.snapshot:
        _snapshots(runners, ids, mem, files, log, cuda)
    for r in runners:
        run.release(r)
    num_blocks = phase.model["layers"]
    rows = [run.row(r, num_blocks) for r in runners]
    for r, row in zip(runners, rows):
        if r.traceback:
            row["traceback"] = r.traceback
        moved = f", out {row.get('offloaded_bytes', 0) / GIB:.3f} GiB, back {row.get('reloaded_bytes', 0) / GIB:.3f} GiB, " \
                f"blocks {row.get('blocks')}" if row["tba"] else ""
        log(f"{phase.name}/{r.name}: {verdict.judge_row(row)[0]} {row['status']}, {row['steps']} steps, "
            f"median {row.get('step_s', float('nan')) * 1e3:.1f} ms, activation peak "
            f"{row.get('act_peak_bytes', 0) / GIB:.3f} GiB{moved}")
    if phase.prediction is not None:
        keep = next((x for x in rows if x["name"] == "keep" and x.get("step_s")), None)
        if keep is not None:
            phase.prediction["with_measured_keep_step"] = predict_hide(
                phase.model, phase.batch, cuda, args.host_link, args.peak_flops, step_time_s=keep["step_s"])
    return rows


def _snapshots(runners: list[run.Runner], ids: torch.Tensor, mem: MemoryStats, files: Path, log: Progress,
               cuda: bool) -> None:
    if not cuda:
        (files / "snapshots_skipped.txt").write_text("no CUDA device: torch.cuda.memory snapshots need the CUDA allocator\n")
        log("snapshots skipped: no CUDA device")
        return
    curves = {}
    for r in runners:
        if r.name in ("keep", "host") and r.ok:
            path = files / f"snapshot_{r.name}.pickle"

            def step(r: run.Runner = r) -> None:
                run.timed_step(r, ids, mem)

            try:  # a snapshot that fails is a note: the strategy's measured row stands
                s, start = snap.record_step(step, path)
                curves[r.name] = snap.timeline(s, start)
                log(f"snapshot of one {r.name} step: {path.name} ({path.stat().st_size / 2**20:.1f} MiB)")
            except Exception as e:
                r.notes.append(f"memory snapshot failed: {type(e).__name__}: {run.one_line(e)}")
                log(f"{r.phase}/{r.name}: {r.notes[-1]}")
    try:
        if curves:
            snap.plot(curves, files / "allocated_over_step.png", "allocated bytes over one step: keep vs host forced")
    except Exception as e:  # matplotlib missing or failing: the snapshots are in the archive anyway
        log(f"no PNG: {type(e).__name__}: {run.one_line(e)}")


def summary_text(env: dict[str, Any], rows: list[dict[str, Any]], phases: list[Phase], notes: list[str],
                 mem_source: str) -> str:
    lines = ["# tba GPU truth", "", *(f"- **{k}**: {v}" for k, v in env.items()), f"- **memory**: {mem_source}",
             *(f"- {n}" for n in notes), ""]
    for p in phases:
        lines += [f"## {p.name}: {p.model['layers']} x {p.model['hidden']}, seq {p.model['seq_len']}, batch {p.batch}",
                  "", verdict.format_table(rows, p.name), ""]
        base = [r["baseline_bytes"] for r in rows if r["phase"] == p.name and r.get("baseline_bytes") is not None]
        if base:
            lines += [f"allocated before each step (weights, gradients, optimizer state of the {len(p.strategies)} "
                      f"live models): {min(base) / GIB:.2f}-{max(base) / GIB:.2f} GiB", ""]
        if p.prediction is not None:
            pr = p.prediction
            lines.append(f"planner (before the run, {pr['step_time_source']}): {pr['fraction_hidden']:.0%} of "
                         f"{pr['planned_activation_bytes'] / GIB:.2f} GiB written within half the step over {pr['host_link']}")
            m = pr.get("with_measured_keep_step")
            if m:
                lines.append(f"planner with keep's measured step ({m['step_time_s'] * 1e3:.1f} ms): "
                             f"{m['fraction_hidden']:.0%} hidden")
            got = {r["name"]: r for r in rows if r["phase"] == p.name}
            if got.get("keep", {}).get("step_s") and got.get("host", {}).get("step_s"):
                lines.append(f"measured: host forced step {got['host']['step_s'] / got['keep']['step_s']:.3f}x keep's, "
                             f"stall {got['host'].get('stall_s', 0) * 1e3:.1f} ms per step")
            lines.append("")
    lines += ["## Verdict", "", "| target | result | detail |", "|---|---|---|"]
    lines += [f"| {t} | {s} | {d} |" for t, s, d in verdict.target_rows(rows, [p.name for p in phases if p.name.startswith("main")])]
    return "\n".join(lines) + "\n"


def write_archive(files: Path, path: Path, limit_bytes: int) -> list[str]:
    """``files`` as a tar.gz at ``path``; while it is over ``limit_bytes``, the largest memory
    snapshot is left out (named in ``archive_dropped.txt``). Returns the names left out."""
    dropped: list[str] = []
    while True:
        with tarfile.open(path, "w:gz") as tar:
            tar.add(files, arcname="gpu_truth")
        snapshots = sorted(files.glob("snapshot_*.pickle"), key=lambda f: f.stat().st_size)
        if path.stat().st_size <= limit_bytes or not snapshots:
            return dropped
        biggest = snapshots[-1]
        dropped.append(f"{biggest.name} ({biggest.stat().st_size / 2**20:.1f} MiB)")
        biggest.unlink()
        (files / "archive_dropped.txt").write_text("\n".join(dropped) + "\n")


def _stop(signum: int, frame: object) -> None:
    """SIGTERM (the shell line's timeout): stop measuring; ``main`` still writes the archive."""
    raise SystemExit("SIGTERM: the run's time limit; writing what was measured")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output folder: summary.md and gpu_truth.tar.gz")
    p.add_argument("--tiny", action="store_true", help="a tiny GPT-2 on CPU, memory from process RSS (the tests)")
    p.add_argument("--budget-s", type=float, default=None, help="time for the measurements (default 390; tiny 120)")
    p.add_argument("--steps", type=int, default=6, help="measured steps per strategy (at least 5 when time allows)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps (a deciding policy takes more)")
    p.add_argument("--phases", default="main,hide,compiled", help="comma-separated from main, hide, compiled")
    p.add_argument("--archive-mib", type=float, default=15.0,
                   help="most MiB of the archive (the GPU machine returns files up to 16 MiB): snapshots left out above")
    p.add_argument("--attach", action="append", default=[], help="a file to put in the archive (the install log)")
    p.add_argument("--ssd-dir", default=os.environ.get("TBA_SSD_DIR"), help="SSD offloader directory (TBA_SSD_DIR)")
    args = p.parse_args(argv)
    args.device = "cpu" if args.tiny else "cuda"
    if not args.tiny and not torch.cuda.is_available():
        p.error("no CUDA device (torch.cuda.is_available() is False); use --tiny for the CPU run")
    args.budget_s = max(30.0, args.budget_s or (120.0 if args.tiny else 390.0))
    args.phases = {x.strip() for x in args.phases.split(",") if x.strip()}
    return args


def publish(out: Path, files: Path, env: dict[str, Any], rows: list[dict[str, Any]], phases: list[Phase],
            notes: list[str], args: argparse.Namespace, source: str, final: bool) -> str:
    """Write ``summary.md`` and ``gpu_truth.tar.gz`` into ``out`` from what was measured so far
    (after every phase too: a run killed later still leaves the phases it finished)."""
    done = {r["phase"] for r in rows}
    text = summary_text(env, rows, [p for p in phases if final or p.name in done], notes, source)
    if not final:
        text += "\n(written after a phase: the run had not finished)\n"
    (files / "summary.md").write_text(text)
    summaries = "\n\n".join(f"== {r['phase']}/{r['name']}\n{r.get('summary') or '(no cache)'}" for r in rows)
    (files / "cache_summaries.txt").write_text(summaries + "\n")
    (files / "results.json").write_text(json.dumps({"environment": env, "notes": notes, "rows": rows,
                                                    "phases": [vars(p) for p in phases]}, indent=1, default=str))
    for extra in args.attach:
        if os.path.isfile(extra):
            shutil.copy(extra, files / os.path.basename(extra))
    dropped = write_archive(files, out / "gpu_truth.tar.gz.part", int(args.archive_mib * 2**20))
    os.replace(out / "gpu_truth.tar.gz.part", out / "gpu_truth.tar.gz")
    if dropped:
        text += f"\nArchive over {args.archive_mib} MiB: left out {', '.join(dropped)}.\n"
    (out / "summary.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    files = Path(tempfile.mkdtemp(prefix="tba_truth_")) / "gpu_truth"  # out gets the two files alone
    files.mkdir()
    log = Progress(files / "progress.log")
    signal.signal(signal.SIGTERM, _stop)
    rows: list[dict[str, Any]] = []
    phases: list[Phase] = []
    cuda = args.device == "cuda"
    env: dict[str, Any] = describe(args.device)
    env["command"] = command_line([__file__, *(sys.argv[1:] if argv is None else argv)])
    if os.environ.get("TBA_TRUTH_LAUNCHER"):
        env["launched by"] = os.environ["TBA_TRUTH_LAUNCHER"]
    env.update(cuda=torch.version.cuda, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    notes: list[str] = []
    mem: MemoryStats = CudaMemoryStats() if cuda else ProcessHeap()
    try:
        args.ssd_dir = args.ssd_dir or str(files.parent / "ssd")
        os.makedirs(args.ssd_dir, exist_ok=True)
        env["ssd_dir"] = f"{args.ssd_dir} ({_filesystem(args.ssd_dir)})"
        if _filesystem(args.ssd_dir).split()[0] in ("tmpfs", "overlay", "ramfs"):
            notes.append(f"the SSD directory is on {_filesystem(args.ssd_dir)}: the ssd rows measure "
                         "memory behind a file system, not a drive (set TBA_SSD_DIR to an NVMe mount)")
        if cuda:
            try:
                args.host_link = plan.measure_host_link()
            except Exception as e:  # the planner's prediction then uses PCIe 5's nominal rate
                args.host_link = plan.HOST_LINKS["pcie5"]
                notes.append(f"host link not measured ({type(e).__name__}: {run.one_line(e)}); planner uses "
                             f"{args.host_link.name}")
            name = torch.cuda.get_device_name().lower()
            args.peak_flops = next((v for k, v in plan.GPU_PEAK_FLOPS.items() if k in name), plan.GPU_PEAK_FLOPS["h100"])
            total = torch.cuda.get_device_properties(0).total_memory
        else:
            args.host_link, args.peak_flops, total = plan.HostLink(name="CPU stand-in", bytes_per_s=1e9), 1e11, 0
            torch.set_num_threads(1)
        env["host_link"] = f"{args.host_link.name} {args.host_link.bytes_per_s / 1e9:.1f} GB/s"
        phases, phase_notes = plan_phases(cuda, total, args.host_link, args.peak_flops, args.phases)
        notes += phase_notes
        for n in notes:
            log(n)
        start, budget = time.perf_counter(), args.budget_s
        for i, p in enumerate(phases):
            left = budget - (time.perf_counter() - start)
            share = left * p.share / sum(q.share for q in phases[i:]) if left > 0 else 0
            rows += run_phase(p, args, mem, files, log, time.perf_counter() + share)
            if i + 1 < len(phases):
                publish(out, files, env, rows, phases, notes, args, describe_source(mem), final=False)
        log(f"measured in {time.perf_counter() - start:.0f} s of {budget:.0f} s")
    except BaseException as e:  # the archive always comes back, with what was measured
        notes.append(f"RUN STOPPED: {type(e).__name__}: {run.one_line(e)}")
        log(notes[-1])
    finally:
        text = publish(out, files, env, rows, phases, notes, args, describe_source(mem), final=True)
        shutil.rmtree(files.parent, ignore_errors=True)
        print(text, flush=True)
    failed = any(s == "FAIL" for _, s, _ in verdict.target_rows(rows, [p.name for p in phases if p.name.startswith("main")]))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
