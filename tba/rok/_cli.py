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

from tba.rok import _report
from tba.rok._runner import MMAP_THRESHOLD, Interrupted, Progress, Runner, raise_interrupted
from tba.rok._worker import STRATEGIES

__all__ = ["main"]

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the checkout, when tba runs from one

# GPT-2 shapes: activations dominate (narrow, deep, small vocabulary).
_CPU_MODEL = dict(layers=12, hidden=128, heads=4, seq_len=128, vocab=1024)
_QUICK_MODEL = dict(layers=2, hidden=64, heads=2, seq_len=32, vocab=128)


def _cuda_model(gpu_memory_bytes: int) -> dict[str, int]:
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
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated, from {', '.join(STRATEGIES)} (default: all)")
    p.add_argument("--batch-sizes", help="comma-separated micro-batch sizes (default: 2,4,8,16 on CPU, "
                                         "2,4,8,16,32 on CUDA, 1,2 with --quick)")
    p.add_argument("--out", default=str(Path("out") / "rok"),
                   help="output directory (default out/rok in the working directory; figures worth keeping go "
                        "under benchmarks/results/)")
    p.add_argument("--quick", action="store_true", help="tiny model and few steps (smoke test)")
    p.add_argument("--budget-bytes", type=int, help="activation budget for the 'largest batch that fits' "
                                                   "summary (default: keep's peak at its median batch)")
    p.add_argument("--steps", type=int, help="measured steps per point (default 5; 2 with --quick)")
    p.add_argument("--warmup", type=int, help="warm-up steps per point (default 2; 1 with --quick)")
    g = p.add_argument_group("model (GPT-2 config; defaults depend on --device/--quick)")
    for name in ("layers", "hidden", "heads", "seq_len", "vocab"):
        g.add_argument("--" + name.replace("_", "-"), dest=name, type=int)
    c = p.add_argument_group("tba cache options")
    c.add_argument("--min-offload-bytes", type=int, help="default 64 KiB on CPU, 1 MiB on CUDA")
    c.add_argument("--keep-last-modules", type=int, default=1)
    c.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="adaptive offloading (default: on for CUDA, off for CPU)")
    c.add_argument("--ssd-dir", help="directory for offload-ssd (default: TBA_SSD_DIR, else the temp dir)")
    p.add_argument("--num-threads", type=int, help="torch threads per worker (default: CPU cores - 1 on CPU, leaving "
                                                   "a core to tba's I/O threads; 1 with --quick; torch's on CUDA)")
    p.add_argument("--timeout-s", type=float, help="per point (default 300 CPU, 420 CUDA)")
    p.add_argument("--time-budget-s", type=float, help="skip the remaining points after this long")
    args = p.parse_args(argv)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in args.strategies if s not in STRATEGIES]
    if bad or not args.strategies:
        p.error(f"unknown strategies {bad}; choose from {', '.join(STRATEGIES)}")
    if (args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 0):
        p.error("--steps must be >= 1 and --warmup >= 0")
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


