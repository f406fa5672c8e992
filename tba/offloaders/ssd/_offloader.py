"""``SSDOffloader``: stripes activation bytes over slab files in one or more directories."""

from __future__ import annotations

import errno
import logging
import os
import tempfile
import threading
import weakref
from collections.abc import Sequence
from typing import Literal

import torch

from tba import _env
from tba.errors import OffloadIOError
from tba.offloaders.ssd import _lifecycle
from tba.offloaders.ssd._checksum import Accumulator
from tba.offloaders.ssd._engine import EngineName, IOEngine, select_engine
from tba.offloaders.ssd._posix import ALIGNMENT
from tba.offloaders.ssd._private_dir import PrivateDir
from tba.offloaders.ssd._stale_dirs import remove_stale_dirs
from tba.offloaders.ssd._slabs import SlabDir
from tba.offloaders.ssd._tokens import Extent, SSDToken, Summer, check_digests, check_owned, request_for, summer
from tba.settings import SSD_CHUNK_BYTES, SSD_SLAB_BYTES, SSD_STRIPE_MIN_BYTES

__all__ = ["SSDOffloader", "SSDToken"]

logger = logging.getLogger(__name__)

_MiB = 1 << 20

Verify = Literal["checksum", "none"]
_VERIFY_MODES = ("checksum", "none")


class _Resources:
    """Everything that must be undone; shared by ``close``, the GC finalizer and the exit hooks."""

    def __init__(self, engine: IOEngine, slab_dirs: list[SlabDir]) -> None:
        self.engine = engine
        self.slab_dirs = slab_dirs
        self.closed = False
        self.lifecycle_handle: int | None = None

    def close(self) -> None:
        if self.closed and self.lifecycle_handle is None:
            return
        self.closed = True
        if self.lifecycle_handle is not None:
            _lifecycle.unregister(self.lifecycle_handle)
            self.lifecycle_handle = None
        self.engine.close()
        for slab_dir in self.slab_dirs:
            slab_dir.close()

    def remove_now(self) -> None:
        """Exit/signal path: no locks, no joins, no descriptor closes; just delete the files."""
        self.closed = True
        for slab_dir in self.slab_dirs:
            slab_dir.remove_now()


def _validate(
    dirs: tuple[str, ...],
    engine: str,
    rank: int | None,
    sizes: dict[str, int],
    expected_bytes: int | None,
    verify: str,
) -> None:
    problems = []
    if verify not in _VERIFY_MODES:
        problems.append(f"verify must be one of {_VERIFY_MODES}, got {verify!r}")
    if not dirs:
        problems.append("ssd_dirs is empty: give at least one directory (or None for the default)")
    if any(not isinstance(d, str | os.PathLike) or not str(d) for d in dirs):
        problems.append(f"ssd_dirs must hold non-empty paths, got {dirs!r}")
    if len({os.path.realpath(d) for d in dirs}) != len(dirs):
        problems.append(f"ssd_dirs names a directory twice: {dirs!r}; list each drive once")
    if engine not in ("auto", "kvikio", "posix"):
        problems.append(f"ssd_engine must be 'auto', 'kvikio' or 'posix', got {engine!r}")
    if rank is not None and (not isinstance(rank, int) or rank < 0):
        problems.append(f"rank must be a non-negative int or None, got {rank!r}")
    for name, value in sizes.items():
        if not isinstance(value, int) or value < ALIGNMENT or value % ALIGNMENT:
            problems.append(f"{name} must be a positive multiple of {ALIGNMENT}, got {value!r}")
    if expected_bytes is not None and (not isinstance(expected_bytes, int) or expected_bytes < 0):
        problems.append(f"expected_bytes must be a non-negative int or None, got {expected_bytes!r}")
    missing = [d for d in dirs if isinstance(d, str | os.PathLike) and str(d) and not os.path.isdir(d)]
    for d in missing:
        what = "is not a directory" if os.path.lexists(d) else "does not exist"
        problems.append(f"SSD offload directory {str(d)!r} {what}: create it or pass another in ssd_dirs / TBA_SSD_DIR")
    if problems:
        raise ValueError("invalid SSD offloader settings:\n  - " + "\n  - ".join(problems))


