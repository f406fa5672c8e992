"""CPU tests of the CUDA-path rules of the cache (issue 16): CUDA-graph capture, subclasses
with pending work, storages freed behind autograd's back."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

import tba
from tba import _torch_compat as compat
from tba.cache.tensor_cache import TensorCache
from tba.testing import probe
from tests import models
from tests.cache.fakes import FakeOffloader

JOIN_S = 30.0


def make_cache(model: nn.Module, offloader, **options) -> TensorCache:
    options = {"offload_devices": ("cpu",), "min_offload_bytes": 0, "keep_last_modules": 0,
               "adaptive": False, **options}
    return TensorCache(model, tba.TensorCacheConfig(offloader=offloader, **options), offloader)


def test_saves_under_capture_stay_with_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [CUDA-graph capture]: pack under (mocked) capture returns the tensor itself,
    queues nothing, warns once and counts it."""
    monkeypatch.setattr(compat, "capturing", lambda: True)
    offloader = FakeOffloader()
    model = models.Stack(num_blocks=3)
    twin = models.Stack(num_blocks=3)
    twin.load_state_dict(model.state_dict())
    cache = make_cache(model, offloader)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(2):
                torch.manual_seed(step)
                a = model(models.vector_batch(step))
                a.backward()
                torch.manual_seed(step)
                b = twin(models.vector_batch(step))
                b.backward()
                assert torch.equal(a, b)
            model(models.vector_batch(9))  # ends the second step
        stats = cache.stats(cumulative=True)
    finally:
        cache.close()
    assert [str(w.message) for w in caught if "CUDA graph" in str(w.message)].__len__() == 1
    assert stats.num_captured > 0 and stats.num_offloaded == 0 and offloader.num_stores == 0
    assert stats.num_packed == 0  # nothing became an entry
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


class PendingWork(torch.Tensor):
    """A wrapper subclass like AsyncCollectiveTensor: flattenable, but not known to hold
    finished data at pack time."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> PendingWork:
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype,
                                                   requires_grad=elem.requires_grad)

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, size, stride):
        return PendingWork(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.elem if isinstance(t, PendingWork) else t  # noqa: E731
        args = torch.utils._pytree.tree_map(unwrap, args)
        kwargs = torch.utils._pytree.tree_map(unwrap, kwargs or {})
        out = func(*args, **kwargs)
        return torch.utils._pytree.tree_map(
            lambda t: PendingWork(t) if isinstance(t, torch.Tensor) else t, out)


def test_subclasses_not_known_safe_stay_with_autograd() -> None:
    """Note [Subclasses with pending work]: an unknown wrapper subclass (AsyncCollectiveTensor
    among them) is not flattened: pack hands autograd the tensor itself."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    from tba.cache.capture.packed import offloadable_subclass

    assert not offloadable_subclass(AsyncCollectiveTensor)
    assert not offloadable_subclass(PendingWork)
    from torch.distributed.tensor import DTensor

    assert offloadable_subclass(DTensor)
    model = models.Stack(num_blocks=2)
    cache = make_cache(model, FakeOffloader())
    try:
        tensor = PendingWork(torch.randn(64))
        pack, unpack = probe(cache).saved_tensor_hooks
        packed = pack(tensor)
        assert type(packed) is tuple and packed[0] is tensor
        assert unpack(packed) is tensor
    finally:
        cache.close()


def test_a_storage_resized_before_its_store_is_never_read() -> None:
    """Note [Storages freed behind tba's back]: a storage resized to zero (FSDP1, Megatron/TE
    forced release) after autograd saved it is kept as it is and never read by a store."""
    offloader = FakeOffloader()
    offloader.gate = threading.Event()

    class FreesAfterSave(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 48)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.sin(self.blocks[0](x))  # saves x (linear) and its input (sin)
            out = self.blocks[1](h)  # saves h
            self.freed = h.untyped_storage()
            return out.sum()

    model = FreesAfterSave()
    cache = make_cache(model, offloader)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = model(torch.randn(8, 32))
            model.freed.resize_(0)  # what a framework's forced release does
            offloader.gate.set()  # the stores run now, after the release
            cache.wait_for_stores(JOIN_S)
            del loss  # the graph dies without backward: the step ends
        stats = cache.stats(cumulative=True)
    finally:
        offloader.gate.set()
        cache.close()
    # x and sin's input were stored; h (saved by the second linear) never was.
    assert stats.num_resized == 1 and offloader.num_stores == 2
    assert sum("resized or freed" in str(w.message) for w in caught) == 1


