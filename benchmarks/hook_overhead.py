"""CPU time per saved tensor: no hooks, bare identity hooks, ``save_on_cpu``, tba ``none`` and
tba ``host``, measured side by side (interleaved) in one run.

A model of many tiny ops saves thousands of small tensors; each variant's step is timed and the
difference to the step without hooks is divided by the tensors it packed. Times are CPU time of
the whole process (``time.process_time``: the training thread and tba's transfer threads), so a
busy shared machine inflates them less than wall time; wall times are reported beside. tba's costs are
printed as ratios to the bare hooks' cost (the floor any saved-tensor hook pays). "python floor"
is the least a Python entry table can do per saved tensor (``MinimalTable``: a stamp dict, a
detached alias, a handle with ``__del__``, a lock per hook): what tba's own bookkeeping is
measured against. A second model with 1 MiB tensors checks that large tensors do not get slower.

    python benchmarks/hook_overhead.py                      # defaults, prints and writes JSON
    python benchmarks/hook_overhead.py --ops 400 --repeats 15 --out results/hook_overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

import tba
from _environment import describe


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


def measure(
    blocks: int, ops: int, width: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Median step time of each variant (interleaved) and the tensors it packed/offloaded."""
    model = Model(blocks, ops, width)
    x = torch.randn(width)
    tba_opts = dict(offload_devices=("cpu",), min_offload_bytes=0, keep_last_modules=0,
                    adaptive=False)
    caches = {}

    def run_plain(ctx: Callable[[], contextlib.AbstractContextManager]) -> Callable[[], None]:
        def step() -> None:
            with ctx():
                model(x).backward()
        return step

    def run_tba(name: str) -> Callable[[], None]:
        def step() -> None:
            cache = tba.configure_tensor_cache(model, offloader=name, **tba_opts)
            try:
                model(x).backward()
                caches[f"tba {name}"] = cache.stats()
            finally:
                cache.close()
        return step

    variants = {
        "no hooks": run_plain(contextlib.nullcontext),
        "bare hooks": run_plain(bare_hooks),
        "save_on_cpu": run_plain(torch.autograd.graph.save_on_cpu),
        "python floor": run_plain(minimal_table),
        "tba none": run_tba("none"),
        "tba host": run_tba("host"),
    }

    def configure_only(name: str) -> Callable[[], None]:
        def step() -> None:
            tba.configure_tensor_cache(model, offloader=name, **tba_opts).close()
        return step

    # tba's variants configure and close a cache every step (so each step is a fresh cache):
    # that per-step cost is timed alone and taken out.
    setup = {"tba none": configure_only("none"), "tba host": configure_only("host")}
    jobs = [*variants.items(), *((f"{name} setup", fn) for name, fn in setup.items())]
    times: dict[str, list[float]] = {name: [] for name, _ in jobs}
    walls: dict[str, list[float]] = {name: [] for name, _ in jobs}
    for _, fn in jobs:  # warm-up
        fn()
    for _ in range(repeats):  # interleaved: drift hits every variant alike
        for name, fn in jobs:
            start, wall = time.process_time(), time.perf_counter()
            fn()
            times[name].append(time.process_time() - start)
            walls[name].append(time.perf_counter() - wall)
    median = {name: statistics.median(t) for name, t in times.items()}
    wall_median = {name: statistics.median(t) for name, t in walls.items()}
    packed = caches["tba none"].num_packed
    offloaded = caches["tba host"].num_offloaded
    base = median["no hooks"]
    out: dict[str, dict[str, float]] = {}
    for name in variants:
        extra = median[name] - base - median.get(f"{name} setup", 0.0)
        out[name] = {"step_s": median[name], "step_wall_s": wall_median[name],
                     "per_tensor_us": extra / packed * 1e6}
    out["tba host"]["per_offloaded_tensor_us"] = (
        (median["tba host"] - base - median["tba host setup"]) / max(offloaded, 1) * 1e6
    )
    out["_counts"] = {"num_packed": packed, "num_offloaded": offloaded}
    return out


def report(label: str, rows: dict[str, dict[str, float]]) -> list[str]:
    bare = rows["bare hooks"]["per_tensor_us"]
    counts = rows["_counts"]
    lines = [f"{label}: {counts['num_packed']} saved tensors per step, "
             f"{counts['num_offloaded']} offloaded with 'host'"]
    for name, row in rows.items():
        if name.startswith("_"):
            continue
        ratio = (f"  ({row['per_tensor_us'] / bare:.1f}x bare hooks)"
                 if (name.startswith("tba") or name == "python floor") and bare > 0 else "")
        extra = (f"; {row['per_offloaded_tensor_us']:.1f} us per offloaded tensor"
                 if "per_offloaded_tensor_us" in row else "")
        lines.append(f"  {name:<13} step {row['step_s'] * 1e3:8.2f} ms CPU "
                     f"({row['step_wall_s'] * 1e3:8.2f} ms wall)  "
                     f"{row['per_tensor_us']:7.2f} us/tensor{ratio}{extra}")
    return lines


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--ops", type=int, default=250)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--large-ops", type=int, default=8, help="ops per block of the 1 MiB model")
    p.add_argument("--out", default="hook_overhead.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    env = describe("cpu")
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    tiny = measure(args.blocks, args.ops, 8, args.repeats)
    large = measure(args.blocks, args.large_ops, (1 << 20) // 4, args.repeats)
    lines = report("tiny tensors (32 B)", tiny) + report("1 MiB tensors", large)
    print("\n".join(lines))
    result = {"environment": env, "tiny": tiny, "large_1MiB": large,
              "targets": {"tba none / bare hooks": 2.0, "tba host per offloaded tiny tensor us": 15.0}}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
