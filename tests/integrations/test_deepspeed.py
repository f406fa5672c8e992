"""DeepSpeed's PipelineEngine (TrainSchedule) with tba (2 gloo ranks, CPU accelerator).

Hints follow the real order, a backward is announced before the RecvGrad that precedes it
(its reload overlaps the communication); bit-identical losses and gradients over 2 steps
with 4 microbatches, for each offloader; ``num_sync_loads == 0``.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.integrations import _common, _harness

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="deepspeed is not installed (pip install 'tba[integrations]')",
    ),
]


@pytest.fixture(scope="module")
def results():
    from tests.integrations._deepspeed_worker import worker

    return _harness.spawn(
        worker, timeout_s=300, env={"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    )


def test_hints_follow_schedule(results):
    _harness.assert_case(results, "TrainSchedule/baseline", "TrainSchedule/hints")


def test_eval_batch_hints(results):
    _harness.assert_case(results, "InferenceSchedule/hints")


@pytest.mark.parametrize("offloader", _common.OFFLOADERS)
def test_offload_bit_exact_and_prefetched(results, offloader):
    _harness.skip_unless_offloader(offloader)
    _harness.assert_case(results, "TrainSchedule/baseline", f"TrainSchedule/{offloader}")
