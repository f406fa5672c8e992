"""Tokens of the SSD offloader: where a stored tensor's bytes are, and their verification.

A token lists one extent per directory the tensor was striped over, the allocation serial of
each (so a token whose extent was freed and handed to another tensor is caught) and, with
``verify="checksum"``, each extent's checksum taken at store time (Note [Checksum choice]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tba.errors import OffloadIOError
from tba.offloaders.ssd._checksum import Accumulator, Digest
from tba.offloaders.ssd._engine import IORequest, OnDone
from tba.offloaders.ssd._slabs import Slab, SlabDir

__all__ = ["Extent", "SSDToken", "request_for", "summer", "check_owned", "check_digests"]


@dataclass(frozen=True)
class Extent:
    slab_dir: SlabDir
    slab: Slab
    file_offset: int
    start: int  # the byte range [start, stop) of the stored tensor that lives here
    stop: int
    serial: int  # the allocation holding [file_offset, ...) of the slab for this token


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
    return IORequest(extent.slab.handle, extent.slab.path, extent.file_offset, buffer[extent.start : extent.stop])


def summer(requests: list[IORequest], sums: list[Accumulator] | None) -> OnDone | None:
    """The engine's ``on_done``: adds each finished piece to its extent's checksum."""
    if sums is None:
        return None

    def on_done(index: int, start: int, stop: int, data: torch.Tensor | None = None) -> None:
        sums[index].add(requests[index].buffer[start:stop] if data is None else data, start)

    return on_done


def check_owned(token: SSDToken) -> None:
    """Raise if an extent of ``token`` was freed and handed to another allocation."""
    for extent in token.extents:
        if not SlabDir.owns(extent.slab, extent.file_offset, extent.serial):
            raise OffloadIOError(
                "SSD offload: load of an extent that was freed and given to another tensor "
                "(tba bug: the token outlived its release); the activation is lost",
                path=extent.slab.path,
                offset=extent.file_offset,
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
                offset=extent.file_offset,
                num_bytes=extent.stop - extent.start,
            )
