"""The stream/event layer: how transfers are ordered against the compute stream.

Note [Transfer ordering] (TBA_NOTES section 4, bugs 3 and 4):
1. At pack time the cache records an event on the producing (current) stream; a store waits on
   it before reading the tensor, so it never copies bytes a kernel has not written yet.
2. Stores and loads run on their own transfer streams, made current on the worker thread, and
   the offloader synchronises its copies before returning, so the source of a store may be
   released as soon as the store returns.
3. A load allocates its destination on the load stream and records an event after the copy;
   before unpack hands the tensor to autograd, the consuming stream waits on that event and
   the destination is marked used on the consuming stream (``record_stream``), so the caching
   allocator cannot give its memory away while backward still reads it.
The cache talks only to the ``StreamLayer`` protocol below, so CPU tests drive exactly this
ordering logic with a recording fake (tests/cache/test_streams.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch

__all__ = ["StreamLayer", "DeviceStreams"]


class StreamLayer(Protocol):
    """Ordering primitives the cache needs; one implementation per kind of device runtime."""

    def producer_event(self, device: torch.device) -> Any | None:
        """On the training thread at pack time: an event on the current stream, or None."""
        ...

    def transfer(
        self, device: torch.device, kind: str, wait_for: Any | None
    ) -> contextlib.AbstractContextManager:
        """On a worker thread: make the ``kind`` ("store"/"load") transfer stream current and
        order it after ``wait_for``."""
        ...

    def loaded_event(self, device: torch.device) -> Any | None:
        """On a worker thread inside ``transfer``, after a load: an event marking its end."""
        ...

    def consume(self, event: Any | None, tensor: torch.Tensor) -> None:
        """On the training thread before handing ``tensor`` (a loaded copy) to autograd."""
        ...


class DeviceStreams:
    """The real layer: CUDA streams and events for CUDA tensors, nothing to do elsewhere."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[tuple[int, str], torch.cuda.Stream] = {}

    def _stream(self, device: torch.device, kind: str) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self._streams.get((index, kind))
            if stream is None:
                stream = self._streams[(index, kind)] = torch.cuda.Stream(device=index)
        return stream

    def producer_event(self, device: torch.device) -> Any | None:
        if device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    @contextlib.contextmanager
    def transfer(self, device: torch.device, kind: str, wait_for: Any | None) -> Iterator[None]:
        if device.type != "cuda":
            yield
            return
        stream = self._stream(device, kind)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            if wait_for is not None:
                stream.wait_event(wait_for)
            yield

    def loaded_event(self, device: torch.device) -> Any | None:
        if device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def consume(self, event: Any | None, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cuda":
            return
        stream = torch.cuda.current_stream(tensor.device)
        if event is not None:
            stream.wait_event(event)
        tensor.record_stream(stream)
