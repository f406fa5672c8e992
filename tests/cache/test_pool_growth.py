"""Note [Pool growth is not transfer time] (tba/offloaders/cpu_time.py): the seconds a store
spends growing the offloader's pool are kept out of the write time the boundary rule reads,
counted apart, and a step that grew the pool is no sample of the closed loop. Time here is
scripted: the store workers' ``perf_counter`` is a counter the offloader moves (no sleeping)."""

from __future__ import annotations

import threading
import types
from typing import Any

import pytest
import torch
from torch import nn

import tba
import tba.cache.engine.workers as workers
from tba.cache.policy.closed_loop import OverheadLoop
from tba.offloaders.cpu_time import charge_pool_growth
from tba.offloaders.wrapper import OffloaderWrapper
from tba.testing import FakeOffloader, probe

_COPY_S_PER_BYTE = 1e-6  # the scripted link: 1 MB/s
_GROWTH_S_PER_BYTE = 2e-9 * 1e3  # new pool bytes: 2 s per GB, scaled up 1000x for tiny tensors


class _ScriptedCounter:
    def __init__(self) -> None:
        self.now = 0.0
        self.lock = threading.Lock()

    def perf_counter(self) -> float:
        with self.lock:
            return self.now

    def monotonic(self) -> float:
        import time

        return time.monotonic()

    def advance(self, seconds: float) -> None:
        with self.lock:
            self.now += seconds


class _GrowingPool(OffloaderWrapper):
    """Each store's copy takes scripted time; bytes beyond the pool's size grow it first."""

    passes_store_now = False  # every store on a worker, timed

    def __init__(self, counter: _ScriptedCounter) -> None:
        super().__init__(FakeOffloader(), "growing")
        self.counter = counter
        self.pool_bytes = 0
        self.held = 0
        self.growth_s = 0.0
        self.copy_s = 0.0
        self._sizes: dict[Any, int] = {}

    def store(self, src: torch.Tensor) -> Any:
        num_bytes = src.numel() * src.element_size()
        self.held += num_bytes
        grown = max(0, self.held - self.pool_bytes)
        self.pool_bytes += grown
        growth = grown * _GROWTH_S_PER_BYTE
        if growth:
            self.counter.advance(growth)
            charge_pool_growth(growth)
            self.growth_s += growth
        self.counter.advance(num_bytes * _COPY_S_PER_BYTE)
        self.copy_s += num_bytes * _COPY_S_PER_BYTE
        token = super().store(src)
        self._sizes[token] = num_bytes
        return token

    def release(self, token: Any) -> None:
        self.held -= self._sizes.pop(token)
        super().release(token)


def test_growth_is_counted_apart_from_write_time(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = _ScriptedCounter()
    monkeypatch.setattr(workers, "time", types.SimpleNamespace(
        perf_counter=counter.perf_counter, monotonic=counter.monotonic))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)))
    offloader = _GrowingPool(counter)
    with tba.configure_tensor_cache(model, offloader=offloader, offload_devices=("cpu",),
                                    min_offload_bytes=0, adaptive=False) as cache:
        for block in model:  # every store lands in its step (none forwarded from memory)
            block.register_forward_hook(lambda *_: cache.wait_for_stores(60))
        for _ in range(3):
            model(torch.randn(8, 64)).sum().backward()
        history = probe(cache).history
    steps = [stats for _, stats, _ in history]
    assert all(s.offloaded_bytes > 0 for s in steps)
    assert steps[0].pool_growth_s > 0 and offloader.growth_s > 0
    assert sum(s.pool_growth_s for s in steps) == pytest.approx(offloader.growth_s)
    for s in steps:
        # Bandwidth is the link's exactly, the growing step's too.
        assert s.write_s == pytest.approx(s.offloaded_bytes * _COPY_S_PER_BYTE)
        assert s.write_bytes_per_s == pytest.approx(1 / _COPY_S_PER_BYTE)


def _loop_run(grew: bool) -> tuple[int, int, int]:
    """A loop measuring a boundary whose offload steps cost 1%; with ``grew`` the timed steps
    of the first two offload runs grew the pool (pinning: 10x the step) and say so."""
    loop = OverheadLoop(0.05)
    at = loop.start(2, [10, 10, 10])
    previous, growths = None, 0
    for _ in range(40):
        grows = grew and at != 0 and previous == at and growths < 2
        growths += grows
        seconds = 10.0 if grows else (1.0 if at == 0 else 1.01)
        next_at = loop.observe(at, seconds, grew_pool=grows)
        assert next_at is not None  # no re-profile asked for
        previous, at = at, next_at
        if not loop.probing:
            break
    return at, loop.candidate, growths


def test_the_loop_takes_no_sample_from_a_step_that_grew_the_pool() -> None:
    clean = _loop_run(grew=False)
    assert clean == (2, 2, 0)
    assert _loop_run(grew=True)[:2] == clean[:2]
    assert _loop_run(grew=True)[2] == 2
