"""The issue table's workload for ``adaptive_offload.py --table``: keep vs the default adaptive
policy vs fixed offload (host and ssd), step-interleaved, at each torch thread count.

GPT-2 (12 layers, hidden 256, 4 heads, seq 128, vocab 1024; transformers, eager attention),
batch 16, AdamW; every strategy is a model of its own built from one seed, and one training
step of each runs in turn (the order rotating every step) so machine load drifts over all of
them alike. tba options are the defaults but ``offload_devices=("cpu",)``. Reported per
strategy: the median step time (forward, backward, optimizer) over the steady steps (of the
last ``--steady`` steps, for adaptive those at its final boundary) and over every step after
warm-up (with what adaptive's profile and keep steps cost), ratios to keep, bytes offloaded per
steady step (and adaptive's share of what fixed host offloads, which is what the
adaptive policy offloaded before the closed loop) and stores cancelled because backward needed
their tensors first, the peak of saved activations held in
memory, tba's I/O thread CPU time when the cache reports it, and the load average around the
run (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

import tba  # noqa: E402
from tba.rok._worker import build_model  # noqa: E402
from tba.testing import probe  # noqa: E402

from _environment import describe  # noqa: E402

MODES = {
    "keep": dict(offloader="none", adaptive=False),
    "adaptive": dict(),  # the defaults: host, adaptive, closed loop
    "fixed-host": dict(offloader="host", adaptive=False),
    "fixed-ssd": dict(offloader="ssd", adaptive=False),
    "adaptive-ssd": dict(offloader="ssd"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    p.add_argument("--modes", default="keep,adaptive,fixed-host,fixed-ssd",
                   help=f"strategies, comma-separated, from {','.join(MODES)}")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--table-batch", type=int, default=16)
    p.add_argument("--table-steps", type=int, default=40, help="steps of each strategy")
    p.add_argument("--table-warmup", type=int, default=2)
    p.add_argument("--steady", type=int, default=8, help="last steps that make the steady median")
    p.add_argument("--min-offload-bytes", type=int, default=None, help="default: tba's default")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _run_threads(args: argparse.Namespace, threads: int, modes: list[str]) -> dict:
    torch.set_num_threads(threads)
    spec = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, seq_len=args.seq,
                vocab=args.vocab)
    ids = torch.randint(0, args.vocab, (args.table_batch, args.seq),
                        generator=torch.Generator().manual_seed(1234))
    runs = {}
    for mode in modes:
        model = build_model(spec, "cpu", "float32")
        options = dict(MODES[mode], offload_devices=("cpu",))
        if args.min_offload_bytes is not None:
            options["min_offload_bytes"] = args.min_offload_bytes
        cache = tba.configure_tensor_cache(model, **options)
        runs[mode] = dict(model=model, cache=cache,
                          opt=torch.optim.AdamW(model.parameters(), lr=1e-4), times=[], stats=[])
    load_before = os.getloadavg()
    wall0 = time.perf_counter()
    try:
        for step in range(args.table_steps):
            order = modes[step % len(modes):] + modes[:step % len(modes)]
            for mode in order:
                run = runs[mode]
                start = time.perf_counter()
                loss = run["model"](input_ids=ids, labels=ids).loss
                loss.backward()
                run["opt"].step()
                run["opt"].zero_grad(set_to_none=True)
                run["times"].append(time.perf_counter() - start)
                run["stats"].append(run["cache"].stats())
    finally:
        for run in runs.values():
            run["cache"].close()
    wall = time.perf_counter() - wall0
    load_after = os.getloadavg()
    rows = {}
    for mode, run in runs.items():
        times, stats = run["times"], run["stats"]
        cache = run["cache"]
        decision = cache.adaptive_decision
        history = probe(cache).history
        # Steady: the last --steady steps; for adaptive only those at its final boundary (its
        # keep and profile steps of a re-check are counted in the all-steps figures).
        last = range(len(times) - args.steady, len(times))
        steady = [i for i in last if decision is None or "adaptive" not in mode
                  or history[i][2] == decision.tail_start] or list(last)  # still measuring
        steady_stats = [stats[i] for i in steady]
        rows[mode] = {
            "mode": mode,
            "options": {k: v for k, v in MODES[mode].items()},
            "num_steady_steps": len(steady),
            "median_step_s": _median([times[i] for i in steady]),
            "median_step_after_warmup_s": _median(times[args.table_warmup:]),
            "mean_step_after_warmup_s": statistics.fmean(times[args.table_warmup:]),
            "step_times_s": times,
            "offloaded_bytes_per_step": _median([s.offloaded_bytes for s in steady_stats]),
            # Stores backward cancelled (it needed the tensor before the store ran: on a busy
            # machine, possibly every store of a step).
            "num_cancelled_per_step": _median([s.num_cancelled for s in steady_stats]),
            "peak_resident_bytes": max(s.peak_resident_bytes for s in steady_stats),
            "stall_s": _median([s.stall_s for s in steady_stats]),
            "io_cpu_s_per_step": _median([getattr(s, "io_cpu_s", 0.0) for s in steady_stats])
            if hasattr(steady_stats[-1], "io_cpu_s") else None,
            "offloaded_blocks_per_step": [t for _, _, t in history],
            "decision": str(decision) if decision is not None else None,
        }
    return {"threads": threads, "wall_s": wall, "loadavg_before": load_before,
            "loadavg_after": load_after, "rows": rows}


def _print(result: dict) -> None:
    rows = result["rows"]
    keep = rows.get("keep")
    fixed = rows.get("fixed-host")
    print(f"\n== {result['threads']} torch thread(s): {result['wall_s']:.0f} s, load average "
          f"{result['loadavg_before'][0]:.2f} before, {result['loadavg_after'][0]:.2f} after ==")
    for mode, row in rows.items():
        ratio = (f"{row['median_step_s'] / keep['median_step_s']:.2f}x keep" if keep else "")
        ratio_all = (f"{row['median_step_after_warmup_s'] / keep['median_step_after_warmup_s']:.2f}x"
                     if keep else "")
        share = ""
        if fixed and fixed["offloaded_bytes_per_step"]:
            share = f" ({row['offloaded_bytes_per_step'] / fixed['offloaded_bytes_per_step']:.0%} of fixed-host)"
        io = (f"  io cpu {row['io_cpu_s_per_step']:.2f} s/step"
              if row["io_cpu_s_per_step"] is not None else "")
        print(f"{mode:>12}: steady step ({row['num_steady_steps']}) {row['median_step_s'] * 1e3:7.0f} ms ({ratio}), all steps "
              f"after warm-up {row['median_step_after_warmup_s'] * 1e3:7.0f} ms ({ratio_all}); "
              f"offloaded {row['offloaded_bytes_per_step'] / 2**20:6.0f} MiB/step{share}, "
              f"{row['num_cancelled_per_step']:.0f} stores cancelled/step; peak "
              f"resident {row['peak_resident_bytes'] / 2**20:6.0f} MiB; stall "
              f"{row['stall_s'] * 1e3:.0f} ms{io}")
    adaptive = rows.get("adaptive")
    if adaptive is not None:
        print(f"    adaptive blocks per step: {adaptive['offloaded_blocks_per_step']}")
        print(f"    adaptive: {adaptive['decision']}")


def parse_choices(text: str, allowed, option: str) -> list[str]:
    """A comma-separated ``option`` value, each item one of ``allowed``."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in items if item not in allowed]
    if unknown:
        raise SystemExit(f"{option}: unknown {unknown}; choose from {list(allowed)}")
    return items


def main(args: argparse.Namespace) -> dict:
    modes = parse_choices(args.modes, MODES, "--modes")
    env = describe("cpu")
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    print(f"workload: GPT-2 {args.layers} layers, hidden {args.hidden}, batch {args.table_batch}, "
          f"seq {args.seq}, vocab {args.vocab}; {args.table_steps} steps per strategy, "
          f"interleaved; steady = last {args.steady}", flush=True)
    results = []
    for threads in [int(t) for t in args.threads.split(",")]:
        result = _run_threads(args, threads, modes)
        _print(result)
        results.append(result)
    out = {"environment": env, "args": vars(args), "results": results}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    return out
