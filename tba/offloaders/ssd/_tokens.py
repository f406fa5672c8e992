"""Tokens of the SSD offloader: where a stored tensor's bytes are, and their verification.

A token lists one extent per directory the tensor was striped over, the allocation serial of
each (so a token whose extent was freed and handed to another tensor is caught) and, with
``verify="checksum"``, each extent's checksum taken at store time (Note [Checksum choice]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tba.errors import OffloadIOError
from tba.offloaders.ssd._checksum import Accumulator, Digest, piece_sums
from tba.offloaders.ssd._engine import IORequest, OnDone
from tba.offloaders.ssd._slabs import Slab, SlabDir

__all__ = ["Extent", "SSDToken", "Summer", "request_for", "summer", "check_owned", "check_digests"]


@dataclass(frozen=True)
class Extent:
    slab_dir: SlabDir
    slab: Slab
    file_offset: int  # of the allocation (page-aligned)
    start: int  # the byte range [start, stop) of the stored tensor that lives here
    stop: int
    serial: int  # the allocation holding [file_offset, ...) of the slab for this token
    # The bytes start at file_offset + phase: the page offset they had in (host) memory, so
    # their page-aligned windows move with O_DIRECT (Note [Direct windows]).
    phase: int = 0

    @property
    def data_offset(self) -> int:
        """File offset of the first byte of ``[start, stop)``."""
        return self.file_offset + self.phase


@dataclass(eq=False)
class SSDToken:
    """Where one stored tensor's bytes are: one extent per directory it was striped over, and
    each extent's checksum taken at store time (None with ``verify="none"``)."""

    num_bytes: int
    extents: tuple[Extent, ...]
    digests: tuple[Digest, ...] | None = None
    released: bool = False


def request_for(extent: Extent, buffer: torch.Tensor) -> IORequest:
    """The transfer between ``extent`` and its part of ``buffer`` (the whole tensor's bytes)."""
    return IORequest(extent.slab.handle, extent.slab.path, extent.data_offset, buffer[extent.start : extent.stop])


class Summer:
    """The engine's ``on_done``: adds each piece to its extent's checksum.

    Note [Checksums of what was written]: a piece of a write reported without ``data`` is being
    written from the live source, summed just before its write started; ``moved()``, called
    after the write, sums those pieces again: if any changed meanwhile, the file may hold other
    bytes than the checksum describes, and the caller writes a snapshot instead.
    """

    def __init__(self, requests: list[IORequest], sums: list[Accumulator], *, recheck: bool = False) -> None:
        self._requests = requests
        self._sums = sums
        self._recheck = recheck
        self._live: list[tuple[int, int, int, tuple[int, int]]] = []

    def __call__(self, index: int, start: int, stop: int, data: torch.Tensor | None = None) -> None:
        if data is not None:
            self._sums[index].add(data, start)
            return
        part = piece_sums(self._requests[index].buffer[start:stop], start)
        self._sums[index].add_sums(stop - start, part)
        if self._recheck:
            self._live.append((index, start, stop, part))

    def moved(self) -> bool:
        """Whether a piece written from the live source changed since it was summed."""
        return any(
            piece_sums(self._requests[index].buffer[start:stop], start) != part
            for index, start, stop, part in self._live
        )


def summer(requests: list[IORequest], sums: list[Accumulator] | None) -> OnDone | None:
    """The ``on_done`` of a read: adds each finished piece to its extent's checksum."""
    return None if sums is None else Summer(requests, sums)


def check_owned(token: SSDToken) -> None:
    """Raise if an extent of ``token`` was freed and handed to another allocation."""
    for extent in token.extents:
        if not SlabDir.owns(extent.slab, extent.file_offset, extent.serial):
            raise OffloadIOError(
                "SSD offload: load of an extent that was freed and given to another tensor "
                "(tba bug: the token outlived its release); the activation is lost",
                path=extent.slab.path,
                offset=extent.data_offset,
                num_bytes=extent.stop - extent.start,
            )


def check_digests(token: SSDToken, sums: list[Accumulator]) -> None:
    """Raise if the bytes read (summed in ``sums``) differ from those written."""
    assert token.digests is not None
    for extent, expected, accumulator in zip(token.extents, token.digests, sums):
        found = accumulator.digest()
        if found != expected:
            raise OffloadIOError(
                "SSD offload: the data on disk changed since it was written (checksum "
                f"{found} read, {expected} written); the drive, its connection, or another "
                "program writing into this file corrupted it. The activation is lost: this "
                "step cannot be completed; check the drive (dmesg, smartctl) and that no "
                "other program uses this directory",
                path=extent.slab.path,
                offset=extent.data_offset,
                num_bytes=extent.stop - extent.start,
            )
