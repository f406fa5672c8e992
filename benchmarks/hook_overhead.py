"""CPU time per saved tensor, in steady state: no hooks, bare identity hooks, ``save_on_cpu``, a
minimal Python table, tba ``none``, tba ``host`` and tba ``ssd``, measured side by side
(interleaved) in one run.

A model of many tiny ops saves thousands of small tensors; each variant trains its own copy of
the model (tba variants: one cache each, configured once; the timed steps are steps 4 and later
of that cache, after warm-up), and the difference of its step time to the step without hooks
is divided by the tensors it packed. Variants run in a shuffled order in every round, so a busy
shared machine's drift hits them alike; times are CPU time of the whole process
(``time.process_time``: the training thread and tba's transfer threads), wall time beside.
Each variant's cost is printed as a ratio to ``save_on_cpu``'s and to the bare hooks' (the floor
any saved-tensor hook pays). "python floor" is the least a Python entry table does per saved
tensor (``MinimalTable``: a stamp dict, a detached alias, a handle with ``__del__``, a lock per
hook). A second model with 1 MiB tensors checks that large tensors do not get slower.

The timed steps run as training does: a store races backward, and one that has not run when
backward needs its tensor is cancelled (the tensor is read from memory). Each tba variant reports
how many saved tensors per step were offloaded and how many stores were cancelled (on a busy
machine, possibly all; a store still running when its step ends counts in the step in which it
finishes), then runs untimed steps whose stores complete before backward and reports
the bytes one of them wrote and read back (``settled_offloaded_bytes``, ``settled_reloaded_bytes``).
Once those have run every store of the timed steps has ended, offloaded or cancelled:
``sent_per_timed_step`` counts them per timed step (every saved tensor, whatever the races).

    python benchmarks/hook_overhead.py                      # defaults, prints, writes JSON + TXT
    python benchmarks/hook_overhead.py --rounds 30 --out benchmarks/results/cpu/hook_overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from pathlib import Path

import torch
from torch import nn

import tba
from _environment import describe

TBA_OPTIONS = dict(offload_devices=("cpu",), min_offload_bytes=0, keep_last_modules=0, adaptive=False)
VARIANTS = ("no hooks", "bare hooks", "save_on_cpu", "python floor", "tba none", "tba host", "tba ssd")
REAL_VARIANTS = ("plain", "save_on_cpu", "tba none", "tba host")
# The main job's CPU model (tba/rok/_cli.py) and the options of the real model's tba variants.
REAL_MODEL = dict(layers=6, hidden=128, heads=4, seq_len=128, vocab=1024)
REAL_TBA = {"tba none": dict(offloader="none", offload_devices=("cpu",)),
            "tba host": dict(offloader="host", offload_devices=("cpu",), adaptive=False)}


class TinyOps(nn.Module):
    """Each block runs ``ops`` elementwise ops whose inputs autograd saves."""

    def __init__(self, ops: int, width: int) -> None:
        super().__init__()
        self.ops = ops
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.ops):
            x = torch.sin(x) * self.scale
        return x


class Model(nn.Module):
    def __init__(self, blocks: int, ops: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TinyOps(ops, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


@contextlib.contextmanager
def bare_hooks() -> Iterator[None]:
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        yield


class _MinimalEntry:
    __slots__ = ("stamp", "alias", "version", "refs")


class _MinimalHandle:
    __slots__ = ("entry", "table")

    def __init__(self, entry: _MinimalEntry, table: MinimalTable) -> None:
        self.entry, self.table = entry, table

    def __del__(self) -> None:
        self.table.release(self.entry)


class MinimalTable:
    """The least any Python implementation of tba's bookkeeping does per saved tensor, as a
    reference floor (not a usable cache): identity by a storage stamp in a dict, a detached
    alias (for the version check and to hand back), a handle whose ``__del__`` counts the
    reference down, a lock round trip at pack, unpack and release. No scopes, no parameters,
    no transfers, no statistics."""

    def __init__(self) -> None:
        self.entries: dict[int, _MinimalEntry] = {}
        self.lock = threading.Lock()
        self.stamps = itertools.count(1)

    def pack(self, tensor: torch.Tensor) -> object:
        if not tensor.is_cpu or (tensor.requires_grad and tensor.is_leaf):
            return (tensor, tensor._version)
        storage = tensor.untyped_storage()
        stamp = getattr(storage, "_floor_stamp", None)
        if stamp is None:
            stamp = next(self.stamps)
            storage._floor_stamp = stamp  # type: ignore[attr-defined]
        with self.lock:
            entry = self.entries.get(stamp)
            if entry is None:
                entry = _MinimalEntry()
                entry.stamp, entry.alias, entry.version, entry.refs = stamp, tensor.detach(), tensor._version, 1
                self.entries[stamp] = entry
            else:
                entry.refs += 1
        return _MinimalHandle(entry, self)

    def unpack(self, packed: object) -> torch.Tensor:
        if type(packed) is tuple:
            return packed[0]
        entry = packed.entry  # type: ignore[attr-defined]
        with self.lock:
            alias = entry.alias
        if alias._version != entry.version:
            raise RuntimeError("modified in place")
        return alias

    def release(self, entry: _MinimalEntry) -> None:
        with self.lock:
            entry.refs -= 1
            if not entry.refs:
                del self.entries[entry.stamp]


@contextlib.contextmanager
def minimal_table() -> Iterator[None]:
    table = MinimalTable()
    with torch.autograd.graph.saved_tensors_hooks(table.pack, table.unpack):
        yield


def settled_step(step: Callable[[], None], cache: tba.TensorCache, repeats: int = 2) -> tba.CacheStats:
    """Untimed steps of ``cache``'s model whose stores all complete before backward (a hook at
    the end of forward waits for them): what a step moves when stores win every race with
    backward. Returns the stats of the last: the first also counts the stores of the step
    before that were still running when it ended; a settled step leaves none running."""
    model = cache.model
    assert model is not None
    handle = model.register_forward_hook(lambda *_: cache.wait_for_stores(60))
    try:
        for _ in range(repeats):
            step()
    finally:
        handle.remove()
    return cache.stats()


def measure(blocks: int, ops: int, width: int, rounds: int, warmup: int, ssd_dir: str) -> dict:
    """Median step time of each variant (steady state, interleaved) and what tba packed."""
    torch.manual_seed(0)
    base = Model(blocks, ops, width)
    x = torch.randn(width)
    steps: dict[str, Callable[[], None]] = {}
    caches: dict[str, tba.TensorCache] = {}
    for name, ctx in (("no hooks", contextlib.nullcontext), ("bare hooks", bare_hooks),
                      ("save_on_cpu", torch.autograd.graph.save_on_cpu),
                      ("python floor", minimal_table)):
        model = copy.deepcopy(base)

        def plain(model: nn.Module = model, ctx: Callable = ctx) -> None:
            with ctx():
                model(x).backward()

        steps[name] = plain
    for offloader in ("none", "host", "ssd"):
        model = copy.deepcopy(base)
        extra = dict(ssd_dirs=(ssd_dir,), ssd_engine="posix") if offloader == "ssd" else {}
        caches[f"tba {offloader}"] = tba.configure_tensor_cache(model, offloader=offloader, **TBA_OPTIONS, **extra)

        def with_tba(model: nn.Module = model) -> None:
            model(x).backward()

        steps[f"tba {offloader}"] = with_tba
    times, walls, counts, after = interleaved(steps, caches, rounds, warmup)
    settled = {name: settled_step(steps[name], caches[name]) for name in ("tba host", "tba ssd")}
    final = {name: caches[name].stats(cumulative=True) for name in settled}
    for cache in caches.values():
        cache.close()
    timed = {name: after[name].num_steps - counts[name].num_steps for name in caches}
    packed = (after["tba none"].num_packed - counts["tba none"].num_packed) // max(timed["tba none"], 1)

    def per_step(name: str, field: str) -> float:
        return (getattr(after[name], field) - getattr(counts[name], field)) / max(timed[name], 1)
    median = {name: statistics.median(t) for name, t in times.items()}
    base_s = median["no hooks"]
    out: dict[str, dict[str, float]] = {}
    for name in steps:
        out[name] = {
            "step_s": median[name], "step_wall_s": statistics.median(walls[name]),
            "per_tensor_us": (median[name] - base_s) / max(packed, 1) * 1e6,
        }
    for name in ("tba host", "tba ssd"):
        out[name]["offloaded_per_step"] = per_step(name, "num_offloaded")
        out[name]["cancelled_per_step"] = per_step(name, "num_cancelled")
        # Every store of the timed steps has ended by the end of the settled steps (two, each
        # with every store completed), offloaded or cancelled: what the timed steps sent.
        sent = sum(getattr(final[name], f) - getattr(counts[name], f) for f in ("num_offloaded", "num_cancelled"))
        out[name]["sent_per_timed_step"] = (sent - 2 * settled[name].num_offloaded) / max(timed[name], 1)
        out[name]["settled_offloaded_bytes"] = settled[name].offloaded_bytes
        out[name]["settled_reloaded_bytes"] = settled[name].reloaded_bytes
    soc, bare = out["save_on_cpu"]["per_tensor_us"], out["bare hooks"]["per_tensor_us"]
    for row in out.values():
        row["x_save_on_cpu"] = row["per_tensor_us"] / soc if soc > 0 else float("nan")
        row["x_bare_hooks"] = row["per_tensor_us"] / bare if bare > 0 else float("nan")
    out["_counts"] = {"num_packed_per_step": packed, "rounds": rounds, "warmup_steps": warmup}
    return out


def interleaved(
    steps: dict[str, Callable[[], None]], caches: dict[str, tba.TensorCache], rounds: int, warmup: int,
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, Any], dict[str, Any]]:
    """Run ``warmup`` untimed steps of every variant (the tba caches' first steps: pools grown
    and sized) and a settled step of each tba variant, then ``rounds`` rounds of one timed
    step each, in a shuffled order per round. Returns the CPU and wall times per variant, in round order, and the caches'
    cumulative stats before and after the timed rounds."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    for name, cache in caches.items():  # no store of the warm-up ends in a timed step
        settled_step(steps[name], cache, repeats=1)
    counts = {name: cache.stats(cumulative=True) for name, cache in caches.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    walls: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            start, wall = time.process_time(), time.perf_counter()
            steps[name]()
            times[name].append(time.process_time() - start)
            walls[name].append(time.perf_counter() - wall)
    after = {name: cache.stats(cumulative=True) for name, cache in caches.items()}
    return times, walls, counts, after


def measure_real(batch: int, rounds: int, warmup: int) -> dict:
    """Step times of the real model at ``batch``: medians, and median ratios paired by round."""
    from tba.rok._worker import build_model

    base = build_model(REAL_MODEL, "cpu", "float32")
    ids = torch.randint(0, REAL_MODEL["vocab"], (batch, REAL_MODEL["seq_len"]),
                        generator=torch.Generator().manual_seed(0))
    steps: dict[str, Callable[[], None]] = {}
    caches: dict[str, tba.TensorCache] = {}
    for name in REAL_VARIANTS:
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        ctx: Callable[[], contextlib.AbstractContextManager] = (
            torch.autograd.graph.save_on_cpu if name == "save_on_cpu" else contextlib.nullcontext)
        if name in REAL_TBA:
            caches[name] = tba.configure_tensor_cache(model, **REAL_TBA[name])

        def step(model: nn.Module = model, optimizer: torch.optim.Optimizer = optimizer,
                 ctx: Callable[[], contextlib.AbstractContextManager] = ctx) -> None:
            with ctx():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        steps[name] = step
    times, walls, counts, after = interleaved(steps, caches, rounds, warmup)
    for cache in caches.values():
        cache.close()

    def paired(a: str, b: str, clock: dict[str, list[float]]) -> float:
        return statistics.median(x / y for x, y in zip(clock[a], clock[b]))

    out: dict[str, dict[str, float]] = {}
    for name in steps:
        out[name] = {
            "step_s": statistics.median(times[name]), "step_wall_s": statistics.median(walls[name]),
            "x_plain": paired(name, "plain", times), "x_plain_wall": paired(name, "plain", walls),
            "x_save_on_cpu": paired(name, "save_on_cpu", times),
            "x_save_on_cpu_wall": paired(name, "save_on_cpu", walls),
        }
    for name in caches:
        num_steps = max(after[name].num_steps - counts[name].num_steps, 1)
        out[name]["packed_per_step"] = (after[name].num_packed - counts[name].num_packed) / num_steps
        out[name]["offloaded_bytes_per_step"] = (
            after[name].offloaded_bytes - counts[name].offloaded_bytes) / num_steps
    out["_counts"] = {"batch": batch, "rounds": rounds, "warmup_steps": warmup}
    return out


def report_real(rows: dict) -> list[str]:
    counts = rows["_counts"]
    m = REAL_MODEL
    lines = [f"real model: GPT-2 {m['layers']} layers, hidden {m['hidden']}, seq {m['seq_len']}, "
             f"batch {counts['batch']}, AdamW; {counts['rounds']} interleaved rounds after "
             f"{counts['warmup_steps']} warm-up steps (median CPU time per step; median of the "
             "ratios paired by round, CPU time [wall])"]
    for name in REAL_VARIANTS:
        row = rows[name]
        extra = ""
        if "packed_per_step" in row:
            extra = (f"  [{row['packed_per_step']:.0f} saved, "
                     f"{row['offloaded_bytes_per_step'] / 2**20:.1f} MiB offloaded per step]")
        lines.append(f"  {name:<12} step {row['step_s'] * 1e3:8.2f} ms CPU "
                     f"({row['step_wall_s'] * 1e3:8.2f} ms wall)  "
                     f"{row['x_plain']:5.3f}x plain [{row['x_plain_wall']:5.3f}x]  "
                     f"{row['x_save_on_cpu']:5.3f}x save_on_cpu [{row['x_save_on_cpu_wall']:5.3f}x]{extra}")
    return lines


def report(label: str, rows: dict) -> list[str]:
    counts = rows["_counts"]
    lines = [f"{label}: {counts['num_packed_per_step']} saved tensors per step, "
             f"{counts['rounds']} interleaved rounds after {counts['warmup_steps']} warm-up steps "
             f"(median CPU time per step; cost per saved tensor over no hooks)"]
    for name in VARIANTS:
        row = rows[name]
        extra = (f"  [{row['offloaded_per_step']:.0f} offloaded, {row['cancelled_per_step']:.0f} "
                 f"cancelled per step]" if "offloaded_per_step" in row else "")
        ratios = "" if name == "no hooks" else (
            f"  {row['x_save_on_cpu']:5.2f}x save_on_cpu  {row['x_bare_hooks']:5.1f}x bare hooks")
        lines.append(f"  {name:<13} step {row['step_s'] * 1e3:8.2f} ms CPU "
                     f"({row['step_wall_s'] * 1e3:8.2f} ms wall)  "
                     f"{row['per_tensor_us']:7.2f} us/tensor{ratios}{extra}")
    return lines


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--ops", type=int, default=250)
    p.add_argument("--rounds", type=int, default=15, help="interleaved timed rounds")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each cache first")
    p.add_argument("--large-ops", type=int, default=8, help="ops per block of the 1 MiB model")
    p.add_argument("--real-batches", default="1,8",
                   help="batch sizes of the real model, comma-separated ('' skips it)")
    p.add_argument("--real-rounds", type=int, default=15, help="interleaved rounds of the real model")
    p.add_argument("--real-warmup", type=int, default=3, help="untimed steps of each real variant")
    p.add_argument("--no-tiny", action="store_true", help="only the real model")
    p.add_argument("--out", default="hook_overhead.json", help="JSON path; a .txt beside it")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    env = describe("cpu")
    header = " ".join(f"{k}={v}" for k, v in env.items())
    print(header, flush=True)
    result: dict = {"environment": env}
    lines: list[str] = []
    verdict: list[str] = []
    targets: dict[str, float] = {}
    if not args.no_tiny:
        with tempfile.TemporaryDirectory(prefix="tba-hook-overhead-") as ssd_dir:
            tiny = measure(args.blocks, args.ops, 8, args.rounds, args.warmup, ssd_dir)
            large = measure(args.blocks, args.large_ops, (1 << 20) // 4, args.rounds, args.warmup, ssd_dir)
        lines += report("tiny tensors (32 B)", tiny) + report("1 MiB tensors", large)
        targets.update({"tba none / save_on_cpu <=": 2.0, "tba host / save_on_cpu <= (tiny)": 6.0})
        verdict.append(
            f"targets: tba none {tiny['tba none']['x_save_on_cpu']:.2f}x save_on_cpu (<= 2.0), "
            f"tba host {tiny['tba host']['x_save_on_cpu']:.2f}x save_on_cpu (<= 6.0)"
        )
        result.update(tiny=tiny, large_1MiB=large)
    real: dict[str, dict] = {}
    for batch in (int(b) for b in args.real_batches.split(",") if b.strip()):
        real[str(batch)] = rows = measure_real(batch, args.real_rounds, args.real_warmup)
        lines += report_real(rows)
        verdict.append(f"target: real model, batch {batch}: tba none step "
                       f"{rows['tba none']['x_save_on_cpu']:.3f}x save_on_cpu's (<= 1.03)")
    if real:
        targets["real model: tba none step / save_on_cpu step <="] = 1.03
        result["real"] = real
    result["targets"] = targets
    print("\n".join(lines + verdict))
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".txt").write_text("\n".join([header, *lines, *verdict]) + "\n")
    return result


if __name__ == "__main__":
    main()
