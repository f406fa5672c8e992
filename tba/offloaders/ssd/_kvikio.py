"""The ``kvikio`` I/O engine: ``kvikio.CuFile`` pwrite/pread, GPUDirect Storage where cuFile works.

CUDA tensors go to the file directly (GDS) or through kvikio's own bounce buffers (compat mode);
host tensors are handed over as numpy views. kvikio does not keep a buffer alive while its
future runs, so every buffer stays referenced here until its future has completed, also when
another request of the same call failed (see Note [kvikio buffer lifetime]).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from tba.offloaders._byte_views import bytes_view
from tba.offloaders._stream_wait import wait_for_stream
from tba.offloaders.ssd._engine import IORequest, OnDone, io_error

logger = logging.getLogger(__name__)

__all__ = ["KvikioEngine"]

_ERRNOS = (
    errno.ENOSPC,
    errno.EIO,
    errno.EFBIG,
    errno.EDQUOT,
    errno.EROFS,
    errno.EINVAL,
    errno.EBADF,
    errno.EACCES,
    errno.EPERM,
    errno.ENOENT,
)


def _errno_of(error: BaseException) -> int | None:
    """kvikio raises RuntimeError with the C error text in the message: recover the errno."""
    code = getattr(error, "errno", None)
    if isinstance(code, int):
        return code
    text = str(error)
    match = re.search(r"errno[ =:]+(\d+)", text, re.IGNORECASE)
    if match:
        return int(match.group(1))
    for candidate in _ERRNOS:
        if os.strerror(candidate).lower() in text.lower():
            return candidate
    return None


class KvikioEngine:
    """Blocking, thread-safe transfers through ``kvikio.CuFile`` (one handle per slab file).

    Raises:
        ValueError: no CUDA device and kvikio's compat mode is not forced on. Without a driver,
            kvikio's cuFile probing can spin forever, so ``KVIKIO_COMPAT_MODE=ON`` is required.
    """

    name = "kvikio"

    def __init__(self, num_threads: int | None = None) -> None:
        import kvikio
        import kvikio.defaults

        self._kvikio = kvikio
        if num_threads is not None and kvikio.defaults.get("num_threads") != num_threads:
            # kvikio's thread pool is process-wide and sized from KVIKIO_NTHREADS (default 1):
            # set it explicitly to the transfer parallelism tba is configured for.
            logger.info("tba SSD offloader: kvikio thread pool set to %d threads", num_threads)
            kvikio.defaults.set("num_threads", num_threads)
        compat = kvikio.defaults.get("compat_mode")
        if not torch.cuda.is_available():
            if compat != kvikio.CompatMode.ON:
                raise ValueError(
                    "ssd_engine='kvikio' without a CUDA device needs kvikio's compat mode: set "
                    "KVIKIO_COMPAT_MODE=ON before starting Python, or use ssd_engine='posix'"
                )
            self.mode = "compat mode (POSIX I/O inside kvikio; no CUDA device)"
            self.gds = False
        elif kvikio.defaults.is_compat_mode_preferred():
            self.mode = "compat mode: cuFile/GPUDirect Storage unavailable, kvikio bounces through host memory"
            self.gds = False
        else:
            self.mode = "GPUDirect Storage through cuFile"
            self.gds = True
            _warn_if_unregistered()

    def open(self, path: str, label: str) -> Any:
        return self._kvikio.CuFile(path, "r+")  # errors name IORequest.path, the label

    def close_file(self, handle: Any) -> None:
        handle.close()

    def release_idle(self) -> None:
        pass  # kvikio moves bytes to and from the tensors themselves: no buffers kept

    def close(self) -> None:
        pass

    def write(self, requests: Sequence[IORequest], on_done: OnDone | None = None) -> None:
        # Note [Checksums of what was written]: kvikio writes from the source itself, so it is
        # summed before the write starts (and again by the offloader after it ends).
        if on_done is not None:
            for i, request in enumerate(requests):
                on_done(i, 0, request.buffer.numel(), None)
        self._run(requests, is_write=True)

    def read(self, requests: Sequence[IORequest], on_done: OnDone | None = None) -> None:
        self._run(requests, is_write=False)
        # kvikio reports no progress inside a request: the whole read is checked afterwards.
        if on_done is not None:
            for i, request in enumerate(requests):
                on_done(i, 0, request.buffer.numel(), None)

    def _run(self, requests: Sequence[IORequest], is_write: bool) -> None:
        op = "write" if is_write else "read"
        # kvikio copies on its own stream: everything queued on ours (the producer's event
        # wait, or an earlier use of the destination's memory) must be done first.
        for device in {r.buffer.device for r in requests if r.buffer.is_cuda}:
            wait_for_stream(device)
        # Note [kvikio buffer lifetime]: `pending` holds the tensor and the object handed to
        # kvikio until the future is done; dropping either early lets the memory be reused
        # while kvikio still reads or writes it.
        pending: list[tuple[IORequest, Any, Any]] = []
        error: BaseException | None = None
        for request in requests:
            buffer = request.buffer if request.buffer.is_cuda else bytes_view(request.buffer)
            size = request.buffer.numel()
            try:
                call = request.handle.pwrite if is_write else request.handle.pread
                future = call(buffer, size, request.file_offset)
            except Exception as e:  # noqa: BLE001 - mapped to OffloadIOError below
                error = self._wrap(e, op, request)
                break
            pending.append((request, buffer, future))
        for request, _buffer, future in pending:
            try:
                count = future.get()
            except Exception as e:  # noqa: BLE001 - mapped to OffloadIOError
                error = error or self._wrap(e, op, request)
                continue
            if count != request.buffer.numel() and error is None:
                error = io_error(
                    f"short {op}: kvikio moved {count} of {request.buffer.numel()} bytes",
                    path=request.path,
                    offset=request.file_offset,
                    num_bytes=request.buffer.numel(),
                    errno_code=None,
                )
        pending.clear()
        if error is not None:
            raise error

    @staticmethod
    def _wrap(error: BaseException, op: str, request: IORequest) -> BaseException:
        wrapped = io_error(
            f"kvikio {op} failed",
            path=request.path,
            offset=request.file_offset,
            num_bytes=request.buffer.numel(),
            errno_code=_errno_of(error),
            detail=str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__,
        )
        wrapped.__cause__ = error
        return wrapped


_warned_unregistered = False


def _warn_if_unregistered() -> None:
    """Warn once per process when GDS will move memory the malloc hook did not register."""
    global _warned_unregistered
    if _warned_unregistered:
        return
    from tba.malloc_hook import gds_registration_problem

    problem = gds_registration_problem()
    if problem is not None:
        _warned_unregistered = True
        warnings.warn(f"tba: GPUDirect Storage in use but {problem}", RuntimeWarning, stacklevel=3)
