"""Run a function in N gloo processes, once, and bring back what each rank returned.

One spawn per test module (a module-scoped fixture) runs every case of that module, so the
process start and imports (seconds each on a 2-core machine) are paid once.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_workers", "run_cases", "WorkerError"]


class WorkerError(RuntimeError):
    """A worker process failed, timed out or died."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn_ref: tuple[str, str],
    args: tuple[Any, ...],
    env: dict[str, str],
    pg_timeout_s: float,
    results: Any,
) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        fn = getattr(importlib.import_module(fn_ref[0]), fn_ref[1])
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def run_workers(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout_s: float = 240.0,
    pg_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined by a gloo
    process group (``pg_timeout_s`` on every collective); return each rank's result.

    Raises:
        WorkerError: a rank raised (its traceback is included), died, or the whole run took
            longer than ``timeout_s`` (every process is then killed).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    child_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(
            target=_entry,
            args=(
                rank,
                world_size,
                port,
                (fn.__module__, fn.__name__),
                args,
                child_env,
                pg_timeout_s,
                results,
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    outputs: dict[int, tuple[str, Any]] = {}
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerError(
                    f"workers timed out after {timeout_s:.0f} s; got ranks {sorted(outputs)}"
                )
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
                outputs[rank] = (status, value)
                if status == "error":
                    break
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in outputs]
                if dead:
                    # Give a just-finished rank's message a moment to arrive.
                    with contextlib.suppress(queue.Empty):
                        rank, status, value = results.get(timeout=2.0)
                        outputs[rank] = (status, value)
                        continue
                    codes = {i: procs[i].exitcode for i in dead}
                    raise WorkerError(
                        f"worker(s) died without reporting: exit codes {codes}"
                    ) from None
    finally:
        for p in procs:
            p.join(timeout=10 if len(outputs) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    errors = {r: v for r, (s, v) in outputs.items() if s == "error"}
    if errors:
        raise WorkerError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [outputs[r][1] for r in range(world_size)]


def run_cases(rank: int, cases: dict[str, Callable[[], Any]]) -> dict[str, tuple[bool, Any]]:
    """Run every case in this process, catching each failure so one case cannot hide the rest.

    Returns ``{name: (True, value) | (False, traceback)}``. A case that fails on one rank
    may leave the other rank waiting in a collective: cases are expected to fail by assertion
    after their collectives, and the process-group timeout bounds the rest.
    """
    out: dict[str, tuple[bool, Any]] = {}
    for name, case in cases.items():
        try:
            out[name] = (True, case())
        except Exception:  # noqa: BLE001 - reported per case
            out[name] = (False, f"rank {rank}: {traceback.format_exc()}")
    return out
