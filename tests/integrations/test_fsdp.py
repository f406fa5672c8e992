"""tba under FSDP2 ``fully_shard`` (2 gloo ranks, CPU), ``reshard_after_forward`` True and
False: bit-identical losses and gradients over 3 Adam steps, bytes really offloaded and
reloaded, and no parameter bytes among them (Note [Parameters are never offloaded] in
tba/cache/tensor_cache.py)."""

from __future__ import annotations

import pytest

from tests.integrations import _harness
from tests.integrations._fsdp_worker import worker

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results():
    return _harness.spawn(worker, timeout_s=240)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fsdp2_bit_exact_and_no_parameter_bytes_offloaded(results, reshard_after_forward):
    _harness.assert_case(
        results,
        "plain/tba",
        f"fsdp/{reshard_after_forward}/baseline",
        f"fsdp/{reshard_after_forward}/tba",
        f"fsdp/{reshard_after_forward}/check",
    )
