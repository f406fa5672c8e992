"""`tba.testing.drive_closed_loop` and `FakeStepClock`: the seam tests drive the closed loop
through (its decisions under scripted time: tests/cache/test_closed_loop.py)."""

from __future__ import annotations

import pytest

import tba
from tba.testing import FakeStepClock, drive_closed_loop, probe
from tests import models


def test_fake_clock_moves_only_forward_when_told() -> None:
    clock = FakeStepClock(start_s=2.0)
    start = clock.mark()
    assert clock.seconds(start, clock.mark()) == 0.0
    clock.advance(0.25)
    assert clock.seconds(start, clock.mark()) == 0.25 and clock.now == 2.25
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="FakeStepClock.advance"):
            clock.advance(bad)


def test_the_clock_times_the_steps() -> None:
    """Steps timed by the installed clock: each block advances it 1 s, so the profile and the
    loop read whole seconds (six blocks: 6 s a keep step)."""
    clock = FakeStepClock()
    model = models.Stack(num_blocks=6)
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: clock.advance(1.0))
    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                    min_offload_bytes=0) as cache:
        drive_closed_loop(cache, clock=clock, free_bytes=lambda: 1 << 40)
        assert probe(cache).has_closed_loop
        for step in range(1, 19):  # profile (1-2); four pairs: the rule's boundary alone
            loss = model(models.vector_batch(step))
            cache.wait_for_stores(60)
            loss.backward()
        decision = cache.adaptive_decision
        kinds = [(e.kind, e.tail_start) for e in probe(cache).loop_events]
    assert decision.keep_step_s == pytest.approx(6.0) and decision.settled_at_step == 18
    assert kinds == [("measure", 5), ("pass", 5), ("settle", 5)]


def test_bad_use_is_an_error_listing_every_problem() -> None:
    model = models.Stack(num_blocks=3)
    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                    min_offload_bytes=0, max_step_overhead=None) as cache:
        model(models.vector_batch(0)).backward()
        with pytest.raises(ValueError) as info:
            drive_closed_loop(cache, clock=FakeStepClock(), free_bytes=lambda: 0, keep_every=0)
        message = str(info.value)
        assert "free_bytes, keep_every given, but this cache has no closed loop" in message
        assert "keep_every=0: pass a positive int" in message
        assert "clock given after the model's first forward" in message
        assert probe(cache).loop_events == []
