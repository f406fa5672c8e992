"""Pytest side of the engine tests: one spawn per module, one pytest test per case."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.integrations import _common
from tests.integrations._dist import run_workers


def available_offloaders() -> list[str]:
    return [o for o in _common.OFFLOADERS if _common.offloader_skip_reason(o) is None]


def spawn(
    worker: Callable[..., Any], *, timeout_s: float, env: dict[str, str] | None = None
) -> Any:
    """Run every case of ``worker`` in 2 gloo processes (once per test module)."""
    return run_workers(worker, available_offloaders(), timeout_s=timeout_s, env=env)


def assert_case(results: list[dict[str, tuple[bool, Any]]], *names: str) -> None:
    """Fail with the worker's traceback if case ``name`` failed on any rank."""
    for name in names:
        for rank, cases in enumerate(results):
            if name not in cases:
                pytest.fail(f"rank {rank} did not run case {name!r}", pytrace=False)
            ok, value = cases[name]
            if not ok:
                pytest.fail(f"case {name!r} failed:\n{value}", pytrace=False)


def skip_unless_offloader(offloader: str) -> None:
    reason = _common.offloader_skip_reason(offloader)
    if reason is not None:
        pytest.skip(reason)
