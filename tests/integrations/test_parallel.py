"""tba under DistributedDataParallel and tensor parallelism (DTensor), 2 gloo ranks:
bit-identical losses and gradients with offloading on, for each offloader."""

from __future__ import annotations

import pytest

from tests.integrations import _common, _harness
from tests.integrations._parallel_worker import worker

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results():
    return _harness.spawn(worker, timeout_s=240)


@pytest.mark.parametrize("offloader", _common.OFFLOADERS)
@pytest.mark.parametrize("style", ["ddp", "tp"])
def test_bit_exact_with_offload(results, style, offloader):
    _harness.skip_unless_offloader(offloader)
    _harness.assert_case(results, f"{style}/baseline", f"{style}/{offloader}")
