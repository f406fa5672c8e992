"""Controllable fakes of tba's plug points, for tests that drive the cache's ordering,
forwarding, cancellation and error logic deterministically on the CPU: an offloader that keeps
bytes in a dict (with gates and injected failures) and a stream layer that records every call.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import torch

from tba.errors import OffloadIOError

__all__ = ["FakeOffloader", "RecordingStreams"]


class FakeOffloader:
    """An :class:`tba.offloaders.Offloader` that keeps each stored byte string in a dict.

    Attributes a test sets or reads:
        gate: if set (a ``threading.Event``), each store blocks until it is set (30 s at most).
        store_started: a semaphore released when each store begins (before the gate).
        fail_store / fail_load: make the following stores raise ``tba.OffloadIOError`` (EIO) /
            the following loads raise ``OSError`` (EIO).
        blobs: token -> the stored bytes; num_stores, num_loads: completed calls;
            released, reserved: the arguments of every ``release`` / ``reserve``; closed.

    Example:
        >>> from tba.testing import FakeOffloader
        >>> fake = FakeOffloader()
        >>> cache = tba.configure_tensor_cache(model, offloader=fake, offload_devices="cpu")  # doctest: +SKIP
        >>> fake.fail_load = True  # the next backward raises in the training step  # doctest: +SKIP
    """

    name = "fake"

    def __init__(self) -> None:
        self.blobs: dict[int, torch.Tensor] = {}
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.gate: threading.Event | None = None
        self.store_started = threading.Semaphore(0)
        self.fail_store = False
        self.fail_load = False
        self.num_stores = 0
        self.num_loads = 0
        self.released: list[int] = []
        self.reserved: list[int] = []
        self.closed = False

    def store(self, src: torch.Tensor) -> int:
        self.store_started.release()
        if self.gate is not None:
            assert self.gate.wait(30), "test gate never opened"
        if self.fail_store:
            raise OffloadIOError("injected write failure", path="/fake", offset=0,
                                 num_bytes=src.numel(), errno=errno.EIO)
        with self.lock:
            token = next(self.ids)
            self.blobs[token] = src.clone()
            self.num_stores += 1
        return token

    def load(self, token: int, dst: torch.Tensor) -> None:
        if self.fail_load:
            raise OSError(errno.EIO, "injected read failure")
        with self.lock:
            dst.copy_(self.blobs[token])
            self.num_loads += 1

    def release(self, token: int) -> None:
        with self.lock:
            del self.blobs[token]
            self.released.append(token)

    def reserve(self, num_bytes: int) -> None:
        self.reserved.append(num_bytes)

    def close(self) -> None:
        self.closed = True


class RecordingStreams:
    """A stream layer for ``tba.TensorCache(..., streams=...)`` that logs every call, with the
    thread it ran on, in ``log`` (one fake stream: nothing waits, every event is a tuple).

    The calls it implements are those of the cache's stream layer (``producer_event``,
    ``transfer``, ``allocate``, ``loaded_event``, ``consume``); a test reads ``log`` to check
    the order the cache made them in.
    """

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.local = threading.local()

    def _add(self, *item: Any) -> None:
        with self.lock:
            self.log.append(item)

    def producer_event(self, device: torch.device) -> Any:
        event = ("producer", next(self.ids))
        self._add("record", event, threading.get_ident())
        return event

    @contextlib.contextmanager
    def transfer(self, device: torch.device, kind: str, wait_for: Any) -> Iterator[None]:
        self._add("enter", kind, wait_for, threading.get_ident())
        self.local.kind = kind
        try:
            yield
        finally:
            self.local.kind = None
            self._add("exit", kind, threading.get_ident())

    def loaded_event(self, device: torch.device) -> Any:
        assert getattr(self.local, "kind", None) == "load", "loaded_event outside a load"
        event = ("loaded", next(self.ids))
        self._add("record", event, threading.get_ident())
        return event

    def allocate(
        self, device: torch.device, nbytes: int, producer: Any, page_offset: int = 0
    ) -> tuple[torch.Tensor, Any]:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        ready = ("allocated", next(self.ids))
        self._add("allocate", producer, ready, buffer.untyped_storage().data_ptr(), threading.get_ident())
        return buffer, ready

    def consume(self, event: Any, tensor: torch.Tensor, producer: Any) -> bool:
        self._add("consume", event, tensor.untyped_storage().data_ptr(), threading.get_ident(), producer)
        return False  # one fake stream: the consumer is the allocation stream
