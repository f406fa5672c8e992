"""The closed loop in a real cache on scripted worlds (``tba.testing.ScriptedWorld``), where the
best boundary is known (Note [Bracket search]): it settles at the best boundary or one block
below, never above, within 60 measured steps of the profile, and after a drift that halves the
best boundary it is back at or below the new best within 60 steps. The everyday tests take a
few worlds; the sweep over every best boundary and seed is marked slow. No assertion rests on
real time: every second here is the world's fake clock."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tba.testing import ScriptedWorld, probe

_MEASURED_STEPS = 60  # the acceptance: settled within this many steps of the profile


@dataclasses.dataclass(frozen=True)
class _Outcome:
    world: str
    best: int
    settled_at: int | None  # the boundary, None: not settled
    steps: int | None  # measured steps from the profile to the settle

    @property
    def ok(self) -> bool:
        return (self.settled_at is not None and self.steps is not None
                and self.best - 1 <= self.settled_at <= self.best
                and self.steps <= _MEASURED_STEPS)


def _settle(world: ScriptedWorld, what: str) -> _Outcome:
    """Step ``world`` until its first check settles (at most 64 steps after the profile)."""
    for _ in range(2 + _MEASURED_STEPS + 4):
        world.step()
        decision = world.cache.adaptive_decision
        if decision is not None and decision.settled_at_step is not None:
            assert decision.profiled_at_step is not None
            return _Outcome(what, world.best_boundary(), decision.tail_start,
                            decision.settled_at_step - decision.profiled_at_step)
    return _Outcome(what, world.best_boundary(), None, None)


def _world(boundary: int, noise: float, outliers: float, seed: int) -> tuple[ScriptedWorld, str]:
    world = ScriptedWorld.with_budget_boundary(boundary, noise=noise, outlier_rate=outliers,
                                               seed=seed)
    return world, f"budget boundary {boundary}, noise {noise:.1%}, outliers {outliers:.0%}, seed {seed}"


def _drift(boundary: int, seed: int) -> tuple[int, int | None]:
    """A noisy world settles; ten steady steps later its transfer cost doubles. Returns the new
    best and the steps from the change until the loop is settled at or below it (0: it already
    was, having settled lower than the old best)."""
    world, _ = _world(boundary, 0.02, 0.05, seed)
    with world:
        first = _settle(world, "")
        assert first.settled_at is not None, "the first check did not settle"
        world.run(10)
        world.transfer_s *= 2
        new_best = world.best_boundary()
        for steps in range(0, 121):
            decision = world.cache.adaptive_decision
            if decision.settled_at_step is not None and decision.tail_start <= new_best:
                return new_best, steps
            world.step()
    return new_best, None


# ------------------------------------------------------------------ the world itself
def test_the_world_costs_what_it_scripts() -> None:
    """Without noise a keep step takes 12 x (1 + 2) = 36 s of the clock and offloading blocks
    [0, n) adds n x transfer_s; the world counts the bytes each block saves as the cache does."""
    with ScriptedWorld(0.5) as world:
        assert world.keep_step_s == 36.0
        start = world.clock.now
        world.run(2)  # the profiled step offloads blocks [0, 11)
        assert world.clock.now - start == pytest.approx(2 * (36.0 + 11 * 0.5))
        decision = world.cache.adaptive_decision
        assert list(decision.block_bytes) == world.block_bytes and min(world.block_bytes) > 0
        world.run(20)
        decision = world.cache.adaptive_decision
        assert decision.keep_step_s == pytest.approx(36.0)
        n = decision.measured_tail_start
        assert decision.offload_step_s == pytest.approx(36.0 + n * 0.5)
        assert world.cache.stats().offloaded_bytes > 0


def test_best_boundary_is_the_budget_or_what_the_saving_is_worth() -> None:
    # 5% of 36 s is 1.8 s: with_budget_boundary(k) puts it halfway between k and k + 1
    # blocks. A block saves 1/12 of the bytes, worth 1/60 of the step (5x rule): more than
    # 0.6 s a block is never worth it, so budget boundaries 1 and 2 give a best of 0.
    with ScriptedWorld.with_budget_boundary(4) as world:
        assert world.transfer_s == pytest.approx(0.4) and world.best_boundary() == 4
        assert world.best_boundary(0.7) == 0 and world.best_boundary(0.3) == 6
        assert world.best_boundary(0.0) == 11  # the kept tail (keep_last_modules=1) stays
    with ScriptedWorld.with_budget_boundary(2) as world:
        assert world.best_boundary() == 0


def test_the_world_replays_and_leaves_the_model_as_built() -> None:
    runs = []
    for _ in range(2):
        world = ScriptedWorld.with_budget_boundary(5, noise=0.02, outlier_rate=0.2, seed=7)
        with world:
            runs.append((world.run(30), world.clock.now))
        model = world.model
    assert runs[0] == runs[1]
    assert all(not b._forward_pre_hooks and not b._forward_hooks and not b._backward_pre_hooks
               for b in model.blocks)


def test_bad_arguments_are_listed_at_once() -> None:
    with pytest.raises(ValueError) as info:
        ScriptedWorld(-1.0, noise=2, outlier_rate=1.5, num_blocks=0, offloader="host")
    message = str(info.value)
    for part in ("transfer_s=-1.0", "noise=2", "outlier_rate=1.5", "num_blocks=0",
                 "offloader given: the world sets them"):
        assert part in message, message


# ------------------------------------------------------------------ a few worlds, every day
@pytest.mark.parametrize(
    ("boundary", "noise", "outliers", "seed"),
    [(11, 0.002, 0.0, 0), (6, 0.02, 0.05, 1), (3, 0.02, 0.05, 2), (9, 0.02, 0.05, 3),
     (1, 0.02, 0.05, 4)],
)
def test_settles_at_the_best_or_one_below(boundary: int, noise: float, outliers: float,
                                          seed: int) -> None:
    world, what = _world(boundary, noise, outliers, seed)
    with world:
        outcome = _settle(world, what)
        events = [(e.step, e.kind, e.tail_start) for e in probe(world.cache).loop_events]
    assert outcome.ok, (outcome, events)


def test_drift_is_followed_within_60_steps() -> None:
    new_best, steps = _drift(10, seed=5)
    assert new_best == 5 and steps is not None and steps <= _MEASURED_STEPS, steps


# ------------------------------------------------------------------ the sweep
@pytest.mark.slow
def test_sweep_over_every_best_boundary() -> None:
    """110 noisy runs (best boundary by the budget 1 to 11, noise up to 2% per block, 5% of
    steps 10-40% slower, ten seeds each) and 22 quiet ones: at least 98% settle at the best
    boundary or one below, each within 60 measured steps of the profile, and at most one
    above. Not none: a boundary just over the budget (for a best of 9, ten blocks cost
    +5.26%) differs from the budget by less than the noise of one pair (0.36%), and a check
    of at most 60 steps passes it in about 1 in 600 checks (benchmarks/scripted_worlds.py,
    4400 checks; docs/policy.md). Here: budget boundary 9, seed 905."""
    torch.set_num_threads(1)
    outcomes = []
    for boundary in range(1, 12):
        for seed in range(10):
            world, what = _world(boundary, 0.02, 0.05, 100 * boundary + seed)
            with world:
                outcomes.append(_settle(world, what))
        for seed in range(2):
            world, what = _world(boundary, 0.002, 0.0, 100 * boundary + seed)
            with world:
                outcomes.append(_settle(world, what))
    failed = [o for o in outcomes if not o.ok]
    above = [o for o in outcomes if o.settled_at is not None and o.settled_at > o.best]
    assert len(above) <= 1, above
    assert len(failed) <= 0.02 * len(outcomes), failed


@pytest.mark.slow
def test_sweep_drift_halving_the_best() -> None:
    """Worlds whose best boundary is 8 to 11 settle; then their transfer cost doubles (best 4
    or 5): back at or below the new best within 60 steps, five seeds each."""
    late = []
    for boundary in range(8, 12):
        for seed in range(5):
            new_best, steps = _drift(boundary, 100 * boundary + seed)
            if steps is None or steps > _MEASURED_STEPS:
                late.append((boundary, seed, new_best, steps))
    assert not late, late


def test_the_examples_in_the_docstrings_run() -> None:
    import doctest

    from tba.testing import _scripted_world

    result = doctest.testmod(_scripted_world, raise_on_error=False, verbose=False)
    assert result.attempted > 0 and result.failed == 0