class SSDOffloader:
    """Offloads activation bytes to files on one or more SSDs (``offloader="ssd"``).

    Each process gets a private directory (mode 0700) under every entry of ``dirs``, holding a
    few preallocated slab files carved into 4 KiB-aligned extents that are reused step after
    step; a tensor of at least ``stripe_min_bytes`` per drive is striped over the directories
    (RAID0 without mdadm). The directories are removed on :meth:`close`, at interpreter exit and
    on SIGTERM/SIGINT; directories left behind by dead processes of this host are removed when
    the next offloader starts on the same parent.

    Args:
        dirs: parent directories, one per drive. Default: ``TBA_SSD_DIR`` (several joined by
            ``os.pathsep``), else the system temp directory.
        engine: ``"posix"`` (pread/pwrite, O_DIRECT where allowed), ``"kvikio"`` (cuFile /
            GPUDirect Storage, extra ``tba[gds]``), or ``"auto"``: kvikio when CUDA and kvikio
            are present, else posix. The choice and its reason are logged once.
        rank: distributed rank, part of the directory name.
        slab_bytes: largest size of one preallocated slab file. Slabs are added as needed,
            doubling the capacity from 4 MiB, and :meth:`reserve` adds exactly what is missing;
            a tensor larger than this gets a slab of its own size.
        stripe_min_bytes: a tensor is split over ``min(len(dirs), num_bytes // stripe_min_bytes)``
            directories (at least one).
        chunk_bytes: posix engine transfer unit and staging-buffer size.
        num_io_threads: posix engine I/O threads (transfers in flight per call).
        num_staging_buffers: posix engine staging buffers shared by all calls.
        expected_bytes: if given, :meth:`reserve` it now, so lack of space fails here.
        verify: ``"checksum"`` (default): every extent's checksum is taken at store time and
            checked on every load, so bytes that changed on disk raise ``OffloadIOError``
            instead of reaching backward (see Note [Checksum choice]); ``"none"``: not checked.
            Either way, a load through an extent that was freed and given to another tensor
            raises.

    Raises:
        ValueError: bad settings, or a directory that is missing or not writable.
        tba.OffloadIOError: ``expected_bytes`` does not fit on the drives.

    Example:
        >>> off = SSDOffloader(dirs=("/mnt/nvme0", "/mnt/nvme1"), engine="posix")  # doctest: +SKIP
        >>> token = off.store(x.view(-1).view(torch.uint8))  # doctest: +SKIP
        >>> off.load(token, out)  # doctest: +SKIP
        >>> off.release(token); off.close()  # doctest: +SKIP
    """

    name = "ssd"

    def __init__(
        self,
        *,
        dirs: Sequence[str] | str | None = None,
        engine: EngineName = "auto",
        rank: int | None = None,
        slab_bytes: int = SSD_SLAB_BYTES,
        stripe_min_bytes: int = SSD_STRIPE_MIN_BYTES,
        chunk_bytes: int = SSD_CHUNK_BYTES,
        num_io_threads: int = 4,
        num_staging_buffers: int = 8,
        expected_bytes: int | None = None,
        verify: Verify = "checksum",
    ) -> None:
        if dirs is None:
            dirs = _env.ssd_dirs() or (tempfile.gettempdir(),)
        elif isinstance(dirs, str | os.PathLike):
            dirs = (dirs,)
        parents = tuple(os.fspath(d) for d in dirs)
        sizes = {"slab_bytes": slab_bytes, "stripe_min_bytes": stripe_min_bytes, "chunk_bytes": chunk_bytes}
        _validate(parents, engine, rank, sizes, expected_bytes, verify)
        self.verify: Verify = verify
        self._stripe_min_bytes = stripe_min_bytes
        # A reservation failure raised where no one sees it (the cache reserves at the end of
        # a step, inside a destructor) is raised again by the next store: see reserve().
        self._pending_error: OffloadIOError | None = None
        self._lock = threading.Lock()
        self._next_dir = 0
        for parent in parents:
            remove_stale_dirs(parent)
        self._engine = select_engine(
            engine, chunk_bytes=chunk_bytes, num_io_threads=num_io_threads, num_staging_buffers=num_staging_buffers
        )
        slab_dirs: list[SlabDir] = []
        try:
            for parent in parents:
                slab_dirs.append(SlabDir(PrivateDir(parent, rank), self._engine, slab_bytes, ALIGNMENT))
        except BaseException:
            for slab_dir in slab_dirs:
                slab_dir.close()
            self._engine.close()
            raise
        self._dirs = slab_dirs
        self._resources = _Resources(self._engine, slab_dirs)
        self._resources.lifecycle_handle = _lifecycle.register(self._resources.remove_now)
        self._finalizer = weakref.finalize(self, self._resources.close)
        self._finalizer.atexit = False  # the lifecycle registry handles exit
        logger.debug("tba SSD offloader: directories %s", self.directories)
        if expected_bytes:
            try:
                self._reserve(expected_bytes)
            except BaseException:
                self.close()
                raise

    # --- introspection ---------------------------------------------------------------------
    @property
    def directories(self) -> tuple[str, ...]:
        """The private directories (one per parent), removed on close."""
        return tuple(d.path for d in self._dirs)

    @property
    def engine(self) -> str:
        """Name of the I/O engine in use: ``"posix"`` or ``"kvikio"``."""
        return self._engine.name

    @property
    def capacity_bytes(self) -> int:
        """Bytes of slab files on disk (preallocated), over all directories."""
        return sum(d.capacity_bytes for d in self._dirs)

    @property
    def used_bytes(self) -> int:
        """Bytes of slab space held by stored, unreleased tensors (rounded to 4 KiB)."""
        return sum(d.used_bytes for d in self._dirs)

    def __repr__(self) -> str:
        return f"SSDOffloader(engine={self.engine!r}, directories={self.directories!r})"

    # --- the Offloader protocol ------------------------------------------------------------
    def store(self, src: torch.Tensor) -> SSDToken:
        """Write every byte of ``src`` (1-D contiguous uint8) to the drives; return its token.

        Raises:
            tba.OffloadIOError: the write failed (path, offset, bytes and errno attached), or the
                last :meth:`reserve` found too little disk space (raised here, once).
        """
        self._check_open()
        _check_bytes(src, "src")
        self._raise_pending()
        extents: list[Extent] = []
        host = src.device.type == "cpu"
        try:
            for start, stop, slab_dir in self._pieces(src.numel(), src.data_ptr()):
                # Host bytes keep their page offset in the file (Note [Direct windows]).
                phase = (src.data_ptr() + start) % ALIGNMENT if host else 0
                slab, offset, serial = slab_dir.allocate(stop - start + phase)
                extents.append(Extent(slab_dir, slab, offset, start, stop, serial, phase))
            sums = self._write(extents, src, recheck=True)
            if sums is not None and sums[1].moved():
                # Note [Checksums of what was written]: the source changed while it was being
                # written; write a snapshot (nobody else writes it) instead.
                sums = self._write(extents, src.clone(), recheck=False)
        except BaseException:
            for extent in extents:
                extent.slab_dir.free(extent.slab, extent.file_offset, extent.serial)
            raise
        digests = None if sums is None else tuple(a.digest() for a in sums[0])
        return SSDToken(src.numel(), tuple(extents), digests)

    def _write(
        self, extents: list[Extent], src: torch.Tensor, recheck: bool
    ) -> tuple[list[Accumulator], Summer] | None:
        """Write ``src`` to ``extents``; its checksums and their summer (None unverified)."""
        requests = [request_for(e, src) for e in extents]
        if self.verify != "checksum":
            self._engine.write(requests)
            return None
        sums = [Accumulator() for _ in extents]
        on_done = Summer(requests, sums, recheck=recheck)
        self._engine.write(requests, on_done)
        return sums, on_done

    def load(self, token: SSDToken, dst: torch.Tensor) -> None:
        """Fill ``dst`` (1-D contiguous uint8 of the stored size) with the bytes of ``token``.

        Raises:
            tba.OffloadIOError: the read failed (path, offset, bytes and errno attached); the
                bytes read differ from those written (checksum mismatch); or an extent of the
                token was freed and given to another tensor.
        """
        self._check_open()
        _check_bytes(dst, "dst")
        if not isinstance(token, SSDToken):
            raise ValueError(f"load() expects a token returned by SSDOffloader.store, got {type(token).__name__}")
        if token.released:
            raise ValueError("load() of a released token: its space may hold another tensor now")
        if dst.numel() != token.num_bytes:
            raise ValueError(f"load() into {dst.numel()} bytes, but the token holds {token.num_bytes}")
        check_owned(token)
        requests = [request_for(e, dst) for e in token.extents]
        sums = None if token.digests is None else [Accumulator() for _ in token.extents]
        self._engine.read(requests, summer(requests, sums))
        check_owned(token)  # not handed over while the read ran either
        if sums is not None:
            check_digests(token, sums)

    def release(self, token: SSDToken) -> None:
        """Give the token's extents back for reuse. Idempotent; a no-op after close."""
        with self._lock:
            if token.released:
                return
            token.released = True
        if self._resources.closed:
            return
        for extent in token.extents:
            extent.slab_dir.free(extent.slab, extent.file_offset, extent.serial)

    def reserve(self, num_bytes: int) -> None:
        """Preallocate slab space for ``num_bytes`` held at once, spread over the directories.

        Raises nothing itself: the cache calls this at the end of a step, inside a destructor,
        where an exception would be printed and lost. When the drives cannot hold it, the
        ``OffloadIOError`` (errno ENOSPC, numbers per directory) is logged and raised by the
        next :meth:`store`, once; the cache re-raises that in the training step (with
        ``on_io_error="keep"`` it keeps that tensor in memory and warns). To fail at once,
        pass ``expected_bytes`` to the constructor.
        """
        self._check_open()
        if getattr(self._engine, "gds", False):
            # Training is under way and PyTorch has reserved what it needs: if the malloc hook
            # registered far less than that with cuFile, GDS bounces most transfers (warned
            # once per process; issue 16, finding 11).
            from tba import malloc_hook

            malloc_hook.warn_if_registration_short()
        try:
            self._reserve(num_bytes)
        except OffloadIOError as e:
            # The text, not the exception: a log handler keeping records (pytest's caplog) would
            # otherwise keep the exception, and with it the traceback of the training step it is
            # raised in later, with that step's tensors.
            logger.warning("tba: %s (raised by the next store)", str(e))
            with self._lock:
                self._pending_error = e

    def _reserve(self, num_bytes: int) -> None:
        if num_bytes <= 0:
            return
        per_dir = -(-num_bytes // len(self._dirs))
        problems = []
        for slab_dir in self._dirs:
            missing, free = slab_dir.shortfall(per_dir)
            if missing > free:
                problems.append(f"{slab_dir.path} needs {missing} more bytes of slabs, {free} bytes free")
        if problems:
            raise OffloadIOError(
                f"SSD offload: not enough free disk space to hold {num_bytes} bytes of activations "
                f"({per_dir} per directory): {'; '.join(problems)}. Free space on those drives, add "
                "directories to ssd_dirs, or offload fewer tensors",
                path=self._dirs[0].path if len(self._dirs) == 1 else None,
                num_bytes=num_bytes,
                errno=errno.ENOSPC,
            )
        for slab_dir in self._dirs:
            slab_dir.grow(per_dir)

    def close(self) -> None:
        """Stop I/O threads, delete the slab files and the private directories. Idempotent."""
        self._finalizer.detach()
        self._resources.close()

    # --- internals -------------------------------------------------------------------------
    def _raise_pending(self) -> None:
        with self._lock:
            error, self._pending_error = self._pending_error, None
        if error is not None:
            raise error

    def _check_open(self) -> None:
        if self._resources.closed:
            raise OffloadIOError(
                "SSD offloader is closed (close() was called, or its directories were removed at "
                "exit or on SIGTERM/SIGINT); build a new one to offload again"
            )

    def _pieces(self, num_bytes: int, address: int = 0) -> list[tuple[int, int, SlabDir]]:
        """Split ``[0, num_bytes)`` of a buffer at ``address`` into pieces, one per directory
        used, rotating the start. Every piece but the first starts on a 4 KiB-aligned memory
        address (GPUDirect Storage moves aligned device addresses without bouncing; the file
        offsets are aligned by the slab allocator)."""
        if num_bytes == 0:
            return []
        num_dirs = len(self._dirs)
        num_pieces = max(1, min(num_dirs, num_bytes // self._stripe_min_bytes))
        per_piece = -(-num_bytes // num_pieces)
        piece = -(-per_piece // ALIGNMENT) * ALIGNMENT
        lead = -address % ALIGNMENT  # bytes before the first aligned address
        with self._lock:
            first = self._next_dir
            self._next_dir = (first + 1) % num_dirs
        bounds = [0] + [b for b in range(lead + piece, num_bytes, piece)] + [num_bytes]
        return [
            (start, stop, self._dirs[(first + i) % num_dirs])
            for i, (start, stop) in enumerate(zip(bounds, bounds[1:]))
            if stop > start
        ]


def _check_bytes(tensor: torch.Tensor, what: str) -> None:
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(
            f"{what} must be a 1-D contiguous torch.uint8 tensor, got dtype={tensor.dtype}, "
            f"shape={tuple(tensor.shape)}, contiguous={tensor.is_contiguous()}; pass "
            "t.contiguous().view(-1).view(torch.uint8)"
        )
