"""The I/O engine interface of the SSD offloader, the choice between engines, and I/O errors.

An engine moves bytes between tensors and already-open slab files; it knows nothing of slabs,
striping or tokens. Two exist: ``posix`` (always there) and ``kvikio`` (extra ``tba[gds]``).
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from tba.errors import OffloadIOError

__all__ = ["EngineName", "IORequest", "IOEngine", "OnDone", "select_engine", "io_error"]

logger = logging.getLogger(__name__)

EngineName = Literal["auto", "kvikio", "posix"]

_HINTS = {
    errno.ENOSPC: "the drive is full: free space, add directories to ssd_dirs, or offload less",
    errno.EDQUOT: "the disk quota is exhausted: raise the quota or use another directory",
    errno.EFBIG: "a file size limit was hit (ulimit -f or the filesystem's maximum): raise the "
    "limit or use a smaller slab_bytes",
    errno.EIO: "the drive reported an I/O error: check the kernel log (dmesg) and the drive's health",
    errno.EROFS: "the filesystem is read-only: use a writable directory in ssd_dirs",
}


def io_error(
    what: str, *, path: str, offset: int, num_bytes: int, errno_code: int | None, detail: str = ""
) -> OffloadIOError:
    """An ``OffloadIOError`` for a failed transfer, with a hint on what to do."""
    hint = _HINTS.get(errno_code or -1, "")
    if errno_code is None and not hint:
        hint = "the file is shorter than expected or the drive stopped accepting data"
    message = f"SSD offload: {what}" + (f": {detail}" if detail else "") + (f"; {hint}" if hint else "")
    return OffloadIOError(message, path=path, offset=offset, num_bytes=num_bytes, errno=errno_code)


@dataclass(frozen=True)
class IORequest:
    """One contiguous transfer between ``buffer`` and ``file_offset`` of an open slab file."""

    handle: Any
    path: str
    file_offset: int
    buffer: torch.Tensor  # 1-D contiguous uint8; source of a write, destination of a read


# ``on_done(i, start, stop, data)``: bytes ``[start, stop)`` of ``requests[i].buffer`` are final:
# for a read they have landed in the buffer. For a write, ``data`` not None holds exactly the
# bytes handed to the file (a staging copy); ``data`` None means the bytes are about to be
# written straight from the buffer: reported before their write starts, and summed again by the
# offloader after the whole write. Called on the calling thread, while other parts may be in
# flight, so a checksum of them overlaps with the I/O; every byte is reported once.
#
# Note [Checksums of what was written]: a storage can change while it is being stored without
# any error in the saved tensor's own bytes: another version-counter family (an
# ``unsafe_chunk`` sibling, as in PyTorch's CPU GRU/LSTM kernels) writes its own region of the
# same storage in place. A checksum taken from the live source at another moment than the copy
# to the file then describes bytes that were never written, and the reload reports corruption
# that is not there. So a checksum describes either a staging copy, the very bytes written
# (``data`` given), or the live source summed strictly before its write began and again after
# it ended (``Summer.moved``): any change in between that lasts shows as a difference, and the
# offloader then writes again from a snapshot of the source (tested with a source written
# during its store, on the staged and the direct path). Summing *during* the write would not
# do: the drive could read a byte before it changed and the checksum after, and both sums
# would agree on bytes the file does not hold.
OnDone = Callable[[int, int, int, "torch.Tensor | None"], None]


class IOEngine(Protocol):
    """Moves bytes between tensors and slab files. Blocking and thread-safe."""

    name: str

    def open(self, path: str, label: str) -> Any:
        """Open an existing, preallocated slab file at ``path`` (which may resolve through a
        held directory handle); ``label`` is the path errors name. Return the handle requests
        carry."""
        ...

    def close_file(self, handle: Any) -> None:
        """Close a handle from :meth:`open`."""
        ...

    def write(self, requests: Sequence[IORequest], on_done: OnDone | None = None) -> None:
        """Write every request's buffer; raise ``OffloadIOError`` after all have finished."""
        ...

    def read(self, requests: Sequence[IORequest], on_done: OnDone | None = None) -> None:
        """Fill every request's buffer; raise ``OffloadIOError`` after all have finished."""
        ...

    def release_idle(self) -> None:
        """Free memory kept for transfers that are not running (staging buffers); it is
        allocated again by the next transfer that needs it. Safe while transfers run."""
        ...

    def close(self) -> None:
        """Stop threads and free staging memory. Idempotent."""
        ...


_logged_lock = threading.Lock()
_logged: set[tuple[str, str]] = set()


def _log_choice(name: str, reason: str) -> None:
    with _logged_lock:
        first = (name, reason) not in _logged
        _logged.add((name, reason))
    logger.log(logging.INFO if first else logging.DEBUG, "tba SSD offloader: engine %s (%s)", name, reason)


def _kvikio_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("kvikio") is not None


def select_engine(
    engine: str, *, chunk_bytes: int, num_io_threads: int, num_staging_buffers: int
) -> IOEngine:
    """Build the engine named by ``engine`` (``"auto"`` picks one), logging the choice once.

    Raises:
        ValueError: unknown name, or ``"kvikio"`` requested but unusable here.
    """
    from tba.offloaders.ssd._posix import PosixEngine

    def posix(reason: str) -> IOEngine:
        built = PosixEngine(
            chunk_bytes=chunk_bytes, num_io_threads=num_io_threads, num_staging_buffers=num_staging_buffers
        )
        _log_choice(built.name, reason)
        return built

    if engine == "posix":
        return posix("ssd_engine='posix' requested")
    if engine == "kvikio":
        if not _kvikio_importable():
            raise ValueError(
                "ssd_engine='kvikio' but kvikio is not installed; run `pip install \"tba[gds]\"` "
                "or use ssd_engine='posix'"
            )
        from tba.offloaders.ssd._kvikio import KvikioEngine

        built = KvikioEngine(num_threads=num_io_threads)
        _log_choice(built.name, f"ssd_engine='kvikio' requested; {built.mode}")
        return built
    if engine == "auto":
        if not torch.cuda.is_available():
            return posix("auto: no CUDA device, so kvikio would add nothing over pread/pwrite")
        if not _kvikio_importable():
            return posix("auto: kvikio not installed; `pip install \"tba[gds]\"` enables GPUDirect Storage")
        from tba.offloaders.ssd._kvikio import KvikioEngine

        try:
            built = KvikioEngine(num_threads=num_io_threads)
        except Exception as e:  # noqa: BLE001 - auto falls back; an explicit "kvikio" raises
            return posix(f"auto: kvikio is installed but failed to start ({type(e).__name__}: {e})")
        if not built.gds:
            # Note [auto prefers posix over kvikio's compat mode]: compat mode bounces CUDA
            # tensors through host memory with copies on blocking streams that serialise with
            # the default stream (no overlap with compute); the posix engine stages through
            # its own pinned buffers on tba's transfer streams.
            built.close()
            return posix(f"auto: kvikio would run in {built.mode}; the posix engine overlaps better")
        _log_choice(built.name, f"auto: CUDA and kvikio present; {built.mode}")
        return built
    raise ValueError(f"ssd_engine must be 'auto', 'kvikio' or 'posix', got {engine!r}")
