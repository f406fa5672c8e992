"""The long run of ``adaptive_offload.py --long``: does the closed loop keep its promise?

GPT-2 (as ``--table``: 12 layers, hidden 256, 4 heads, seq 128, vocab 1024, eager attention),
batch 16, AdamW, built twice from one seed: a plain model, and one configured once with tba's
defaults and ``--long-offloader`` (ssd). One step of each in turn, the order alternating
every step, so machine load falls on both alike; a step is forward, backward and optimizer,
timed with ``perf_counter``. After each step pair the losses and every gradient are compared
(``torch.equal``). Per run (a torch thread count, a noise source from ``_noise``):

- total time tba / plain over every step (the profile and the loop's measuring steps
  included), and per ``--window`` steps;
- the offloaded fraction: bytes tba offloaded over the bytes it managed (offloaded + kept);
- the loop's decisions (``tba.testing.probe(cache).loop_events``) and the boundary each step ran at.

Writes ``PREFIX.txt`` (summary), ``PREFIX.csv`` (per-window rows), ``PREFIX.png`` (the
timeline, ``_long_plot``) and ``--out`` (JSON with per-step times, not committed).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

import tba  # noqa: E402
from tba.offloaders import make_offloader  # noqa: E402
from tba.rok._worker import build_model  # noqa: E402
from tba.testing import probe  # noqa: E402

from _adaptive_table import parse_choices  # noqa: E402
from _environment import describe  # noqa: E402
from _noise import NOISES, BusyBursts, StallingOffloader, stall_windows  # noqa: E402

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--long", action="store_true",
                   help="the long run: plain and tba twins stepped alternately (options below)")
    p.add_argument("--long-steps", type=int, default=100, help="steps of each twin")
    p.add_argument("--long-offloader", default="ssd", choices=["host", "ssd"])
    p.add_argument("--noise", default="none", help=f"comma-separated, from {','.join(NOISES)}")
    p.add_argument("--window", type=int, default=10, help="steps per reported window")
    p.add_argument("--seed", type=int, default=27, help="of the noise schedules")
    p.add_argument("--prefix", default="adaptive_long",
                   help="PREFIX.txt, PREFIX.csv and PREFIX.png are written")


def _step(model, ids) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), time.perf_counter() - start


def _optimizer_step(opt) -> float:
    start = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _run(args: argparse.Namespace, threads: int, noise: str) -> dict:
    torch.set_num_threads(threads)
    spec = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, seq_len=args.seq,
                vocab=args.vocab)
    ids = torch.randint(0, args.vocab, (args.table_batch, args.seq),
                        generator=torch.Generator().manual_seed(1234))
    plain, model = build_model(spec, "cpu", "float32"), build_model(spec, "cpu", "float32")
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (plain, model)]
    config = tba.TensorCacheConfig(offloader=args.long_offloader, offload_devices=("cpu",))
    if args.min_offload_bytes is not None:
        config = config.replace(min_offload_bytes=args.min_offload_bytes)
    busy, windows, stalling = None, [], None
    if noise == "stalls":  # the offloader the config names, wrapped; the cache closes it
        windows = stall_windows(args.seed + threads, time.monotonic(), 10.0 * args.long_steps)
        stalling = StallingOffloader(make_offloader(config), windows)
        config = config.replace(offloader=stalling)
    cache = tba.configure_tensor_cache(model, config)
    times: list[list[float]] = [[], []]
    spans: list[list[tuple[float, float]]] = [[], []]
    per_step: list[dict] = []
    profiled: set[int] = set()
    identical = True
    load_before = os.getloadavg()
    if noise == "busy":
        busy = BusyBursts(args.seed + threads)
    wall0 = time.perf_counter()
    try:
        for step in range(args.long_steps):
            order = (0, 1) if step % 2 == 0 else (1, 0)
            losses: list[torch.Tensor] = [torch.empty(0), torch.empty(0)]
            step_s = [0.0, 0.0]
            for i in order:
                begin = time.monotonic()
                losses[i], step_s[i] = _step((plain, model)[i], ids)
                spans[i].append((begin, time.monotonic()))
            identical &= torch.equal(losses[0], losses[1]) and all(
                torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters())
                if a.grad is not None)
            for i in order:
                step_s[i] += _optimizer_step(opts[i])
                times[i].append(step_s[i])
            stats = cache.stats()
            decision = cache.adaptive_decision
            if decision is not None and decision.profiled_at_step is not None:
                profiled.add(decision.profiled_at_step)
            per_step.append(dict(offloaded_bytes=stats.offloaded_bytes,
                                 managed_bytes=stats.offloaded_bytes + stats.kept_bytes,
                                 loss=losses[0].item()))
            if (step + 1) % args.window == 0:
                print(f"  step {step + 1}: tba / plain so far {sum(times[1]) / sum(times[0]):.3f}",
                      flush=True)
    finally:
        busy_intervals = busy.stop() if busy is not None else []
        cache.close()
    wall = time.perf_counter() - wall0
    load_after = os.getloadavg()
    history = {number: ran_at for number, _, ran_at in probe(cache).history}
    for n, row in enumerate(per_step, start=1):
        row["tail_start"] = history.get(n)
        row["plain_s"], row["tba_s"] = times[0][n - 1], times[1][n - 1]
        row["noise_on"] = _overlap(spans[1][n - 1], busy_intervals or windows)
    events = [dict(step=e.step, kind=e.kind, tail_start=e.tail_start, text=e.text)
              for e in probe(cache).loop_events]
    decision = cache.adaptive_decision
    return {
        "threads": threads, "noise": noise, "wall_s": wall, "loadavg_before": load_before,
        "loadavg_after": load_after, "bit_identical": identical, "steps": per_step,
        "profiled_at": sorted(profiled), "events": events,
        "decision": str(decision) if decision is not None else None,
        "noise_intervals": busy_intervals or windows,
        "stalled_s": stalling.stalled_s if stalling is not None else None,
        **_totals(per_step, 0), "after_first": _totals(per_step, 1),
    }


def _overlap(span: tuple[float, float], intervals: list[tuple[float, float]]) -> float:
    """Fraction of ``span`` inside ``intervals``."""
    start, end = span
    inside = sum(max(0.0, min(end, b) - max(start, a)) for a, b in intervals)
    return inside / (end - start) if end > start else 0.0


def _totals(steps: list[dict], skip: int) -> dict:
    rows = steps[skip:]
    plain, tba_s = sum(r["plain_s"] for r in rows), sum(r["tba_s"] for r in rows)
    managed = sum(r["managed_bytes"] for r in rows)
    return {"plain_s": plain, "tba_s": tba_s, "ratio": tba_s / plain,
            "offloaded_fraction": sum(r["offloaded_bytes"] for r in rows) / managed if managed else 0.0}


def windows_of(result: dict, size: int) -> list[dict]:
    """Per-``size``-step rows of one run."""
    rows = []
    steps = result["steps"]
    for first in range(0, len(steps), size):
        chunk = steps[first:first + size]
        totals = _totals(chunk, 0)
        tails = [r["tail_start"] for r in chunk]
        rows.append({
            "noise": result["noise"], "threads": result["threads"], "first_step": first + 1,
            "last_step": first + len(chunk), "plain_s": round(totals["plain_s"], 3),
            "tba_s": round(totals["tba_s"], 3), "ratio": round(totals["ratio"], 4),
            "offloaded_fraction": round(totals["offloaded_fraction"], 3),
            "keep_steps": sum(t == 0 for t in tails),
            "median_offloaded_blocks": statistics.median(t for t in tails if t is not None),
            "noise_on_fraction": round(statistics.fmean(r["noise_on"] for r in chunk), 3),
        })
    return rows


def _summary_lines(result: dict, window: int) -> list[str]:
    settles = [e for e in result["events"] if e["kind"] == "settle"]
    lines = [
        f"\n== {result['threads']} torch thread(s), noise {result['noise']}: {result['wall_s']:.0f} s, "
        f"load average {result['loadavg_before'][0]:.2f} before, {result['loadavg_after'][0]:.2f} after ==",
        f"total time tba / plain {result['ratio']:.3f} (all {len(result['steps'])} steps; "
        f"{result['after_first']['ratio']:.3f} after step 1); offloaded "
        f"{result['offloaded_fraction']:.0%} of the bytes tba managed; losses and gradients "
        f"bit-identical at every step: {result['bit_identical']}",
        f"profiled at step(s) {result['profiled_at']}; settled at step(s) "
        f"{[e['step'] for e in settles]}" + (f"; offloader stalled {result['stalled_s']:.1f} s"
                                              if result["stalled_s"] is not None else ""),
        f"per {window} steps: ratio " + " ".join(f"{w['ratio']:.3f}" for w in windows_of(result, window)),
        f"per {window} steps: offloaded " + " ".join(
            f"{w['offloaded_fraction']:.0%}" for w in windows_of(result, window)),
        "loop decisions:",
    ]
    lines += [f"  step {e['step']}: {e['kind']} [0, {e['tail_start']}): {e['text']}"
              for e in result["events"] if e["kind"] != "measure"]
    lines.append(f"final decision: {result['decision']}")
    return lines


def _portable_command(argv: list[str] | None = None) -> str:
    """The command line without this machine's paths: the interpreter as ``python``, paths in
    the repository relative to its root, other absolute paths (``--out /tmp/...``, the per-step
    JSON that is not committed) by their file name alone.

    Example:
        >>> _portable_command(["x.py", "--out", "/tmp/run/quiet.json", "--prefix=/tmp/a/b"])
        'python x.py --out quiet.json --prefix=b'
    """
    root = str(Path(__file__).resolve().parents[1]) + os.sep

    def portable(arg: str) -> str:
        key, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if value.startswith(root):
            value = value[len(root):]
        elif os.path.isabs(value):
            value = os.path.basename(value)
        return key + eq + value

    return shlex.join(["python"] + [portable(a) for a in (sys.argv if argv is None else argv)])


def main(args: argparse.Namespace) -> dict:
    noises = parse_choices(args.noise, NOISES, "--noise")
    env = describe("cpu")
    env["command"] = _portable_command()
    header = [" ".join(f"{k}={v}" for k, v in env.items()),
              f"workload: GPT-2 {args.layers} layers, hidden {args.hidden}, batch {args.table_batch}, "
              f"seq {args.seq}, vocab {args.vocab}; plain and tba (defaults, offloader="
              f"{args.long_offloader}) stepped alternately, {args.long_steps} steps each"]
    print("\n".join(header), flush=True)
    results, lines = [], list(header)
    for noise in noises:
        for threads in [int(t) for t in args.threads.split(",")]:
            result = _run(args, threads, noise)
            summary = _summary_lines(result, args.window)
            print("\n".join(summary), flush=True)
            lines += summary
            results.append(result)
            out = _write(args, env, header, lines, results)  # after each run: partial results
    return out


def _write(args: argparse.Namespace, env: dict, header: list[str], lines: list[str],
           results: list[dict]) -> dict:
    Path(args.prefix).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.prefix}.txt").write_text("\n".join(lines) + "\n")
    with open(f"{args.prefix}.csv", "w", newline="") as f:
        f.write("".join(f"# {line}\n" for line in header))
        rows = [w for r in results for w in windows_of(r, args.window)]
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    from _long_plot import plot

    plot(results, env, args.window, Path(f"{args.prefix}.png"))
    out = {"environment": env, "args": vars(args), "results": results}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return out
