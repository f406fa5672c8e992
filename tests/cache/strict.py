"""A strict CPU model of the GPU's ordering rules, for the cache (issue 16).

``StrictStreams`` implements the cache's ``StreamLayer`` the way a GPU behaves, with every
ordering rule checked instead of trusted:

- Producer events fire only when a lagging fake *compute timeline* (a thread draining a queue)
  reaches them, so a store that does not wait on its event would run before its data exists.
- Each transfer stream is a thread with a queue; ``transfer`` blocks its worker until the event
  it must wait on has fired (a stream wait), and the copy's end is recorded as an event fired
  on that stream's thread.
- Every reload buffer is tagged with the stream it was allocated on; unpack must consume its
  load event on the consumer stream, and a consumer other than the allocation stream needs
  ``record_stream``.

``StrictOffloader`` wraps a real offloader and checks that no transfer runs with the cache's
lock held and that a store reads its source only after the producer event fired. Reload
buffers are poisoned when allocated, so a load that leaves bytes unfilled fails the bit-exact
twin.

``strict_model`` (a context manager) routes ``tba.configure_tensor_cache`` through both; its
``violations`` list must be empty at the end.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch

from tba.cache.engine.streams import host_buffer
from tba.offloaders import OffloaderWrapper

JOIN_S = 30.0


class StrictEvent:
    """A fake CUDA event: ``fired`` is set when its stream reaches it."""

    ids = itertools.count()

    def __init__(self, stream: str) -> None:
        self.id = next(self.ids)
        self.stream = stream
        self.fired = threading.Event()


class _Timeline:
    """A stream: a thread that fires events in order, lagging behind whoever enqueues them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.Queue[StrictEvent | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"strict-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            if event is None:
                return
            # Lag: let the enqueuing side run ahead before the event fires (a GPU behind the CPU).
            threading.Event().wait(0.0005)
            event.fired.set()

    def record(self) -> StrictEvent:
        event = StrictEvent(self.name)
        self._queue.put(event)
        return event

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(JOIN_S)


class StrictStreams:
    """``StreamLayer`` with GPU-like ordering, checked. Device type "cpu" plays the GPU."""

    def __init__(self, violations: list[str]) -> None:
        self.violations = violations
        self.compute = _Timeline("compute")
        self.transfer_streams = {"store": _Timeline("store"), "load": _Timeline("load")}
        self.local = threading.local()
        self._lock = threading.Lock()
        self.allocated_on: dict[int, str] = {}  # buffer data_ptr -> stream it was allocated on
        self.num_record_stream = 0
        self.num_waits = 0

    def _fail(self, message: str) -> None:
        with self._lock:
            self.violations.append(message)

    def producer_event(self, device: torch.device) -> Any:
        event = self.compute.record()
        return (event, "compute")

    @contextlib.contextmanager
    def transfer(self, device: torch.device, kind: str, wait_for: Any) -> Iterator[None]:
        if threading.current_thread() is threading.main_thread():
            self._fail(f"a {kind} transfer ran on the training thread")
        if wait_for is not None:
            event = wait_for[0]
            if not event.fired.wait(JOIN_S):
                self._fail(f"a {kind} waited {JOIN_S} s for event {event.id}: it never fired")
            with self._lock:
                self.num_waits += 1
        elif kind == "store":
            self._fail("a store did not wait on its producer event")
        self.local.kind = kind
        self.local.waited = wait_for
        try:
            yield
        finally:
            self.local.kind = None

    def allocate(
        self, device: torch.device, nbytes: int, producer: Any, page_offset: int = 0
    ) -> tuple[torch.Tensor, Any]:
        if producer is None:
            self._fail("a reload buffer was allocated without its producer's stream")
        stream = producer[1] if producer is not None else "load"
        if device.type == "cpu":  # as the real layer does (Note [Reload buffers at the source's page offset])
            buffer = host_buffer(nbytes, page_offset)
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        buffer.fill_(0xA5)  # poison: a load that does not fill it shows up as wrong bytes
        with self._lock:
            self.allocated_on[buffer.untyped_storage().data_ptr()] = stream
        ready = self.compute.record() if stream == "compute" else self.transfer_streams["load"].record()
        return buffer, (ready, stream)

    def loaded_event(self, device: torch.device) -> Any:
        if getattr(self.local, "kind", None) != "load":
            self._fail("loaded_event outside a load transfer")
        return self.transfer_streams["load"].record()

    def consume(self, event: Any, tensor: torch.Tensor, producer: Any) -> bool:
        consumer = getattr(self.local, "stream", "compute")
        if event is None:
            self._fail("a reloaded tensor was consumed without its load event")
        elif not event.fired.wait(JOIN_S):
            self._fail(f"load event {event.id} never fired before its tensor was consumed")
        with self._lock:
            allocated = self.allocated_on.get(tensor.untyped_storage().data_ptr())
        if allocated is None:
            self._fail("a consumed tensor was not allocated by allocate()")
        if allocated != consumer:
            with self._lock:
                self.num_record_stream += 1
            return True  # record_stream on the consumer
        return False

    def close(self) -> None:
        self.compute.close()
        for stream in self.transfer_streams.values():
            stream.close()


class StrictOffloader(OffloaderWrapper):
    """Wraps an offloader: checks that no transfer (store, load, reserve: a worker's) runs with
    the cache's lock held by the calling thread, and that the current transfer waited on a
    fired event; counts calls. ``release`` runs inside the cache's critical section by design
    (Note [Interrupt-safe bookkeeping]): it only gives space back. Inline stores (``store_now``,
    under the lock by design: Note [Small transfers inline]) are not passed through: every
    store runs on a worker, where the checks apply."""

    passes_store_now = False

    def __init__(self, inner: Any, streams: StrictStreams, violations: list[str]) -> None:
        super().__init__(inner, "strict")
        self.streams = streams
        self.violations = violations
        self.locks: list[Any] = []  # the cache's lock (an RLock: it knows its owner)
        self.num_calls = 0

    def _check(self, what: str) -> None:
        if any(lock._is_owned() for lock in self.locks):
            self.violations.append(f"offloader.{what} called with a cache lock held")
        self.num_calls += 1

    def store(self, src: torch.Tensor) -> Any:
        self._check("store")
        waited = getattr(self.streams.local, "waited", None)
        if waited is None or not waited[0].fired.is_set():
            self.violations.append("a store read its source before the producer event fired")
        return self.inner.store(src)

    def load(self, token: Any, dst: torch.Tensor) -> None:
        self._check("load")
        self.inner.load(token, dst)

    def release(self, token: Any) -> None:
        self.num_calls += 1
        self.inner.release(token)

    def reserve(self, num_bytes: int) -> None:
        self._check("reserve")
        self.inner.reserve(num_bytes)


@contextlib.contextmanager
def strict_model(monkeypatch: Any) -> Iterator[list[str]]:
    """Route every cache made by ``tba.configure_tensor_cache`` inside the block through the
    strict model; yields the list of violations (checked empty by the caller)."""
    import tba.offloaders
    from tba.cache import tensor_cache as tc

    violations: list[str] = []
    made: list[tuple[StrictStreams, StrictOffloader | None]] = []
    real_make = tba.offloaders.make_offloader
    real_init = tc.TensorCache.__init__

    def make_offloader(config: Any, *, rank: int | None = None) -> Any:
        inner = real_make(config, rank=rank)
        if inner is None:
            return None
        streams = StrictStreams(violations)
        offloader = StrictOffloader(inner, streams, violations)
        made.append((streams, offloader))
        return offloader

    def init(self: Any, model: Any, config: Any, offloader: Any, *, streams: Any = None) -> None:
        if isinstance(offloader, StrictOffloader):
            streams = offloader.streams
        real_init(self, model, config, offloader, streams=streams)
        if isinstance(offloader, StrictOffloader):
            offloader.locks = [self._engine.lock]

    monkeypatch.setattr(tba.offloaders, "make_offloader", make_offloader)
    monkeypatch.setattr(tc.TensorCache, "__init__", init)
    try:
        yield violations
    finally:
        for streams, offloader in made:
            streams.close()
        if made and not any(o.num_calls for _, o in made if o is not None):
            violations.append("the strict offloader was never called: the test moved no bytes")