def test_reload_buffers_are_allocated_on_the_producers_stream() -> None:
    """Note [Reload buffers on the consumer's stream]: each load allocates its buffer with the
    producer token recorded when the tensor was packed, the load waits on that allocation, and
    unpack consumes the buffer naming the same producer (so record_stream is needed only when
    backward runs on another stream)."""
    from tests.cache.fakes import RecordingStreams

    streams = RecordingStreams()
    offloader = FakeOffloader()
    model = models.Stack(num_blocks=4)
    config = tba.TensorCacheConfig(offloader=offloader, offload_devices=("cpu",), min_offload_bytes=0,
                                   keep_last_modules=0, adaptive=False, prefetch_modules=0)
    cache = TensorCache(model, config, offloader, streams=streams)
    try:
        loss = model(models.vector_batch(0))
        cache.wait_for_stores(JOIN_S)
        loss.backward()
        stats = cache.stats()
    finally:
        cache.close()
    log = streams.log
    producers = {e[1] for e in log if e[0] == "record" and e[1][0] == "producer"}
    allocations = [e for e in log if e[0] == "allocate"]
    load_waits = [e[2] for e in log if e[0] == "enter" and e[1] == "load"]
    consumed = [e for e in log if e[0] == "consume"]
    assert stats.reloaded_bytes > 0 and len(allocations) == offloader.num_loads > 0
    assert all(a[1] in producers for a in allocations), "a reload buffer was not allocated on its producer's stream"
    assert load_waits == [a[2] for a in allocations], "a load did not wait on its buffer's allocation"
    assert consumed
    for index, event in enumerate(log):
        if event[0] == "consume":  # the latest allocation at that address (addresses are reused)
            allocated = [e for e in log[:index] if e[0] == "allocate" and e[3] == event[2]][-1]
            assert allocated[1] == event[4], "consumed naming another producer than it was allocated on"
    assert stats.num_record_stream == 0


class FakeRuntime:
    """Stands in for libcudart: records cudaStreamCreateWithPriority calls."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.calls: list[tuple[int, int]] = []

    def cudaStreamCreateWithPriority(self, handle_ref, flags, priority) -> int:  # noqa: N802
        import ctypes

        self.calls.append((flags.value, priority.value))
        if self.status == 0:
            ctypes.cast(handle_ref, ctypes.POINTER(ctypes.c_void_p))[0] = 0xBEEF
        return self.status


@pytest.mark.parametrize("status", [0, 2], ids=["created", "refused"])
def test_transfer_streams_are_tbas_own(monkeypatch: pytest.MonkeyPatch, status: int) -> None:
    """Note [Dedicated transfer streams]: streams come from cudaStreamCreateWithPriority
    (non-blocking, the asked priority), not PyTorch's shared pool; a refusal falls back to the
    pool with one warning."""
    import contextlib

    from tba.cache.engine import streams

    made: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda ptr, device: made.append(("external", ptr, device)) or made[-1])
    monkeypatch.setattr(torch.cuda, "Stream", lambda device, priority: made.append(("pool", device, priority)) or made[-1])
    monkeypatch.setattr(streams, "_warned_pool", False)
    runtime = FakeRuntime(status)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = streams.dedicated_stream(0, -1, runtime=runtime)
        streams.dedicated_stream(0, 0, runtime=runtime)
    assert runtime.calls == [(1, -1), (1, 0)]
    if status == 0:
        assert first == ("external", 0xBEEF, torch.device("cuda", 0)) and not caught
    else:
        assert first == ("pool", 0, -1)
        assert sum("dedicated CUDA streams" in str(w.message) for w in caught) == 1
