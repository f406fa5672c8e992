"""tba's stores, loads and stalls in torch.profiler traces (Note [Profiler ranges])."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import tba
from tba.cache.observe import profiler_ranges
from tba.cache.observe.profiler_ranges import LoadDone
from tests import models
from tests.cache.fakes import FakeOffloader
from tests.waits import wait_until

_all_threads = pytest.importorskip("torch._C._profiler")._ExperimentalConfig


def _waiting_for_a_load(thread_id: int) -> bool:
    """Whether thread ``thread_id`` is blocked in ``LoadDone.wait`` (a stall)."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_name == "wait" and isinstance(frame.f_locals.get("self"), LoadDone):
            return True
        frame = frame.f_back
    return False


class StallingOffloader(FakeOffloader):
    """Its first load waits until the training thread waits for a load: backward stalls at
    least once, whatever the machine's speed."""

    def __init__(self, training_thread: int) -> None:
        super().__init__()
        self.training_thread = training_thread
        self.first = True

    def load(self, token: int, dst: torch.Tensor) -> None:
        if self.first:
            self.first = False
            assert wait_until(lambda: _waiting_for_a_load(self.training_thread), 30), (
                "the training thread never waited for a load")
        super().load(token, dst)


@pytest.mark.timing
def test_stores_loads_and_stalls_are_profiler_ranges_with_unit_names() -> None:
    model = models.Stack(num_blocks=4)
    offloader = StallingOffloader(threading.get_ident())
    with tba.configure_tensor_cache(model, offloader=offloader, offload_devices=("cpu",),
                                    min_offload_bytes=0, adaptive=False) as cache:
        config = _all_threads(profile_all_threads=True)
        with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
            loss = model(models.vector_batch(0))
            cache.wait_for_stores(60)  # every store completes: backward reads them all back
            loss.backward()
        stats = cache.stats()
    assert stats.num_offloaded > 0 and stats.reloaded_bytes == stats.offloaded_bytes
    assert stats.stall_s > 0
    events = prof.events()
    ranges = [e for e in events if e.name.startswith("tba::")]
    stores = [e for e in ranges if e.name.startswith("tba::store ")]
    loads = [e for e in ranges if e.name.startswith("tba::load ")]
    stalls = [e for e in ranges if e.name.startswith("tba::stall ")]
    assert len(stores) == stats.num_offloaded
    assert len(loads) == offloader.num_loads > 0
    assert stalls
    # Named after the units that saved them: the embedding and every offloaded block (the
    # last block is the kept tail).
    units = {e.name.split(" ", 1)[1] for e in stores}
    assert units == {"embed", "blocks.0", "blocks.1", "blocks.2"}, units
    assert {e.name.split(" ", 1)[1] for e in loads} == units
    assert {e.name.split(" ", 1)[1] for e in stalls} <= units
    # Stalls sit on the training thread (with the model's own ops), transfers on workers.
    training = {e.thread for e in events if e.name == "aten::addmm"}
    assert {e.thread for e in stalls} <= training
    assert not {e.thread for e in stores + loads} & training


def test_no_profiler_no_range() -> None:
    # With no profiler running a transfer enters the shared no-op context: nothing is named.
    class _Entry:
        scope = None
        nbytes = 1

    assert not torch.autograd.profiler._is_profiler_enabled
    assert profiler_ranges.transfer_range("store", _Entry()) is profiler_ranges._OFF
    with profile(activities=[ProfilerActivity.CPU]):
        assert profiler_ranges.transfer_range("store", _Entry()) is not profiler_ranges._OFF
    assert profiler_ranges.transfer_range("load", _Entry()) is profiler_ranges._OFF