def main(argv: list[str] | None = None, *, prog: str = "tba rok") -> int:
    """Runs the sweep (``tba rok --help``); returns the exit status (3: interrupted, partial results)."""
    args = _parse_args(argv, prog)
    missing = [m for m in ("transformers", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"{prog}: needs {' and '.join(missing)} (the model and the figure): pip install 'tba[test,bench]'",
              file=sys.stderr)
        return 2
    cuda = args.device == "cuda"
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    runner = Runner(args.device, out / "logs")
    given = sys.argv[1:] if argv is None else argv
    command = " ".join([prog, *([shlex.join(given)] if given else [])])

    env = runner.run("probe", {"device": args.device}, 120, "probe.log")
    if "status" in env:
        print(f"{prog}: could not start a worker: {env['status']}", file=sys.stderr)
        return 1
    if cuda and not env.get("cuda_available"):
        print(f"{prog}: --device cuda but torch.cuda.is_available() is False in the worker", file=sys.stderr)
        return 1
    model = dict(_QUICK_MODEL if args.quick else (_cuda_model(env["gpu_memory_bytes"]) if cuda else _CPU_MODEL))
    for name in ("layers", "hidden", "heads", "seq_len", "vocab"):
        if getattr(args, name) is not None:
            model[name] = getattr(args, name)
    batches = args.batch_sizes or ([1, 2] if args.quick else [2, 4, 8, 16, 32] if cuda else [2, 4, 8, 16])
    config = {
        "device": args.device, "model": model, "dtype": "bfloat16" if cuda else "float32",
        "batch_sizes": batches, "strategies": args.strategies,
        "steps": args.steps or (2 if args.quick else 5),
        "warmup_steps": args.warmup if args.warmup is not None else (1 if args.quick else 2),
        "min_offload_bytes": args.min_offload_bytes if args.min_offload_bytes is not None
        else (1 << 20 if cuda and not args.quick else 64 * 1024),
        "keep_last_modules": args.keep_last_modules,
        "adaptive": args.adaptive if args.adaptive is not None else cuda,
        "ssd_dir": args.ssd_dir, "num_threads": args.num_threads or (None if cuda else _cpu_threads(args.quick)),
        "mmap_threshold_bytes": None if cuda else MMAP_THRESHOLD,
    }
    env.update(device=args.device, command=command, cwd=os.getcwd(), git_commit=_git_commit(),
               malloc_env={k: os.environ[k] for k in ("MALLOCMMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
                           if k in os.environ})
    print(_report.environment_header(env, config), flush=True)

    timeout_s = args.timeout_s or (420 if cuda else 300)
    points = [(s, b) for b in batches for s in args.strategies]
    progress = Progress(len(points))
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    oom_at: dict[str, int] = {}
    interrupted = None

    def write(final: bool) -> dict[str, Any]:
        summary = _report.summarize(rows, args.budget_bytes)
        report = {"environment": env, "config": config, "rows": rows, "summary": summary,
                  "total_wall_s": time.perf_counter() - t_start, "complete": final and interrupted is None}
        _report.write_csv(out / "rok_curve.csv", rows)
        (out / "rok_curve.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        if final:
            _report.plot(out / "rok_curve.png", rows, summary, env, config)
        return report

    previous = signal.signal(signal.SIGTERM, raise_interrupted)  # e.g. `timeout`: still write the files
    try:
        for strategy, b in points:
            progress.start(f"{strategy} b={b}")
            if interrupted is not None:
                result = {"status": f"skipped: {interrupted}"}
            elif args.time_budget_s is not None and time.perf_counter() - t_start > args.time_budget_s:
                result = {"status": f"skipped: time budget of {args.time_budget_s:.0f} s spent"}
            elif strategy in oom_at:
                result = {"status": f"skipped: out of memory at batch {oom_at[strategy]}"}
            else:
                spec = dict(config, strategy=strategy, batch_size=b)
                try:
                    result = runner.run("point", spec, timeout_s, f"{strategy.replace('+', '_')}-b{b}.log")
                except Interrupted as e:
                    interrupted = str(e)
                    result = {"status": f"failed: {interrupted}"}
                if "OutOfMemoryError" in result.get("status", "") or "out of memory" in result.get("status", ""):
                    oom_at[strategy] = b
            result.pop("traceback", None)
            row = {"strategy": strategy, "batch_size": b, **result}
            rows.append(row)
            progress.finish(_report.point_line(row, cuda))
            write(final=False)  # a killed sweep still leaves what it measured
    finally:
        signal.signal(signal.SIGTERM, previous)
        progress.close()
    report = write(final=True)
    summary = report["summary"]
    print(_report.format_summary(summary, rows, cuda))
    print(f"\nwrote {out / 'rok_curve.csv'}, {out / 'rok_curve.json'}, {out / 'rok_curve.png'} "
          f"({report['total_wall_s']:.0f} s)" + (f"; {interrupted}: partial results" if interrupted else ""))
    return 0 if interrupted is None else 3
