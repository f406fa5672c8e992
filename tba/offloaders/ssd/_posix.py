"""The ``posix`` I/O engine: ``os.pwrite``/``os.preadv``, straight between host tensors and the
file where O_DIRECT allows it, through reusable aligned staging buffers elsewhere.

Each request is cut into pieces (Note [Direct windows] in ``_windows.py``): the page-aligned
interior of a host tensor moves with O_DIRECT straight between its memory and the file (no copy);
the ragged head and tail, device tensors, and memory whose page offset differs from the file's
are copied through a staging buffer (pinned when CUDA is present). The calling thread prepares
piece i+1 (fills its staging buffer, or checksums it) while a small thread pool writes or reads
piece i, so copying, checksumming and disk I/O overlap. Files are opened twice: with O_DIRECT
where the filesystem allows it, and buffered for filesystems that refuse O_DIRECT (noted once).
"""

from __future__ import annotations

import collections
import errno
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from tba.offloaders._byte_views import bytes_view
from tba.offloaders._stream_wait import wait_for_stream
from tba.offloaders.cpu_time import charge_cpu
from tba.offloaders.ssd._engine import IORequest, OnDone, io_error
from tba.offloaders.ssd._posix_files import ALIGNMENT, PosixFile
from tba.offloaders.ssd._staging import Staging, StagingPool
from tba.offloaders.ssd._windows import Piece, plan_pieces

__all__ = ["PosixEngine", "ALIGNMENT"]


@dataclass
class _Chunk:
    index: int  # of the request in the call
    request: IORequest
    piece: Piece
    staging: Staging | None = None
    future: Future[None] | None = None
    inline: bool = False  # ran on the calling thread
    cpu_s: float = 0.0  # CPU time of the transfer on an I/O thread

    @property
    def start(self) -> int:
        return self.piece.start

    @property
    def stop(self) -> int:
        return self.piece.stop


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
        self._pool = StagingPool(chunk_bytes, num_staging_buffers)
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        # Indirection points for fault-injection tests. os.pwrite/os.preadv take any buffer;
        # typeshed makes a numpy array one only from Python 3.12 (ndarray.__buffer__), and the
        # type check targets 3.10, hence the ignores.
        self._pwrite: Callable[[int, np.ndarray, int], int] = os.pwrite  # type: ignore[assignment]
        self._preadv: Callable[[int, list[np.ndarray], int], int] = os.preadv  # type: ignore[assignment]

    # --- files -----------------------------------------------------------------------------
    def open(self, path: str, label: str) -> PosixFile:
        return PosixFile(path, label)

    def close_file(self, handle: PosixFile) -> None:
        handle.close()

    def release_idle(self) -> None:
        self._pool.trim()

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

    def _plan(self, requests: Sequence[IORequest]) -> list[_Chunk]:
        chunks = []
        for index, request in enumerate(requests):
            buffer = request.buffer
            pieces = plan_pieces(
                buffer.data_ptr(), request.file_offset, buffer.numel(), self.chunk_bytes,
                host=buffer.device.type == "cpu", o_direct=request.handle.direct_fd is not None,
            )
            chunks += [_Chunk(index, request, piece) for piece in pieces]
        return chunks

    def _submit(self, chunk: _Chunk, is_write: bool, inline: bool) -> Future[None]:
        if inline:
            chunk.inline = True
            future: Future[None] = Future()
            try:
                self._transfer(chunk, is_write)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter below
                future.set_exception(e)
            else:
                future.set_result(None)
            return future
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.num_io_threads, thread_name_prefix="tba-ssd-io")
            executor = self._executor
        return executor.submit(self._transfer, chunk, is_write)

    def _run(self, requests: Sequence[IORequest], is_write: bool, on_done: OnDone | None) -> None:
        chunks = self._plan(requests)
        # A checksummed write: on_done sums each piece as it is written.
        checksum = on_done if is_write else None
        checksummed_write = checksum is not None
        # One chunk runs on the calling thread, unless a write is checksummed: then the I/O
        # thread writes while this thread computes the checksum.
        inline = len(chunks) == 1 and not checksummed_write
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
                if not chunk.piece.direct:
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
                elif checksum is not None:
                    # Note [Checksums of what was written]: written from the live source, so
                    # summed before the write starts; the offloader sums it again afterwards.
                    checksum(chunk.index, chunk.start, chunk.stop, None)
                chunk.future = self._submit(chunk, is_write, inline)
                inflight.append(chunk)
                if checksum is not None and chunk.staging is not None:  # overlaps with the write
                    lead = chunk.piece.lead
                    checksum(chunk.index, chunk.start, chunk.stop, chunk.staging.tensor[lead : lead + chunk.stop - chunk.start])
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
        """Copy a piece of the source tensor into its staging buffer, at its place in the window."""
        assert chunk.staging is not None
        lead, n = chunk.piece.lead, chunk.stop - chunk.start
        source = chunk.request.buffer[chunk.start : chunk.stop]
        if source.is_cuda:
            chunk.staging.tensor[lead : lead + n].copy_(source, non_blocking=True)
            wait_for_stream(source.device)
        else:
            # numpy's copy is several times faster than torch's for uint8 on CPU.
            np.copyto(chunk.staging.array[lead : lead + n], bytes_view(source))

    def _finish(self, chunk: _Chunk, is_write: bool, copy: bool = True) -> BaseException | None:
        """Wait for a chunk's transfer; for a staged read, copy it out; give back its buffer."""
        assert chunk.future is not None
        error = chunk.future.exception()
        if not chunk.inline:
            charge_cpu(chunk.cpu_s)  # CacheStats.io_cpu_s counts the I/O threads' share too
        staging = chunk.staging
        if staging is None:
            return error
        try:
            if error is None and copy and not is_write:
                lead, n = chunk.piece.lead, chunk.stop - chunk.start
                target = chunk.request.buffer[chunk.start : chunk.stop]
                if target.is_cuda:
                    target.copy_(staging.tensor[lead : lead + n], non_blocking=True)
                    wait_for_stream(target.device)
                else:
                    np.copyto(bytes_view(target), staging.array[lead : lead + n])
        except BaseException as e:  # noqa: BLE001 - reported like an I/O failure
            error = e
        finally:
            self._pool.release(staging)
        return error

    # --- one chunk, on an I/O thread -------------------------------------------------------
    def _transfer(self, chunk: _Chunk, is_write: bool) -> None:
        cpu_start = time.thread_time()
        try:
            request, piece = chunk.request, chunk.piece
            if chunk.staging is not None:
                view = chunk.staging.array[: piece.window_bytes]  # whole pages of the extent
                offset = piece.window_offset
            else:
                view = bytes_view(request.buffer[piece.start : piece.stop])
                offset = request.file_offset + piece.start
            if is_write:
                self._loop(request.handle, view, offset, "write", lambda fd, v, off: self._pwrite(fd, v, off))
            else:
                self._loop(request.handle, view, offset, "read", lambda fd, v, off: self._preadv(fd, [v], off))
        finally:
            chunk.cpu_s = time.thread_time() - cpu_start

    def _loop(
        self, handle: PosixFile, view: np.ndarray, offset: int, op: str, call: Callable[[int, np.ndarray, int], int]
    ) -> None:
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
