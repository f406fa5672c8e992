"""torch.distributed.pipelining with tba (2 gloo ranks, every schedule).

Per schedule: the hints the cache receives are the order the stages really run, each with the
next step of the same cache as look-ahead; losses and gradients are bit-identical to the same
schedule without tba over 2 steps with 4 microbatches, for each offloader; prefetch served
every reload (``num_sync_loads == 0``).
"""

from __future__ import annotations

import pytest

from tests.integrations import _common, _harness
from tests.integrations._torch_pp_worker import SCHEDULES, worker

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results():
    return _harness.spawn(worker, timeout_s=300)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_hints_follow_schedule(results, schedule):
    _harness.assert_case(results, f"{schedule}/baseline", f"{schedule}/hints")


@pytest.mark.parametrize(
    "schedule", [s for s, (placement, _) in SCHEDULES.items() if placement != "v"]
)
def test_eval_announces_forwards_only(results, schedule):
    _harness.assert_case(results, f"{schedule}/eval")


@pytest.mark.parametrize("offloader", _common.OFFLOADERS)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_offload_bit_exact_and_prefetched(results, schedule, offloader):
    _harness.skip_unless_offloader(offloader)
    _harness.assert_case(results, f"{schedule}/baseline", f"{schedule}/{offloader}")
