"""Budget mode (Note [Budget mode]): the fewest leading blocks that keep the step's peak of
saved activations within ``activation_budget_bytes``; a warning with numbers when impossible."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import tba
from tba.cache.policy.boundary import estimate_peak, solve_budget
from tba.testing import probe
from tests import models
from tests.twin import assert_bytes_moved, run_twins

# At most one store in flight and no look-ahead: the peak depends on the boundary, not on how
# fast this (loaded) machine runs the store thread.
_CPU = dict(offload_devices=("cpu",), min_offload_bytes=0, max_inflight_bytes=1,
            prefetch_modules=0)
_BLOCKS = 6


# ---------------------------------------------------------------- solver, hand-computed
def test_estimate_moves_block_bytes() -> None:
    # Measured 100 with blocks [0, 3) offloaded; keeping block 2 adds 30, offloading 3 takes 40.
    assert estimate_peak([10, 20, 30, 40], 100, measured_at=3, tail_start=2) == 130
    assert estimate_peak([10, 20, 30, 40], 100, measured_at=3, tail_start=4) == 60
    assert estimate_peak([10, 20, 30, 40], 100, measured_at=3, tail_start=3) == 100


def test_fewest_blocks_that_fit() -> None:
    # Peak 50 with blocks [0, 4) offloaded; each kept block adds 10: 50, 60, 70, 80, 90 for
    # n = 4, 3, 2, 1, 0. Budget 75: n = 2 (70); budget 70 is inclusive; budget 100: n = 0.
    blocks = [10] * 5
    assert solve_budget(blocks, 50, 4, 75, max_tail_start=4)[:2] == (2, 70)
    assert solve_budget(blocks, 50, 4, 70, max_tail_start=4)[:2] == (2, 70)
    assert solve_budget(blocks, 50, 4, 69, max_tail_start=4)[:2] == (3, 60)
    assert solve_budget(blocks, 50, 4, 100, max_tail_start=4)[:2] == (0, 90)
    # A floor from a step that overshot: never fewer than 3 blocks.
    assert solve_budget(blocks, 50, 4, 100, min_tail_start=3, max_tail_start=4)[:2] == (3, 60)


def test_impossible_budget_offloads_everything_it_may() -> None:
    n, estimate, reason = solve_budget([10] * 5, 50, 4, 40, max_tail_start=4)
    assert (n, estimate) == (4, 50) and "cannot be met" in reason


# ---------------------------------------------------------------- the cache
def _peaks(**options) -> list[int]:
    """Peak resident bytes of each of 5 settled steps of a fresh Stack with ``options``."""
    torch.manual_seed(0)
    model = models.Stack(num_blocks=_BLOCKS)
    peaks = []
    with tba.configure_tensor_cache(model, **{**_CPU, "adaptive": False, **options}) as cache:
        for step in range(5):
            loss = model(models.vector_batch(step))
            cache.wait_for_stores(60)
            loss.backward()
            peaks.append(cache.stats().peak_resident_bytes)
    return peaks


def test_budget_met_with_the_fewest_blocks_bit_exact() -> None:
    # Offloading blocks [0, 3) fits the budget, offloading [0, 2) does not: budget mode must
    # pick exactly 3 blocks (not every block, as the default would).
    three = max(_peaks(offloader="host", keep_last_modules=_BLOCKS - 3))
    two = min(_peaks(offloader="host", keep_last_modules=_BLOCKS - 2))
    assert two > three, (two, three)
    budget = (two + three) // 2
    cache = run_twins(lambda: models.Stack(num_blocks=_BLOCKS), models.vector_batch, steps=6,
                      settle=True, offloader="host", activation_budget_bytes=budget, **_CPU)
    assert_bytes_moved(cache)
    history = list(probe(cache).history)
    assert len(history) == 6
    for number, stats, tail_start in history:
        assert 0 < stats.peak_resident_bytes <= budget, (number, stats.peak_resident_bytes, budget)
    decision = cache.adaptive_decision
    assert decision is not None and decision.tail_start == 3, str(decision)
    assert [t for _, _, t in history][-3:] == [3, 3, 3]
    assert decision.activation_budget_bytes == budget
    assert decision.estimated_peak_bytes is not None and decision.estimated_peak_bytes <= budget
    assert "budget" in cache.summary() and "fewest" in str(decision)


def test_overshooting_step_moves_the_boundary() -> None:
    # The estimate is made from a measured peak 1 MiB lower than the truth: the first step at
    # the estimated boundary peaks over the budget, and the next offloads more blocks.
    three = max(_peaks(offloader="host", keep_last_modules=_BLOCKS - 3))
    two = min(_peaks(offloader="host", keep_last_modules=_BLOCKS - 2))
    budget = (two + three) // 2
    torch.manual_seed(0)
    model = models.Stack(num_blocks=_BLOCKS)
    with tba.configure_tensor_cache(model, offloader="host", activation_budget_bytes=budget,
                                    **_CPU) as cache:
        original = cache.boundary.decide_budget

        def optimistic(*args, **kwargs):
            if kwargs.get("min_tail_start", 0) == 0:
                kwargs["peak_bytes"] -= 1 << 20  # claims the step peaked 1 MiB lower
            return original(*args, **kwargs)

        cache.boundary.decide_budget = optimistic
        for step in range(6):
            loss = model(models.vector_batch(step))
            cache.wait_for_stores(60)
            loss.backward()
        tails = [t for _, _, t in probe(cache).history]
        peaks = [s.peak_resident_bytes for _, s, _ in probe(cache).history]
    assert tails[2] == 0 and peaks[2] > budget, (tails, peaks)  # the optimistic estimate
    assert tails[3:] == [3, 3, 3], (tails, peaks)  # corrected from the measured peak
    assert cache.adaptive_decision.profiled_at_step == 2
    assert all(p <= budget for p in peaks[3:]), (peaks, budget)


def test_impossible_budget_warns_with_numbers() -> None:
    torch.manual_seed(0)
    model = models.Stack(num_blocks=_BLOCKS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tba.configure_tensor_cache(model, offloader="host", activation_budget_bytes=1000,
                                        **_CPU) as cache:
            for step in range(5):
                loss = model(models.vector_batch(step))
                cache.wait_for_stores(60)
                loss.backward()
            history = list(probe(cache).history)
    messages = [str(w.message) for w in caught if "activation_budget_bytes" in str(w.message)]
    assert len(messages) == 1, messages  # once
    message = messages[0]
    assert message.startswith("tba: activation_budget_bytes=1000 ") and "cannot be met" in message
    best = int(re.search(r"device memory is (\d+) bytes", message).group(1))
    profiled = history[1][1].peak_resident_bytes  # profile_step=2 offloads every block it may
    assert best == profiled > 1000
    assert all(t == _BLOCKS - 1 for _, _, t in history), history  # still offloads all it may


def test_budget_config_is_validated() -> None:
    with pytest.raises(ValueError) as info:
        tba.TensorCacheConfig(activation_budget_bytes=0, profile_step=0)
    assert "activation_budget_bytes=0" in str(info.value) and "profile_step=0" in str(info.value)
    with pytest.raises(ValueError, match=r"activation_budget_bytes=1\.5"):
        tba.TensorCacheConfig(activation_budget_bytes=1.5)
    with pytest.raises(ValueError, match="offloader='none'"):
        tba.TensorCacheConfig(activation_budget_bytes=1 << 20, offloader="none")
    assert tba.TensorCacheConfig(activation_budget_bytes=1 << 20).activation_budget_bytes == 1 << 20


def test_policy_docstring_examples_run() -> None:
    import doctest

    from tba.cache.policy import boundary as policy

    result = doctest.testmod(policy, raise_on_error=False, verbose=False)
    assert result.attempted >= 3 and result.failed == 0
