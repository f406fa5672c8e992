"""Controllable fakes for the offloader and stream layer, so CPU tests drive the exact
ordering, forwarding, cancellation and error logic deterministically."""

from __future__ import annotations

import contextlib
import errno
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import torch

from tba.errors import OffloadIOError


class FakeOffloader:
    """Keeps bytes in a dict. ``gate`` (if set) blocks each store until it is set; ``fail_store``
    / ``fail_load`` make the next calls raise EIO."""

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
    """A stream layer that logs every call with the thread it ran on."""

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


def bare_engine(offloader: Any, saved: torch.Tensor, **options: Any) -> tuple[Any, Any]:
    """A transfer engine alone (no cache, real stream layer) and a handle of ``saved`` saved
    into it for offload (the handle holds its entry's one reference): for tests that drive the
    engine's calls directly. Drop the handle and call ``engine.drain()`` to release it."""
    from tba.cache.engine import Engine
    from tba.cache.scopes import Record, Scope
    from tba.cache.streams import DeviceStreams
    from tba.cache.trace import TraceRecorder

    settings: dict[str, Any] = dict(
        num_store_threads=1, num_load_threads=1, max_inflight_bytes=1 << 30, min_offload_bytes=0,
        on_io_error="raise", timeout_s=30.0,
    )
    settings.update(options)
    engine = Engine(offloader, DeviceStreams(), trace=TraceRecorder(), **settings)
    record = Record((-1, 0), keep_tail=True)
    scope = Scope(record, 0, None, keep=False)
    record.scopes.append(scope)
    handle, _ = engine.save(saved, saved.untyped_storage(), saved, scope, record, True)
    return engine, handle
