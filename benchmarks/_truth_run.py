"""The strategies of gpu_truth.py and how their steps are measured: each strategy is its own
copy of the model (one seed), built, warmed up and then measured interleaved with the others
of its phase, one step of each in turn, so that every ratio comes from one run.

A strategy that raises (``torch.OutOfMemoryError`` included) is recorded with the exception,
its model and cache are released and the others go on.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

import tba
from _truth_memory import MemoryStats

EAGER = ("keep", "recompute", "host", "ssd", "host+ssd", "defaults", "budget")
COMPILED = ("compiled keep", "compiled host", "compiled ssd")
# Rows whose offloader is forced (adaptive=False) or held to a budget: they must move bytes.
MEANT_TO_OFFLOAD = ("host", "ssd", "host+ssd", "budget", "compiled host", "compiled ssd")
DECIDES = ("defaults", "budget")


@dataclasses.dataclass
class Context:
    """What a phase's strategies share."""

    device: str
    dtype: str
    model: dict[str, Any]
    batch: int
    tiny: bool
    ssd_dir: str
    min_offload_bytes: int
    host_budget_bytes: int
    budget_bytes: int | None = None
    inner: str = "inductor"


@dataclasses.dataclass
class Runner:
    phase: str
    name: str
    model: Any = None
    forward: Any = None
    optimizer: Any = None
    cache: Any = None
    status: str = "ok"
    traceback: str = ""
    samples: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    warmup: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    summary: str = ""
    decision: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def one_line(e: object, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cache_options(name: str, ctx: Context) -> dict[str, Any] | None:
    """``configure_tensor_cache`` options of an eager strategy (None: plain PyTorch)."""
    if name in ("keep", "recompute"):
        return None
    options: dict[str, Any] = dict(offload_devices=(ctx.device,))
    if name in ("host", "ssd", "host+ssd"):
        options.update(offloader=name, adaptive=False, min_offload_bytes=ctx.min_offload_bytes, keep_last_modules=1)
    if name == "host+ssd":
        options["host_budget_bytes"] = ctx.host_budget_bytes
    if name in ("ssd", "host+ssd"):
        options["ssd_dirs"] = (ctx.ssd_dir,)
    if name == "budget":
        if ctx.budget_bytes is None:
            raise ValueError("budget mode needs keep's activation peak first (keep did not run)")
        options.update(activation_budget_bytes=ctx.budget_bytes, min_offload_bytes=ctx.min_offload_bytes)
    if name == "defaults" and ctx.tiny:
        options["min_offload_bytes"] = ctx.min_offload_bytes  # the tiny model's storages are all small
    if name not in EAGER:
        raise ValueError(f"unknown strategy {name!r}; expected one of {EAGER + COMPILED}")
    return options


def build(phase: str, name: str, ctx: Context) -> Runner:
    """The strategy's model, optimizer (with its state: one step on zero gradients) and cache."""
    from tba.rok._worker import build_model, enable_recompute

    r = Runner(phase, name)
    if name in COMPILED:
        import compile_offload

        args = argparse.Namespace(device=ctx.device, seed=0, min_offload_bytes=ctx.min_offload_bytes, quick=ctx.tiny,
                               inner=ctx.inner)
        built = compile_offload._build({"compiled keep": "keep", "compiled host": "tba-host",
                                        "compiled ssd": "tba-ssd"}[name], args, dict(ctx.model), ctx.ssd_dir)
        r.model, r.forward, r.optimizer, r.cache = built.model, built.compiled, built.optimizer, built.cache
    else:
        options = cache_options(name, ctx)
        r.model = build_model(ctx.model, ctx.device, ctx.dtype)
        if name == "recompute":
            enable_recompute(r.model)
        r.optimizer = torch.optim.AdamW(r.model.parameters(), lr=1e-4, weight_decay=0.0)
        r.forward = r.model
        if options is not None:
            r.cache = tba.configure_tensor_cache(r.model, **options)
            r.notes.append("options " + ", ".join(f"{k}={v}" for k, v in options.items() if k != "offload_devices"))
    for p in r.model.parameters():  # gradients and Adam state exist before anything is measured
        p.grad = torch.zeros_like(p)
    r.optimizer.step()
    return r


def _blocks(cache: Any, sent: int) -> int:
    """Blocks the step offloaded: the boundary it ran at, 0 when it sent nothing to the
    offloader (a store cancelled because backward needed its tensor first was sent)."""
    history = getattr(getattr(cache, "_steps", None), "history", None)  # what summary() prints
    ran_at = history[-1][2] if history else 0
    return int(ran_at) if sent else 0


def timed_step(r: Runner, ids: torch.Tensor, mem: MemoryStats) -> dict[str, Any]:
    """One training step: wall time, allocator peak over what was allocated before it, and
    what the cache did in it."""
    mem.synchronize()
    before = mem.allocated_bytes()
    mem.reset_peak()
    start = time.perf_counter()
    loss = r.forward(input_ids=ids, labels=ids).loss
    loss.backward()
    del loss
    r.optimizer.step()
    r.optimizer.zero_grad(set_to_none=False)
    mem.synchronize()
    sample: dict[str, Any] = {"time_s": time.perf_counter() - start, "before_bytes": before,
                              "act_peak_bytes": mem.peak_allocated_bytes() - before}
    if r.cache is not None:
        s = r.cache.stats()
        sample.update(offloaded_bytes=s.offloaded_bytes, reloaded_bytes=s.reloaded_bytes, num_offloaded=s.num_offloaded,
                      num_cancelled=s.num_cancelled, cache_peak_bytes=s.peak_resident_bytes, stall_s=s.stall_s,
                      blocks=_blocks(r.cache, s.num_offloaded + s.num_cancelled))
    return sample


def release(r: Runner) -> None:
    """Close the cache and drop the model: its memory goes back before the next strategy."""
    if r.cache is not None:
        try:
            r.summary = r.cache.summary()
            decision = r.cache.adaptive_decision
            r.decision = None if decision is None else str(decision)
        except Exception as e:  # a failed strategy's cache may not summarise: say so, go on
            r.notes.append(f"summary unavailable: {one_line(e)}")
        try:
            r.cache.close()
        except Exception as e:
            r.notes.append(f"close raised {type(e).__name__}: {one_line(e)}")
    r.model = r.forward = r.optimizer = r.cache = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def guarded(r: Runner, what: str, fn: Callable[[], None], log: Callable[[str], None]) -> bool:
    """Run ``fn``; an exception is recorded in ``r.status`` and ``r`` released."""
    try:
        fn()
        return True
    except torch.OutOfMemoryError as e:
        r.status = f"OOM in {what}: {one_line(e, 200)}"
    except Exception as e:  # one strategy's failure is its row, not the run's end
        r.status = f"failed in {what}: {type(e).__name__}: {one_line(e)}"
        r.traceback = traceback.format_exc(limit=8)
    log(f"{r.phase}/{r.name}: {r.status}")
    release(r)
    return False


def warm_up(r: Runner, ids: torch.Tensor, mem: MemoryStats, steps: int, deadline: float) -> None:
    """``steps`` untimed steps (pool growth, compilation), for a deciding policy until its
    decision settled (tba.rok's Warmup), stopping at ``deadline``."""
    from tba.rok._warmup import Warmup

    warm = Warmup(steps, r.cache, r.name in DECIDES)
    done = 0
    while done < warm.steps:
        r.warmup.append(timed_step(r, ids, mem))
        done += 1
        warm.after_step(done)
        if time.perf_counter() > deadline and done < warm.steps:
            r.notes.append(f"warm-up cut by the time budget after {done} of {warm.steps} steps")
            break
    if warm.unsettled:
        r.notes.append(warm.unsettled)
    if r.cache is not None:
        r.cache.wait_for_stores()


def _measured(r: Runner, ids: torch.Tensor, mem: MemoryStats) -> None:
    r.samples.append(timed_step(r, ids, mem))


def measure(runners: list[Runner], ids: torch.Tensor, mem: MemoryStats, steps: int, deadline: float,
            log: Callable[[str], None]) -> None:
    """Up to ``steps`` measured steps per runner, one step of each in turn (the order rotating).

    Each runner has an equal share of the time to ``deadline``: one whose next step (timed
    like its last) would overrun its share stops there, so a slow strategy (the SSD at a large
    batch) costs its own steps, not the others'. Every runner gets at least one step while
    time is left."""
    live = [r for r in runners if r.ok]
    if not live:
        return
    start = time.perf_counter()
    share = (deadline - start) / len(live)
    spent = {id(r): 0.0 for r in live}
    stopped: set[int] = set()
    for i in range(steps):
        for r in live[i % len(live):] + live[: i % len(live)]:
            last = (r.samples or r.warmup or [{"time_s": 0.0}])[-1]["time_s"]
            if not r.ok or id(r) in stopped:
                continue
            now = time.perf_counter()
            if (now + last > deadline or spent[id(r)] + last > share) if r.samples else now > deadline:
                stopped.add(id(r))
                log(f"{r.phase}/{r.name}: stops after {len(r.samples)} measured steps (~{last:.1f} s a step, "
                    f"{share:.0f} s share)")
                continue
            t0 = time.perf_counter()
            guarded(r, f"measured step {i}", functools.partial(_measured, r, ids, mem), log)
            spent[id(r)] += time.perf_counter() - t0
    for r in live:
        if r.ok and len(r.samples) < 5:
            r.notes.append(f"{len(r.samples)} measured steps (fewer than 5: its time share, {share:.0f} s, was spent)")


def row(r: Runner, num_blocks: int) -> dict[str, Any]:
    """The runner's row for _truth_verdict: medians and maxima over the measured steps."""
    out: dict[str, Any] = {"phase": r.phase, "name": r.name, "status": r.status, "meant_to_offload": r.name in MEANT_TO_OFFLOAD,
                           "tba": r.name not in ("keep", "recompute", "compiled keep"), "decides": r.name in DECIDES,
                           "steps": len(r.samples), "notes": list(r.notes), "decision": r.decision,
                           "warmup_steps": len(r.warmup), "samples": r.samples, "summary": r.summary}
    if r.ok and not r.samples:
        out["status"] = "no measured step (time budget)"
    if not r.samples:
        return out
    s = r.samples
    out.update(step_s=statistics.median(x["time_s"] for x in s), act_peak_bytes=max(x["act_peak_bytes"] for x in s),
               baseline_bytes=statistics.median(x["before_bytes"] for x in s))
    if "offloaded_bytes" in s[0]:
        blocks = sorted({x["blocks"] for x in s})
        out.update(steps_sending_nothing=sum(not x["num_offloaded"] and not x["num_cancelled"] for x in s),
                   steps_all_cancelled=sum(not x["offloaded_bytes"] and x["num_cancelled"] > 0 for x in s),
                   offloaded_bytes=sum(x["offloaded_bytes"] for x in s), reloaded_bytes=sum(x["reloaded_bytes"] for x in s),
                   cache_peak_bytes=max(x["cache_peak_bytes"] for x in s), stall_s=statistics.median(x["stall_s"] for x in s),
                   blocks="/".join(map(str, blocks)) + f" of {num_blocks}")
    return out
