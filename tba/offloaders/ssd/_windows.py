"""How the posix engine cuts a transfer into pieces, and which pieces go straight to the file.

Note [Direct windows]: O_DIRECT moves whole pages: the memory address, the file offset and the
length must all be multiples of ``ALIGNMENT``. A CPU tensor almost never starts on a page
(PyTorch's CPU allocator aligns to 64 bytes), so copying every byte through an aligned staging
buffer used to cost one memory copy per byte each way. Instead, the SSD offloader puts a host
tensor's bytes in the file at the same offset modulo the page as they have in memory (an
extent's ``phase``), and the cache allocates host reload buffers at that same page offset (Note
[Reload buffers at the source's page offset]). Then every page-aligned window of the tensor
faces a page-aligned window of the file, and the engine moves it with O_DIRECT straight between
the tensor's memory and the drive (DMA, no copy); only the ragged head (up to the first page
boundary) and tail (after the last one) go through a staging buffer.

A transfer is cut where the *file* offset is page-aligned: a head piece up to the first such
offset, pieces of at most ``chunk_bytes`` between, a tail piece after the last one. A staged
piece moves as the whole file pages that hold it (its window): the bytes of those pages outside
the piece lie in the same extent (allocated from the page below its data to the page above) and
are padding, so writing them clobbers nothing, and no two pieces share a page. Where memory and
file disagree modulo the page (a device tensor, a destination at another page offset, a
filesystem without O_DIRECT for staged pieces) the same cuts are used and the pieces staged.
"""

from __future__ import annotations

from dataclasses import dataclass

from tba.offloaders.ssd._posix_files import ALIGNMENT

__all__ = ["Piece", "plan_pieces"]


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, stop)`` of a request's buffer and how they move."""

    start: int
    stop: int
    direct: bool  # straight between the buffer's memory and the file; else through staging
    window_offset: int  # file offset of the first page holding the piece (staged pieces)
    lead: int  # bytes from ``window_offset`` to the piece (staged pieces)
    window_bytes: int  # whole pages moved for a staged piece (<= chunk_bytes)


def plan_pieces(address: int, file_offset: int, num_bytes: int, chunk_bytes: int, *, host: bool,
                o_direct: bool) -> list[Piece]:
    """The pieces of a transfer of ``num_bytes`` between memory at ``address`` and the file at
    ``file_offset``; ``host``: the memory is host memory the kernel can read and write;
    ``o_direct``: the file is open with O_DIRECT (else buffered I/O takes any alignment, and
    host memory moves straight)."""
    a = ALIGNMENT
    head_end = min(num_bytes, -file_offset % a)
    tail_start = max(head_end, (file_offset + num_bytes) // a * a - file_offset)
    cuts = [0, head_end, *range(head_end + chunk_bytes, tail_start, chunk_bytes), tail_start, num_bytes]
    pieces = []
    for start, stop in zip(cuts, cuts[1:]):
        if stop <= start:
            continue
        if o_direct:
            direct = host and (address + start) % a == 0 and (file_offset + start) % a == 0 and (stop - start) % a == 0
        else:
            direct = host
        window_offset = (file_offset + start) // a * a
        lead = file_offset + start - window_offset
        window_bytes = -(-(lead + stop - start) // a) * a
        pieces.append(Piece(start, stop, direct, window_offset, lead, window_bytes))
    return pieces
