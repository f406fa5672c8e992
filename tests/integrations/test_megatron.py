"""Megatron-core's three forward_backward schedules with tba (2 gloo ranks, CUDA shim).

Per schedule: hints follow the real order (forwards by ``current_microbatch``, backwards
matched through their output tensor); bit-identical losses and gradients over 2 steps with 4
microbatches, for each offloader; ``num_sync_loads == 0``.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.integrations import _common, _harness

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("megatron.core") is None,
        reason="megatron-core is not installed (pip install 'tba[integrations]')",
    ),
]

SCHEDULES = ("no_pipelining", "without_interleaving", "with_interleaving")


@pytest.fixture(scope="module")
def results():
    from tests.integrations._megatron_worker import worker

    return _harness.spawn(worker, timeout_s=300, env={"PYTHONWARNINGS": "ignore"})


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_hints_follow_schedule(results, schedule):
    _harness.assert_case(results, f"{schedule}/baseline", f"{schedule}/hints")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_forward_only_hints(results, schedule):
    _harness.assert_case(results, f"{schedule}/forward_only")


@pytest.mark.parametrize("offloader", _common.OFFLOADERS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_offload_bit_exact_and_prefetched(results, schedule, offloader):
    _harness.skip_unless_offloader(offloader)
    _harness.assert_case(results, f"{schedule}/baseline", f"{schedule}/{offloader}")
