"""Checks shared by the engine workers: bit-exactness, hint order, real-cache stats."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Iterator
from typing import Any

import torch

OFFLOADERS = ("host", "ssd")

#: The real caches of the running case whose stores each ``SettleStores`` completes (a list
#: while ``settling()`` is on, else None). Tiny test models finish forward before the store
#: threads write anything, and the cache then rightly forwards every tensor from memory, more so
#: on a busy machine: completing the stores at the end of each stage's forward makes backward
#: really reload (and prefetch is tested) whatever the load. Numerics are unaffected.
settled: list[Any] | None = None


class SettleStores(torch.nn.Module):
    """Last module of a test stage: completes the stores of the caches ``settling()``
    collected (no parameters, saves nothing)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if settled is not None and torch.is_grad_enabled():
            for cache in settled:
                cache.wait_for_stores(60)
        return x


def offloader_skip_reason(name: str) -> str | None:
    """Why the ``name`` offloader cannot be tested here (``None``: it can)."""
    if importlib.util.find_spec("tba") is None or not hasattr(
        __import__("tba"), "configure_tensor_cache"
    ):
        return "tba.configure_tensor_cache is not available"
    if name == "ssd" and importlib.util.find_spec("tba.offloaders.ssd") is None:
        return "the SSD offloader (tba.offloaders.ssd) is not available"
    return None


@contextlib.contextmanager
def settling() -> Iterator[None]:
    """Within the block, ``real_cache`` collects the caches it makes and each
    ``SettleStores`` completes their stores."""
    global settled
    settled = []
    try:
        yield
    finally:
        settled = None


def recording_cache(module: torch.nn.Module) -> Any:
    """A fake cache that records the hints, registered for ``module``."""
    from tba.integrations import registry
    from tests.integrations._fakes import RecordingCache

    cache = RecordingCache()
    registry.register(cache, module)
    return cache


@contextlib.contextmanager
def patched(engine: Any) -> Iterator[None]:
    """``engine.patch()`` for the duration of the block."""
    engine.patch()
    try:
        yield
    finally:
        engine.unpatch()


def new_results() -> dict[str, Any]:
    """What an engine worker returns, per step: losses, grads, hint logs, look-ahead, stats."""
    return {key: [] for key in ("losses", "grads", "logs", "lookahead", "stats", "executed")}


def record_caches(out: dict[str, Any], caches: dict[int, Any], starts: dict[int, int]) -> None:
    """Append this step's hint log (from ``starts``), look-ahead and stats of every cache."""
    from tests.integrations._fakes import RecordingCache

    out["logs"].append({s: list(getattr(c, "stage_log", ()))[starts[s]:] for s, c in caches.items()})
    out["lookahead"].append(
        {s: c.lookahead_log() for s, c in caches.items() if isinstance(c, RecordingCache)}
    )
    out["stats"].append({s: stats_dict(c) for s, c in caches.items()})


def real_cache(module: torch.nn.Module, offloader: str, tmp_dir: str) -> Any:
    import tba

    options: dict[str, Any] = dict(
        offloader=offloader, offload_devices=("cpu",), min_offload_bytes=0
    )
    if offloader == "ssd":
        options["ssd_dirs"] = (tmp_dir,)
    cache = tba.configure_tensor_cache(module, **options)
    if settled is not None:
        settled.append(cache)
    return cache


def stats_dict(cache: Any) -> dict[str, Any] | None:
    """Cumulative stats of a real cache (a plain dict, picklable); ``None`` for others."""
    if cache is None or not hasattr(cache, "stats"):
        return None
    return dataclasses.asdict(cache.stats(cumulative=True))


def check_bit_exact(expected: dict[str, Any], got: dict[str, Any]) -> None:
    """Losses and gradients of every step are bit-identical (``torch.equal``)."""
    assert len(expected["losses"]) == len(got["losses"])
    for step, (a, b) in enumerate(zip(expected["losses"], got["losses"], strict=True)):
        assert len(a) == len(b), f"step {step}: {len(a)} losses vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"step {step} loss {i}: {x.item()!r} != {y.item()!r}"
    for step, (a, b) in enumerate(zip(expected["grads"], got["grads"], strict=True)):
        assert a.keys() == b.keys(), f"step {step}: gradient names differ"
        for name in a:
            if a[name] is None or b[name] is None:
                assert a[name] is None and b[name] is None, f"step {step} {name}: None mismatch"
                continue
            diff = (a[name] - b[name]).abs().max().item()
            assert torch.equal(a[name], b[name]), f"step {step} grad {name} differs (max {diff})"


def split_by_cache(expected: list[tuple[int, int, str]], stage: int) -> list[tuple[int, int, str]]:
    return [step for step in expected if step[0] == stage]


def check_hints(got: dict[str, Any]) -> None:
    """Each stand-in cache saw exactly its stage's steps in the order they really ran
    (``got["executed"]``, recorded below tba's wrappers), each carrying the next step of the
    same cache as look-ahead (Note [one cache per stage module] in tba/integrations/_hints.py)."""
    for step, (logs, lookaheads) in enumerate(zip(got["logs"], got["lookahead"], strict=True)):
        expected = [tuple(s) for s in got["executed"][step]]
        assert expected, f"step {step}: nothing was executed"
        for stage, log in logs.items():
            want = split_by_cache(expected, stage)
            assert [tuple(s) for s in log] == want, (
                f"step {step} stage {stage}: cache saw\n  {log}\nschedule order is\n  {want}"
            )
            want_next = [
                tuple(want[i + 1]) if i + 1 < len(want) else (None, None, None)
                for i in range(len(want))
            ]
            assert [tuple(s) for s in lookaheads[stage]] == want_next, (
                f"step {step} stage {stage}: look-ahead\n  {lookaheads[stage]}\n"
                f"expected\n  {want_next}"
            )


def check_real_cache(got: dict[str, Any]) -> None:
    """The real cache saw the schedule's order, offloaded and read back something (its stores
    settled: ``settling()``), and every reload was served by prefetch (``num_sync_loads == 0``)."""
    for step, logs in enumerate(got["logs"]):
        expected = [tuple(s) for s in got["executed"][step]]
        for stage, log in logs.items():
            want = split_by_cache(expected, stage)
            assert [tuple(s) for s in log] == want, (
                f"step {step} stage {stage}: cache stage_log\n  {log}\nschedule order is\n  {want}"
            )
    final = got["stats"][-1]
    for stage, stats in final.items():
        assert stats is not None
        assert stats["offloaded_bytes"] > 0, f"stage {stage}: nothing was offloaded: {stats}"
        assert stats["reloaded_bytes"] > 0, f"stage {stage}: nothing was read back: {stats}"
        assert stats["num_sync_loads"] == 0, (
            f"stage {stage}: backward loaded synchronously: {stats}"
        )


def record_stores(cache: Any) -> list[int]:
    """Wrap ``cache``'s offloader so every store records the data pointer it reads from (to
    check that no parameter storage is ever written out)."""
    ptrs: list[int] = []
    original = cache.offloader.store

    def store(src: torch.Tensor) -> Any:
        ptrs.append(src.data_ptr())
        return original(src)

    cache.offloader.store = store
    return ptrs


def parameter_storages(model: torch.nn.Module) -> set[int]:
    """Data pointers of the storages holding ``model``'s parameters on this rank."""
    return {
        getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in model.parameters()
    }
