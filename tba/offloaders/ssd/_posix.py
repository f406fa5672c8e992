"""The ``posix`` I/O engine: ``os.pwrite``/``os.preadv`` through reusable, aligned staging buffers.

Each request is cut into chunks of ``chunk_bytes``. A chunk goes straight between the tensor and
the file when that is allowed (a CPU tensor, and for O_DIRECT an aligned address and length);
otherwise it is copied through a staging buffer (pinned when CUDA is present). The calling thread
copies chunk i+1 while a small thread pool writes or reads chunk i, so copying and disk I/O
overlap. Files are opened twice: with O_DIRECT where the filesystem allows it, and buffered for
the rest (unaligned remainders, and filesystems that refuse O_DIRECT, noted once).
"""

from __future__ import annotations

import collections
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from tba.offloaders._byte_views import bytes_view
from tba.offloaders._stream_wait import wait_for_stream
from tba.offloaders.host_memory import HostAllocator
from tba.offloaders.ssd._engine import IORequest, OnDone, io_error

__all__ = ["PosixEngine", "ALIGNMENT"]

logger = logging.getLogger(__name__)

ALIGNMENT = 4096  # O_DIRECT address, offset and length alignment we keep to

_notice_lock = threading.Lock()
_noticed: set[str] = set()


def _notice_once(key: str, message: str, *args: object) -> None:
    with _notice_lock:
        if key in _noticed:
            return
        _noticed.add(key)
    logger.warning(message, *args)


class _File:
    """A slab file opened buffered and, where allowed, with O_DIRECT."""

    def __init__(self, path: str, label: str) -> None:
        self.path = label  # named in errors and notices; ``path`` may go through /proc/self/fd
        self._lock = threading.Lock()
        self._retired: list[int] = []
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
        self.fd = os.open(path, flags)
        self.direct_fd: int | None = None
        if hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(path, flags | os.O_DIRECT)
            except OSError as e:
                _notice_once(
                    f"open:{os.path.dirname(label)}",
                    "tba SSD offloader: the filesystem of %s refuses O_DIRECT (%s); using buffered "
                    "I/O through the page cache, which costs memory bandwidth and host memory",
                    os.path.dirname(label),
                    e.strerror,
                )

    def drop_direct(self, reason: str) -> None:
        """Stop using O_DIRECT for this file (the filesystem rejected an O_DIRECT transfer)."""
        with self._lock:
            if self.direct_fd is None:
                return
            # Left open: another thread may be using it right now. Closed with the file.
            self._retired.append(self.direct_fd)
            self.direct_fd = None
        _notice_once(
            f"io:{os.path.dirname(self.path)}",
            "tba SSD offloader: O_DIRECT I/O on %s failed (%s); using buffered I/O for this file",
            self.path,
            reason,
        )

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd, *self._retired):
            if fd is not None:
                os.close(fd)
        self.direct_fd = None
        self._retired.clear()


@dataclass
class _Staging:
    tensor: torch.Tensor  # chunk_bytes, 1-D uint8, ALIGNMENT-aligned
    array: np.ndarray  # the same memory, for os.pwrite / os.preadv
    keepalive: object


