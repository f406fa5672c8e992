"""The stream/event layer: how transfers are ordered against the compute stream.

Note [Transfer ordering] (bugs that sank earlier offloaders: stores reading unfinished
kernels' output, reload buffers used on another stream without ordering):
1. At pack time the cache records an event on the producing (current) stream; a store waits on
   it before reading the tensor, so it never copies bytes a kernel has not written yet.
2. Stores and loads run on transfer streams of their own (high priority for loads: backward
   waits for them), made current on the worker thread; the offloader synchronises its copies
   before returning, so the source of a store may be released as soon as the store returns.
3. Note [Reload buffers on the consumer's stream]: the CUDA caching allocator keeps free
   blocks per stream, so a reload buffer allocated on the load stream could never reuse the
   memory offloading freed on the compute stream, and ``record_stream`` would hold it until
   the GPU caught up with the CPU. A load therefore allocates its destination on the stream
   that produced the tensor (the one backward consumes it on), records an event there and
   makes the load stream wait on it before copying; the copy's end is recorded as the loaded
   event. Before unpack hands the tensor to autograd, the consuming stream waits on that
   event; ``record_stream`` is called only when the consumer is not the allocation stream,
   and counted (``CacheStats.num_record_stream``).
4. Note [Reload buffers at the source's page offset]: on the host, a reload buffer starts at the
   address the stored bytes had, modulo the page (``Entry.page_offset``). An offloader that
   moves pages by DMA (the SSD offloader keeps host bytes at their page offset in its files,
   Note [Direct windows]) can then read every whole page straight into it; an aligned buffer
   would face the file's pages shifted and need a copy per byte. The buffer is a view into a
   slightly larger allocation (one page more), kept alive by the storage the entry holds.
5. Note [Transfer time is the copy's]: the write and read bandwidths the policy decides from
   (``CacheStats.write_s`` / ``read_s``) time the copies, not the wait for the kernel that
   produced the tensor (or for the consumer stream to reach a reload buffer's allocation). On
   a GPU the training thread runs ahead of the GPU by up to a whole forward, so a store picked
   up at once waits for compute first; timed from its pick-up, the first GPU run measured the
   host offloader at 3.2 GB/s next to a 55 GB/s copy engine, and the adaptive policy then kept
   every block. ``transfer`` therefore waits on the CPU (a blocking event: the worker sleeps)
   until ``wait_for`` has happened before it yields, and the engine times the copy from there.
   The worker was blocked until the copy ended anyway, so nothing runs later than before.
   Tested in tests/cache/test_transfers.py::test_transfer_time_excludes_the_wait_for_the_producer.
The cache talks only to the ``StreamLayer`` protocol below, so CPU tests drive exactly this
ordering logic with recording fakes (tests/cache/fakes.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from tba.settings import DIRECT_IO_ALIGNMENT

__all__ = ["StreamLayer", "DeviceStreams", "dedicated_stream", "host_buffer"]


def host_buffer(nbytes: int, page_offset: int) -> torch.Tensor:
    """A host ``uint8`` buffer of ``nbytes`` whose address is ``page_offset`` modulo
    ``DIRECT_IO_ALIGNMENT`` (Note [Reload buffers at the source's page offset]); a plain one
    under that size, where no whole block could move straight."""
    if nbytes < DIRECT_IO_ALIGNMENT:
        return torch.empty(nbytes, dtype=torch.uint8)
    base = torch.empty(nbytes + DIRECT_IO_ALIGNMENT, dtype=torch.uint8).untyped_storage()
    shift = (page_offset - base.data_ptr()) % DIRECT_IO_ALIGNMENT
    return torch.empty(0, dtype=torch.uint8).set_(base[shift : shift + nbytes])


class StreamLayer(Protocol):
    """Ordering primitives the cache needs; one implementation per kind of device runtime."""

    def producer_event(self, device: torch.device) -> Any | None:
        """On the training thread at pack time: a token of the current stream's position
        (an event on it, and the stream), or None."""
        ...

    def transfer(
        self, device: torch.device, kind: str, wait_for: Any | None
    ) -> contextlib.AbstractContextManager[None]:
        """On a worker thread: make the ``kind`` ("store"/"load") transfer stream current and
        order it after ``wait_for`` (a producer token, or an allocation's ready token); a layer
        whose devices run asynchronously returns from entering only once ``wait_for`` has
        happened, so the time inside is the copy's (Note [Transfer time is the copy's])."""
        ...

    def allocate(
        self, device: torch.device, nbytes: int, producer: Any | None, page_offset: int = 0
    ) -> tuple[torch.Tensor, Any]:
        """On a load worker: a ``uint8`` buffer of ``nbytes`` allocated on the stream of
        ``producer`` (the consumer's), and a token the load's ``transfer`` waits on. On the
        host, at ``page_offset`` modulo the page (Note [Reload buffers at the source's page
        offset])."""
        ...

    def loaded_event(self, device: torch.device) -> Any | None:
        """On a worker thread inside ``transfer``, after a load: an event marking its end."""
        ...

    def consume(self, event: Any | None, tensor: torch.Tensor, producer: Any | None) -> bool:
        """On the training thread before handing ``tensor`` (a loaded copy allocated on
        ``producer``'s stream) to autograd; returns whether ``record_stream`` was needed."""
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
                # Loads run at high priority: backward is waiting for them.
                priority = -1 if kind == "load" else 0
                stream = self._streams[(index, kind)] = dedicated_stream(index, priority)
        return stream

    def producer_event(self, device: torch.device) -> Any | None:
        if device.type != "cuda":
            return None
        stream = torch.cuda.current_stream(device)
        event = torch.cuda.Event(blocking=True)  # waited on by a worker: sleep, don't spin
        event.record(stream)
        return (event, stream)

    @contextlib.contextmanager
    def transfer(self, device: torch.device, kind: str, wait_for: Any | None) -> Iterator[None]:
        if device.type != "cuda":
            yield
            return
        stream = self._stream(device, kind)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            if wait_for is not None:
                stream.wait_event(wait_for[0])
                # Note [Transfer time is the copy's]: the worker waits here, not in the copy.
                wait_for[0].synchronize()
            yield

    def allocate(
        self, device: torch.device, nbytes: int, producer: Any | None, page_offset: int = 0
    ) -> tuple[torch.Tensor, Any]:
        if device.type == "cpu":
            return host_buffer(nbytes, page_offset), None
        if device.type != "cuda" or producer is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=device), None
        from tba.malloc_hook import tagged_allocations  # loads no library

        stream = producer[1]
        # Tagged: with TBA_HOOK_REGISTER=tba the malloc hook registers only the segments that
        # hold reload buffers with cuFile.
        with torch.cuda.device(device), torch.cuda.stream(stream), tagged_allocations():
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            ready = torch.cuda.Event(blocking=True)
            ready.record(stream)
        return buffer, (ready, stream)

    def loaded_event(self, device: torch.device) -> Any | None:
        if device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def consume(self, event: Any | None, tensor: torch.Tensor, producer: Any | None) -> bool:
        if tensor.device.type != "cuda":
            return False
        stream = torch.cuda.current_stream(tensor.device)
        if event is not None:
            stream.wait_event(event)
        if producer is None or producer[1] != stream:
            tensor.record_stream(stream)
            return True
        return False


# Note [Dedicated transfer streams]: ``torch.cuda.Stream()`` hands out streams of a small
# round-robin pool (32 per priority per device) that NCCL process groups and FSDP2 draw from
# too, so a transfer stream could be the one a collective runs on, and every transfer would
# then wait for it (or it for them). tba creates its own streams with the CUDA runtime
# (``cudaStreamCreateWithPriority``, non-blocking) and wraps them in ``torch.cuda.ExternalStream``;
# where the runtime library cannot be found it falls back to the pool and says so once.
_CUDA_STREAM_NON_BLOCKING = 0x1
_warned_pool = False


def _runtime() -> Any:
    """The CUDA runtime library torch uses (``libcudart``), loaded with ctypes."""
    import ctypes
    import ctypes.util

    major = (torch.version.cuda or "").split(".")[0]
    names = [f"libcudart.so.{major}"] if major else []
    found = ctypes.util.find_library("cudart")
    if found:
        names.append(found)
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    raise OSError("; ".join(errors) or "no libcudart name to try")


def dedicated_stream(device_index: int, priority: int, runtime: Any = None) -> torch.cuda.Stream:
    """A CUDA stream of tba's own (Note [Dedicated transfer streams]); falls back to the pool."""
    global _warned_pool
    import ctypes

    try:
        lib = runtime if runtime is not None else _runtime()
        handle = ctypes.c_void_p()
        with torch.cuda.device(device_index):
            status = lib.cudaStreamCreateWithPriority(
                ctypes.byref(handle), ctypes.c_uint(_CUDA_STREAM_NON_BLOCKING), ctypes.c_int(priority)
            )
        if status != 0:
            raise OSError(f"cudaStreamCreateWithPriority returned {status}")
        return torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", device_index))
    except (OSError, AttributeError) as exc:
        if not _warned_pool:
            _warned_pool = True
            import warnings

            warnings.warn(
                f"tba: could not create dedicated CUDA streams ({exc}); transfers use streams "
                "from PyTorch's pool, which NCCL and FSDP may share", RuntimeWarning, stacklevel=2,
            )
        return torch.cuda.Stream(device=device_index, priority=priority)
