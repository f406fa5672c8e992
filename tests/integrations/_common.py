"""Checks shared by the engine workers: bit-exactness, hint order, real-cache stats."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch

OFFLOADERS = ("host", "ssd")


def offloader_skip_reason(name: str) -> str | None:
    """Why the ``name`` offloader cannot be tested here (``None``: it can)."""
    if importlib.util.find_spec("tba") is None or not hasattr(
        __import__("tba"), "configure_tensor_cache"
    ):
        return "tba.configure_tensor_cache is not available"
    if name == "ssd" and importlib.util.find_spec("tba.offloaders.ssd") is None:
        return "the SSD offloader (tba.offloaders.ssd) is not available"
    return None


def real_cache(module: torch.nn.Module, offloader: str, tmp_dir: str) -> Any:
    import tba

    options: dict[str, Any] = dict(
        offloader=offloader, offload_devices=("cpu",), min_offload_bytes=0
    )
    if offloader == "ssd":
        options["ssd_dirs"] = (tmp_dir,)
    return tba.configure_tensor_cache(module, **options)


def stats_dict(cache: Any) -> dict[str, Any] | None:
    """Cumulative stats of a real cache (a plain dict, picklable); ``None`` for others."""
    if cache is None or not hasattr(cache, "stats"):
        return None
    return dataclasses.asdict(cache.stats(cumulative=True))


def check_bit_exact(expected: dict[str, Any], got: dict[str, Any]) -> None:
    """Losses and gradients of every step are bit-identical (``torch.equal``)."""
    assert len(expected["losses"]) == len(got["losses"])
    for step, (a, b) in enumerate(zip(expected["losses"], got["losses"])):
        assert len(a) == len(b), f"step {step}: {len(a)} losses vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {step} loss {i}: {x.item()!r} != {y.item()!r}"
    for step, (a, b) in enumerate(zip(expected["grads"], got["grads"])):
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
    """Each stand-in cache saw exactly its stage's steps in schedule order, each carrying the
    next step of the same cache as look-ahead (Note [one cache per stage module])."""
    expected = [tuple(s) for s in got["expected"]]
    for step, (logs, lookaheads) in enumerate(zip(got["logs"], got["lookahead"])):
        for stage, log in logs.items():
            want = split_by_cache(expected, stage)
            assert [tuple(s) for s in log] == want, (
                f"step {step} stage {stage}: cache saw\n  {log}\nschedule order is\n  {want}"
            )
            want_next = [tuple(want[i + 1]) if i + 1 < len(want) else (None, None, None)
                         for i in range(len(want))]
            assert [tuple(s) for s in lookaheads[stage]] == want_next, (
                f"step {step} stage {stage}: look-ahead\n  {lookaheads[stage]}\nexpected\n  {want_next}"
            )


def check_real_cache(got: dict[str, Any]) -> None:
    """The real cache saw the schedule's order, offloaded something, and every reload was
    served by prefetch (``num_sync_loads == 0``)."""
    expected = [tuple(s) for s in got["expected"]]
    for step, logs in enumerate(got["logs"]):
        for stage, log in logs.items():
            want = split_by_cache(expected, stage)
            assert [tuple(s) for s in log] == want, (
                f"step {step} stage {stage}: cache stage_log\n  {log}\nschedule order is\n  {want}"
            )
    final = got["stats"][-1]
    for stage, stats in final.items():
        assert stats is not None
        assert stats["offloaded_bytes"] > 0, f"stage {stage}: nothing was offloaded: {stats}"
        assert stats["num_sync_loads"] == 0, f"stage {stage}: backward loaded synchronously: {stats}"
