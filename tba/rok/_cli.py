"""Command line of the ROK sweep: ``tba rok`` and ``benchmarks/rok_curve.py`` (private module)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tba.rok import _plot, _report, _summary
from tba.rok._runner import MMAP_THRESHOLD, Interrupted, Progress, Runner, raise_interrupted
from tba.rok._schedule import Sample, interleaved
from tba.rok._spread import NOISE_FLOOR
from tba.rok._worker import STRATEGIES

# The default sweep: every strategy but recompute+offload (a combination whose answer the
# figure already gives: recompute's memory, the SSD's cost), so that the main job stays within
# 5 minutes on 2 cores, set-up included.
DEFAULT_STRATEGIES = tuple(s for s in STRATEGIES if s != "recompute+offload")

__all__ = ["main"]

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the checkout, when tba runs from one

# GPT-2 shapes: activations dominate (narrow, deep, small vocabulary). On CPU 6 blocks: the
# adaptive policy's closed loop runs ~20 steps per sample, and the main job must stay within 5
# minutes on 2 cores, set-up included.
_CPU_MODEL = dict(layers=6, hidden=128, heads=4, seq_len=128, vocab=1024)
_QUICK_MODEL = dict(layers=2, hidden=64, heads=2, seq_len=32, vocab=128)


def _cuda_model(gpu_memory_bytes: int) -> dict[str, int | str]:
    """A GPT sized to the GPU: bf16 weights+grads+AdamW take ~1/6 of memory, activations the rest."""
    gib = gpu_memory_bytes / 2**30
    if gib >= 70:
        return dict(layers=12, hidden=2048, heads=16, seq_len=1024, vocab=32768, attn_implementation="sdpa")
    if gib >= 30:
        return dict(layers=8, hidden=1536, heads=12, seq_len=1024, vocab=32768, attn_implementation="sdpa")
    return dict(layers=6, hidden=1024, heads=8, seq_len=1024, vocab=32768, attn_implementation="sdpa")


def _cpu_threads(quick: bool) -> int:
    """Compute threads on CPU: one core is left to tba's store/load threads (on a GPU machine
    compute is on the GPU and the CPU is free for I/O); on 2 cores, 2 compute threads starve
    the writer, and OpenMP barriers stall whenever a core is taken."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 1 if quick else max(1, cores - 1)