class _StagingPool:
    """A bounded set of reusable, pre-faulted, aligned host buffers (pinned with CUDA)."""

    def __init__(self, chunk_bytes: int, max_buffers: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.max_buffers = max_buffers
        self._cond = threading.Condition()
        self._free: list[_Staging] = []
        self._num_allocated = 0

    def _allocate(self) -> _Staging:
        if torch.cuda.is_available():
            # Exactly chunk_bytes, page-aligned, pinned with cudaHostRegister (PyTorch's pinned
            # allocator would round chunk_bytes + alignment up to twice the size and keep it);
            # pageable with a one-time warning where pinning fails.
            buffer = HostAllocator().allocate(self.chunk_bytes, pinned=True)
            tensor = buffer.tensor
            keepalive: object = buffer
        else:
            keepalive = mmap.mmap(-1, self.chunk_bytes)
            tensor = torch.from_numpy(np.frombuffer(keepalive, dtype=np.uint8))
        tensor.zero_()  # pre-fault every page now, not during the first transfer
        return _Staging(tensor, tensor.numpy(), keepalive)

    def acquire(self, block: bool) -> _Staging | None:
        with self._cond:
            while True:
                if self._free:
                    return self._free.pop()
                if self._num_allocated < self.max_buffers:
                    self._num_allocated += 1
                    break
                if not block:
                    return None
                self._cond.wait()
        try:
            return self._allocate()
        except BaseException:
            with self._cond:
                self._num_allocated -= 1
                self._cond.notify()
            raise

    def release(self, staging: _Staging) -> None:
        with self._cond:
            self._free.append(staging)
            self._cond.notify()

    def clear(self) -> None:
        with self._cond:
            free, self._free = self._free, []
            self._num_allocated = 0
        for staging in free:
            release = getattr(staging.keepalive, "release", None)
            if release is not None:
                release()  # unpin and unmap


@dataclass
class _Chunk:
    index: int  # of the request in the call
    request: IORequest
    start: int  # byte range [start, stop) of request.buffer
    stop: int
    staged: bool
    staging: _Staging | None = None
    future: Future | None = None


class PosixEngine:
    """Blocking, thread-safe chunked pwrite/preadv with O_DIRECT where possible."""

    name = "posix"
    mode = "pread/pwrite"

    def __init__(self, *, chunk_bytes: int, num_io_threads: int, num_staging_buffers: int) -> None:
        if chunk_bytes <= 0 or chunk_bytes % ALIGNMENT:
            raise ValueError(f"staging chunk_bytes must be a positive multiple of {ALIGNMENT}, got {chunk_bytes}")
        if num_io_threads < 1 or num_staging_buffers < 1:
            raise ValueError(
                f"num_io_threads and num_staging_buffers must be >= 1, got {num_io_threads} and "
                f"{num_staging_buffers}"
            )
        self.chunk_bytes = chunk_bytes
        self.num_io_threads = num_io_threads
        self._pool = _StagingPool(chunk_bytes, num_staging_buffers)
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        # Indirection points for fault-injection tests.
        self._pwrite: Callable[[int, object, int], int] = os.pwrite
        self._preadv: Callable[[int, list, int], int] = os.preadv

    # --- files -----------------------------------------------------------------------------
    def open(self, path: str, label: str) -> _File:
        return _File(path, label)

    def close_file(self, handle: _File) -> None:
        handle.close()

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            # Closed by the garbage collector on one of our own I/O threads: it cannot join
            # itself; the threads still exit once their queue is empty.
            on_io_thread = threading.current_thread().name.startswith("tba-ssd-io")
            executor.shutdown(wait=not on_io_thread)
        self._pool.clear()

    # --- transfers -------------------------------------------------------------------------
    def write(self, requests: Sequence[IORequest], on_done: OnDone | None = None) -> None:
        self._run(requests, is_write=True, on_done=on_done)

    def read(self, requests: Sequence[IORequest], on_done: OnDone | None = None) -> None:
        self._run(requests, is_write=False, on_done=on_done)

    # Note [Checksums of what was written]: a checksummed write goes through staging, and the
    # checksum is taken from the staging copy, the very bytes handed to the file.
    exact_write_sums = True

    def _plan(self, requests: Sequence[IORequest], stage_all: bool = False) -> list[_Chunk]:
        chunks = []
        for index, request in enumerate(requests):
            buffer, handle = request.buffer, request.handle
            direct = handle.direct_fd is not None
            base = buffer.data_ptr()
            for start in range(0, buffer.numel(), self.chunk_bytes):
                stop = min(start + self.chunk_bytes, buffer.numel())
                if buffer.device.type != "cpu" or stage_all:
                    staged = True
                elif direct:
                    staged = bool((base + start) % ALIGNMENT or (stop - start) % ALIGNMENT)
                else:
                    staged = False
                chunks.append(_Chunk(index, request, start, stop, staged))
        return chunks

    def _submit(self, fn: Callable[[], None], inline: bool) -> Future:
        if inline:
            future: Future = Future()
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter below
                future.set_exception(e)
            else:
                future.set_result(None)
            return future
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.num_io_threads, thread_name_prefix="tba-ssd-io")
            executor = self._executor
        return executor.submit(fn)

    def _run(self, requests: Sequence[IORequest], is_write: bool, on_done: OnDone | None) -> None:
        chunks = self._plan(requests, stage_all=is_write and on_done is not None)
        # One chunk runs on the calling thread, unless a write is checksummed: then the I/O
        # thread writes while this thread computes the checksum.
        inline = len(chunks) == 1 and not (is_write and on_done is not None)
        inflight: collections.deque[_Chunk] = collections.deque()
        error: BaseException | None = None

        def finish_oldest() -> BaseException | None:
            chunk = inflight.popleft()
            failure = self._finish(chunk, is_write)
            if failure is None and on_done is not None and not is_write:
                try:
                    on_done(chunk.index, chunk.start, chunk.stop, None)
                except BaseException as e:  # noqa: BLE001 - reported like an I/O failure
                    failure = e
            return failure

        try:
            for chunk in chunks:
                if chunk.staged:
                    chunk.staging = self._pool.acquire(block=False)
                    # Block on the pool only while holding nothing: then no two callers can
                    # wait on each other's buffers.
                    while chunk.staging is None and inflight and error is None:
                        error = finish_oldest()
                        chunk.staging = self._pool.acquire(block=False)
                    if error is not None:
                        break
                    if chunk.staging is None:
                        chunk.staging = self._pool.acquire(block=True)
                    if is_write:
                        self._fill(chunk)
                chunk.future = self._submit(lambda c=chunk: self._transfer(c, is_write), inline)
                inflight.append(chunk)
                if is_write and on_done is not None:  # overlaps with the write
                    assert chunk.staging is not None
                    data = chunk.staging.tensor[: chunk.stop - chunk.start]
                    on_done(chunk.index, chunk.start, chunk.stop, data)
                while len(inflight) > self.num_io_threads and error is None:
                    error = finish_oldest()
                if error is not None:
                    break
            while inflight and error is None:
                error = finish_oldest()
        except BaseException as e:  # noqa: BLE001 - re-raised once every submitted chunk is done
            error = error or e
        finally:
            for chunk in chunks:
                if chunk.future is None and chunk.staging is not None:
                    self._pool.release(chunk.staging)  # acquired, never submitted
            while inflight:
                late = self._finish(inflight.popleft(), is_write, copy=error is None)
                error = error or late
        if error is not None:
            raise error

    def _fill(self, chunk: _Chunk) -> None:
        """Copy a chunk of the source tensor into its staging buffer."""
        assert chunk.staging is not None
        n = chunk.stop - chunk.start
        source = chunk.request.buffer[chunk.start : chunk.stop]
        if source.is_cuda:
            chunk.staging.tensor[:n].copy_(source, non_blocking=True)
            wait_for_stream(source.device)
        else:
            # numpy's copy is several times faster than torch's for uint8 on CPU.
            np.copyto(chunk.staging.array[:n], bytes_view(source))

    def _finish(self, chunk: _Chunk, is_write: bool, copy: bool = True) -> BaseException | None:
        """Wait for a chunk's transfer; for a staged read, copy it out; give back its buffer."""
        assert chunk.future is not None
        error = chunk.future.exception()
        staging = chunk.staging
        if staging is None:
            return error
        try:
            if error is None and copy and not is_write:
                n = chunk.stop - chunk.start
                target = chunk.request.buffer[chunk.start : chunk.stop]
                if target.is_cuda:
                    target.copy_(staging.tensor[:n], non_blocking=True)
                    wait_for_stream(target.device)
                else:
                    np.copyto(bytes_view(target), staging.array[:n])
        except BaseException as e:  # noqa: BLE001 - reported like an I/O failure
            error = e
        finally:
            self._pool.release(staging)
        return error

    # --- one chunk, on an I/O thread -------------------------------------------------------
    def _transfer(self, chunk: _Chunk, is_write: bool) -> None:
        request, handle = chunk.request, chunk.request.handle
        n = chunk.stop - chunk.start
        offset = request.file_offset + chunk.start
        if chunk.staging is not None:
            # Staged: move whole alignment units; the extent is rounded up, so this stays inside it.
            length = n if handle.direct_fd is None else -(-n // ALIGNMENT) * ALIGNMENT
            view = chunk.staging.array[:length]
        else:
            view = bytes_view(request.buffer[chunk.start : chunk.stop])
        if is_write:
            self._write_all(handle, view, offset)
        else:
            self._read_all(handle, view, offset)

    def _write_all(self, handle: _File, view: np.ndarray, offset: int) -> None:
        self._loop(handle, view, offset, "write", lambda fd, v, off: self._pwrite(fd, v, off))

    def _read_all(self, handle: _File, view: np.ndarray, offset: int) -> None:
        self._loop(handle, view, offset, "read", lambda fd, v, off: self._preadv(fd, [v], off))

    def _loop(self, handle: _File, view: np.ndarray, offset: int, op: str, call: Callable) -> None:
        total, done = len(view), 0
        direct_fd = handle.direct_fd
        fd = direct_fd if direct_fd is not None else handle.fd
        while done < total:
            try:
                count = call(fd, view[done:], offset + done)
            except OSError as e:
                # EINVAL: this transfer's alignment or filesystem refuses O_DIRECT; EFAULT:
                # some drivers refuse O_DIRECT into pinned (cudaHostAlloc) staging memory.
                # Either way the same bytes go through the buffered descriptor.
                if e.errno in (errno.EINVAL, errno.EFAULT) and fd != handle.fd:
                    handle.drop_direct(e.strerror or errno.errorcode.get(e.errno, str(e.errno)))
                    fd = handle.fd
                    continue
                raise io_error(
                    f"{op} failed after {done} of {total} bytes",
                    path=handle.path,
                    offset=offset + done,
                    num_bytes=total - done,
                    errno_code=e.errno,
                    detail=e.strerror or "",
                ) from e
            if count <= 0:
                raise io_error(
                    f"short {op}: {done} of {total} bytes moved, then the kernel moved none",
                    path=handle.path,
                    offset=offset + done,
                    num_bytes=total - done,
                    errno_code=None,
                )
            done += count
            if done < total:
                # A partial O_DIRECT transfer leaves an unaligned remainder: finish it buffered.
                fd = handle.fd
