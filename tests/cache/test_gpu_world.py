"""The default adaptive policy on GPU worlds (``tba.testing.GpuWorld``; Note [A GPU world on
scripted time]): transfers hide up to a knee, the pinned pool costs time when it grows. The
real cache, rule and closed loop decide; every second is the world's fake clock (no real
time, no sleeping). The everyday tests take a few seeded worlds; the sweep is marked slow
(and is benchmarks/gpu_worlds.py)."""

from __future__ import annotations

import pytest

from tba.cache.policy.boundary import BoundaryDecision
from tba.testing import GpuWorld, probe

_OPTIONS = dict(noise=0.02, outlier_rate=0.05, max_step_overhead=0.02)


def _decision(world: GpuWorld) -> BoundaryDecision:
    decision = world.cache.adaptive_decision
    assert decision is not None
    return decision


def _settled(world: GpuWorld, max_steps: int = 62) -> int | None:
    """Steps until the check settles (the profiled step, then at most 60 measured steps)."""
    for _ in range(max_steps):
        world.step()
        decision = world.cache.adaptive_decision
        if decision is not None and decision.settled_at_step is not None:
            return decision.tail_start
    return None


def test_the_h100_preset_costs_what_it_scripts() -> None:
    with GpuWorld.h100() as world:
        assert world.keep_step_s == pytest.approx(0.077)
        # 0.6 GB a block at 47 GB/s each way: 4 blocks' loads hide under the 51 ms backward.
        assert world.physical_bound() == 4
        assert world.exposed_s(4) == 0.0 and world.exposed_s(5) > 0.015
        keep = world.clock.now
        world.step()  # the profiled step offloads blocks [0, 11)
        first = world.clock.now - keep
        # Its exposed transfers and the pool's growth (11 x 0.6 GB at 0.65 s/GB, ~4.3 s).
        assert world.pool_growth_s == pytest.approx(11 * 0.6 * 0.65, rel=1e-6)
        assert first == pytest.approx(world.keep_step_s + world.exposed_s(11)
                                      + world.pool_growth_s, rel=1e-6)
        assert probe(world.cache).history[-1][1].pool_growth_s == pytest.approx(
            world.pool_growth_s, rel=1e-6)


@pytest.mark.parametrize("bound", range(1, 12))
def test_with_bound_puts_the_knee_after_bound_blocks(bound: int) -> None:
    with GpuWorld.with_bound(bound) as world:
        assert world.physical_bound() == bound
        half_block = world.world_block_bytes / world.bytes_per_s / 2
        assert world.exposed_s(bound + 1) == pytest.approx(half_block, rel=1e-6)


def test_bad_arguments_are_listed_at_once() -> None:
    with pytest.raises(ValueError) as info:
        GpuWorld(0, block_bytes=-1, pool_growth_s_per_byte=-1, transfer_s=1.0)
    text = str(info.value)
    for name in ("bytes_per_s=0", "block_bytes=-1", "pool_growth_s_per_byte=-1", "transfer_s"):
        assert name in text


@pytest.mark.parametrize(("bound", "seed"), [(1, 3), (4, 0), (4, 1), (7, 0), (10, 2), (11, 0)])
def test_settles_at_the_bound_or_one_below_and_stays(bound: int, seed: int) -> None:
    with GpuWorld.with_bound(bound, seed=seed, **_OPTIONS) as world:
        at = _settled(world)
        assert at is not None and bound - 1 <= at <= bound, (at, bound)
        decisions = set()
        for _ in range(200):
            world.step()
            decision = _decision(world)
            if decision.settled_at_step is not None:
                decisions.add(decision.tail_start)
        assert decisions <= {bound - 1, bound}, decisions
        # Note [The pool stays while the loop measures]: keep runs gave nothing back.
        assert world.num_pool_given_back == 0


def test_pool_growth_changes_no_decision() -> None:
    """Each new pool byte costing 2 s per GB (scripted) leaves every boundary as without it;
    the steps that grew the pool report it apart from their transfers."""
    runs = {}
    for cost in (0.0, 2.0 / 1e9):
        with GpuWorld.with_bound(4, seed=5, pool_growth_s_per_byte=cost, **_OPTIONS) as world:
            runs[cost] = world.run(120)
            grew = [s for _, s, _ in probe(world.cache).history if s.pool_growth_s > 0]
            assert bool(grew) == (cost > 0)
            assert _decision(world).tail_start in (3, 4)
    assert runs[0.0] == runs[2.0 / 1e9]


@pytest.mark.parametrize(("bound", "new_bound"), [(8, 4), (3, 6)])
def test_a_drift_is_followed_within_60_steps(bound: int, new_bound: int) -> None:
    """The bound halves (steady steps over the limit: checked again) or doubles (a run
    above it hides: Note [Looking up]): back at the new bound or one below."""
    with GpuWorld.with_bound(bound, seed=0, **_OPTIONS) as world:
        assert _settled(world) in (bound - 1, bound)
        world.run(10)
        world.bytes_per_s = world.read_bytes_per_s = world.bandwidth_for(new_bound)
        world.run(60)
        decision = _decision(world)
        assert decision.settled_at_step is not None
        assert decision.tail_start in (new_bound - 1, new_bound)
        looked_up = any(e.kind == "suspect" and "more may hide" in e.text
                        for e in probe(world.cache).loop_events)
        assert looked_up == (new_bound > bound)


@pytest.mark.slow
def test_sweep_over_every_bound() -> None:
    """110 worlds (bounds 1-11, ten seeds): >= 98% settle at the bound or one below within 60
    measured steps, at most 1% above (the issue's acceptance; the sweep measured 110 of 110
    and none above, docs/policy.md)."""
    ok = above = 0
    for bound in range(1, 12):
        for seed in range(10):
            with GpuWorld.with_bound(bound, seed=seed, **_OPTIONS) as world:
                at = _settled(world)
                ok += at is not None and bound - 1 <= at <= bound
                above += at is not None and at > bound
    assert ok >= 0.98 * 110 and above <= 1


def test_the_examples_in_the_docstrings_run() -> None:
    import doctest

    import tba.testing._gpu_world as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