def _parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description="ROK curve: activation peak vs model throughput for Recompute, "
                                                       "Offload and Keep.",
                                epilog="Method: docs/rok.md (and the docstring of tba.rok).")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                   help=f"comma-separated, from {', '.join(STRATEGIES)} (default: all but recompute+offload; run "
                        f"in this order, keep first)")
    p.add_argument("--batch-sizes", help="comma-separated micro-batch sizes (default: 1,2,4,8 on CPU, "
                                         "2,4,8,16,32 on CUDA, 1,2 with --quick)")
    p.add_argument("--out", default=str(Path("out") / "rok"),
                   help="output directory (default out/rok in the working directory; figures worth keeping go "
                        "under benchmarks/results/)")
    p.add_argument("--quick", action="store_true", help="tiny model and few steps (smoke test)")
    p.add_argument("--budget-bytes", type=int, help="activation budget of the summary's 'throughput at equal "
                                                   "budget' (default: keep's peak at its median batch)")
    p.add_argument("--budget-fraction", type=float, default=0.5,
                   help="the budget strategy's activation_budget_bytes as a fraction of keep's activation peak "
                        "at the same batch (default 0.5)")
    p.add_argument("--repeats", type=int, help="samples per point, taken in interleaved passes (default 3; 2 with "
                                               "--quick)")
    p.add_argument("--steps", type=int, help="measured steps per sample (default 2)")
    p.add_argument("--warmup", type=int, help="warm-up steps per sample (default 1; policy strategies run until "
                                              "their decision holds)")
    g = p.add_argument_group("model (GPT-2 config; defaults depend on --device/--quick)")
    for name in ("layers", "hidden", "heads", "seq_len", "vocab"):
        g.add_argument("--" + name.replace("_", "-"), dest=name, type=int)
    c = p.add_argument_group("tba cache options")
    c.add_argument("--min-offload-bytes", type=int, help="default 64 KiB on CPU, 1 MiB on CUDA, 16 KiB with --quick")
    c.add_argument("--keep-last-modules", type=int, default=1)
    c.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=False,
                   help="adaptive offloading for the fixed strategies offload-host, offload-ssd, "
                        "recompute+offload (default off: they offload every block but the kept tail; the "
                        "'adaptive' strategy is tba's default policy)")
    c.add_argument("--ssd-dir", help="directory for offload-ssd (default: TBA_SSD_DIR, else the temp dir)")
    p.add_argument("--num-threads", type=int, help="torch threads per worker (default: CPU cores - 1 on CPU, leaving "
                                                   "a core to tba's I/O threads; 1 with --quick; torch's on CUDA)")
    p.add_argument("--timeout-s", type=float, help="per point (default 300 CPU, 420 CUDA)")
    p.add_argument("--time-budget-s", type=float, help="skip the remaining points after this long")
    args = p.parse_args(argv)
    chosen = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in chosen if s not in STRATEGIES]
    if bad or not chosen:
        p.error(f"unknown strategies {bad}; choose from {', '.join(STRATEGIES)}")
    args.strategies = [s for s in STRATEGIES if s in chosen]  # keep first: see Note [Interleaved samples]
    if "budget" in args.strategies and "keep" not in args.strategies:
        p.error("the budget strategy needs keep (its budget is a fraction of keep's measured peak): add keep to "
                "--strategies")
    if (args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 0):
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be >= 1")
    if not 0 < args.budget_fraction <= 1:
        p.error(f"--budget-fraction must be in (0, 1], got {args.budget_fraction}")
    if args.batch_sizes:
        try:
            args.batch_sizes = sorted({int(x) for x in args.batch_sizes.split(",") if x.strip()})
        except ValueError:
            p.error(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
        if not args.batch_sizes or min(args.batch_sizes) < 1:
            p.error("--batch-sizes must be positive integers")
    return args


def _git_commit() -> str | None:
    """The commit of the checkout tba runs from (None when installed from a wheel)."""
    try:
        out = subprocess.run(["git", "-C", str(_PACKAGE_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _budget_for(sample: Sample, samples: list[dict[str, Any]], fraction: float) -> int | None:
    """The budget strategy's ``activation_budget_bytes`` at this batch: ``fraction`` of keep's
    activation peak at the same batch as tba counts it (an exact count, the same in every pass;
    the unit the cache enforces its budget in, also where the x-axis is the allocator's)."""
    peaks = [r.get("counted_activation_peak_bytes") or r["activation_peak_bytes"] for r in samples
             if r["strategy"] == "keep" and r["batch_size"] == sample.batch_size and r.get("status") == "ok"
             and (r.get("counted_activation_peak_bytes") or r.get("activation_peak_bytes"))]
    return int(fraction * peaks[0]) if peaks else None


def public_command(prog: str, given: list[str]) -> str:
    """The command line as the outputs show it: absolute paths (an output or SSD directory)
    become ``DIR``, so nothing machine-specific is printed into a figure worth committing.

    Example:
        >>> public_command("tba rok", ["--out", "/tmp/rok", "--ssd-dir=/mnt/nvme", "--quick"])
        'tba rok --out DIR --ssd-dir=DIR --quick'
    """
    shown = []
    for arg in given:
        name, eq, value = arg.partition("=")
        shown.append(f"{name}=DIR" if eq and os.path.isabs(value) else "DIR" if os.path.isabs(arg) else arg)
    return " ".join([prog, *([shlex.join(shown)] if shown else [])])


def main(argv: list[str] | None = None, *, prog: str = "tba rok") -> int:
    """Runs the sweep (``tba rok --help``); returns the exit status (3: interrupted, partial results)."""
    t_main = time.perf_counter()
    args = _parse_args(argv, prog)
    missing = [m for m in ("transformers", "matplotlib", "tqdm") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"{prog}: needs {', '.join(missing)} (the model, the figure, the progress bar): pip install "
              f"'tba[bench]'", file=sys.stderr)
        return 2
    cuda = args.device == "cuda"
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for old in (out / "logs").glob("*.log"):  # logs of an earlier sweep into the same directory
        old.unlink()
    runner = Runner(args.device, out / "logs")
    given = sys.argv[1:] if argv is None else argv
    command = public_command(prog, list(given))
    sweep_log = open(out / "logs" / "sweep.log", "w")  # noqa: SIM115 (closed in the finally below)

    def say(text: str) -> None:
        print(text, flush=True)
        sweep_log.write(text + "\n")
        sweep_log.flush()

    env = runner.run("probe", {"device": args.device}, 120, "probe.log")
    if "status" in env:
        print(f"{prog}: could not start a worker: {env['status']}", file=sys.stderr)
        sweep_log.close()
        return 1
    if cuda and not env.get("cuda_available"):
        print(f"{prog}: --device cuda but torch.cuda.is_available() is False in the worker", file=sys.stderr)
        sweep_log.close()
        return 1
    model = dict(_QUICK_MODEL if args.quick else (_cuda_model(env["gpu_memory_bytes"]) if cuda else _CPU_MODEL))
    for name in ("layers", "hidden", "heads", "seq_len", "vocab"):
        if getattr(args, name) is not None:
            model[name] = getattr(args, name)
    batches = args.batch_sizes or ([1, 2] if args.quick else [2, 4, 8, 16, 32] if cuda else [1, 2, 4, 8])
    config = {
        "device": args.device, "model": model, "dtype": "bfloat16" if cuda else "float32",
        "batch_sizes": batches, "strategies": args.strategies,
        "repeats": args.repeats or (2 if args.quick else 3),
        "steps": args.steps or 2,
        "warmup_steps": args.warmup if args.warmup is not None else 1,
        "min_offload_bytes": args.min_offload_bytes if args.min_offload_bytes is not None
        else (16 * 1024 if args.quick else 1 << 20 if cuda else 64 * 1024),
        "keep_last_modules": args.keep_last_modules,
        "adaptive": args.adaptive,
        "policy_offloader": "host" if cuda else "ssd",
        "budget_fraction": args.budget_fraction,
        "noise_floor": NOISE_FLOOR,
        "ssd_dir": args.ssd_dir, "num_threads": args.num_threads or (None if cuda else _cpu_threads(args.quick)),
        "mmap_threshold_bytes": None if cuda else MMAP_THRESHOLD,
    }
    env.update(device=args.device, command=command, cwd=os.getcwd(), git_commit=_git_commit(),
               load_avg_start=_load_avg(),
               malloc_env={k: os.environ[k] for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
                           if k in os.environ})
    header = _report.environment_header(env, config)
    say(header)
    notes = _report.strategy_notes(config)

    timeout_s = args.timeout_s or (420 if cuda else 300)
    schedule = interleaved(args.strategies, batches, config["repeats"])
    progress = Progress(len(schedule))
    samples: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    oom_at: dict[str, int] = {}
    unavailable: dict[str, str] = {}
    interrupted = None
    current_pass = -1

    def write(final: bool) -> dict[str, Any]:
        points = _summary.aggregate(samples)
        summary = _summary.summarize(samples, points, args.budget_bytes)
        report: dict[str, Any] = {"environment": env, "config": config, "rows": points, "samples": samples, "summary": summary,
                  "total_wall_s": time.perf_counter() - t_start, "complete": final and interrupted is None}
        _report.write_csv(out / "rok_curve.csv", points, _report.CSV_COLUMNS)
        _report.write_csv(out / "rok_samples.csv", samples, _report.SAMPLE_COLUMNS)
        if final:
            report["environment"]["load_avg_end"] = _load_avg()
            report["plot"] = _plot.plot(out / "rok_curve.png", points, summary, env, config, notes)
        (out / "rok_curve.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        return report

    previous = signal.signal(signal.SIGTERM, raise_interrupted)  # e.g. `timeout`: still write the files
    try:
        for sample in schedule:
            strategy, b = sample.strategy, sample.batch_size
            if sample.repeat != current_pass:
                current_pass = sample.repeat
                sweep_log.write(f"pass {current_pass + 1} starts at {time.perf_counter() - t_start:.0f} s, load "
                                f"average {_load_avg()}\n")
            progress.start(f"pass {sample.repeat + 1} {strategy} b={b}")
            spec = dict(config, strategy=strategy, batch_size=b)
            load = _load_avg()
            if strategy == "budget":
                spec["activation_budget_bytes"] = _budget_for(sample, samples, args.budget_fraction)
            result: dict[str, Any]  # the point's row
            if interrupted is not None:
                result = {"status": f"skipped: {interrupted}"}
            elif args.time_budget_s is not None and time.perf_counter() - t_start > args.time_budget_s:
                result = {"status": f"skipped: time budget of {args.time_budget_s:.0f} s spent"}
            elif strategy in unavailable:
                result = {"status": unavailable[strategy]}
            elif strategy in oom_at and b >= oom_at[strategy]:
                result = {"status": f"skipped: out of memory at batch {oom_at[strategy]}"}
            elif strategy == "budget" and spec["activation_budget_bytes"] is None:
                result = {"status": f"skipped: keep measured no activation peak at batch {b} to set the budget"}
            else:
                started = time.perf_counter() - t_start
                try:
                    result = runner.run("point", spec, timeout_s,
                                        f"{strategy.replace('+', '_')}-b{b}-pass{sample.repeat + 1}.log")
                except Interrupted as e:
                    interrupted = str(e)
                    result = {"status": f"failed: {interrupted}"}
                result["started_s"] = round(started, 2)
                if result.get("status", "").startswith("unavailable:"):
                    unavailable[strategy] = result["status"]
                if "OutOfMemoryError" in result.get("status", "") or "out of memory" in result.get("status", ""):
                    oom_at[strategy] = min(b, oom_at.get(strategy, b))
            result.pop("traceback", None)
            row = {"repeat": sample.repeat, "strategy": strategy, "batch_size": b, "load_avg_1min": load and load[0],
                   **result}
            samples.append(row)
            line = _report.sample_line(row, cuda)
            sweep_log.write(line + "\n")
            progress.finish(line)
            write(final=False)  # a killed sweep still leaves what it measured
        report = write(final=True)
        cpu_s = sum(s.get("worker_cpu_s", 0.0) for s in samples)
        summary = _report.format_summary(report["summary"], report["rows"], config, cuda)
        totals = (f"sweep: {time.perf_counter() - t_main:.0f} s wall (the Python environment's set-up not "
                  f"included), the workers used {cpu_s:.0f} "
                  f"CPU-seconds; load average at start {env.get('load_avg_start')}, at end "
                  f"{env.get('load_avg_end')}" + (f"; {interrupted}: partial results" if interrupted else ""))
        say(summary)
        say(totals)
        # The printed summary with the environment, short enough to commit beside the figure.
        (out / "rok_summary.txt").write_text(f"{header}\n{summary}\n{totals}\n")
        say(f"wrote rok_curve.csv, rok_samples.csv, rok_summary.txt, rok_curve.json, rok_curve.png and logs/ in {out}")
    finally:
        signal.signal(signal.SIGTERM, previous)
        progress.close()
        sweep_log.close()
    return 0 if interrupted is None else 3
