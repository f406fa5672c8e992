"""Checksums of offloaded bytes, computed with torch ops on the device the bytes are on.

Note [Checksum choice]: the digest of a byte range is built from its 512-byte blocks (the sector
size). Each block is read as 64 little-endian int64 words and summed (``R_i``, modulo 2**64);
the digest is ``(num_bytes, sum R_i, sum (i + 1) * R_i)``, modulo 2**64. A short last block is
zero-padded. Why this and not a CRC or xxHash:

- It runs where the bytes are. Under GPUDirect Storage a reload lands in GPU memory and never
  passes through host memory, so a host checksum would need an extra device-to-host copy; two
  reductions on the tensor's own device cost nothing next to the drive (GPU memory moves TB/s).
  The CPU tests run exactly this code.
- It is fast on the host too. Measured on the 2-core development machine (256 MiB, median of 5,
  torch 2.13.0 CPU): these sums 24 GB/s on 2 threads (12 GB/s on one), xxh3_64 (python-xxhash
  4.1.0) 13 GB/s, crc32c 2.9 13 GB/s, zlib.crc32 2.2 GB/s. So no dependency is needed.
- It is exact integer arithmetic: the same bytes give the same digest on any device, in any
  order of summation, split into any pieces (``Digest`` parts combine: see ``Accumulator``).
  That lets the posix engine checksum chunk k while chunk k+1 is still on its way to or from
  the drive, so verification hides behind the I/O.

What it detects: any change confined to one 8-byte word (every single-bit flip), random or
zeroed data (missed with probability about 2**-64 per block sum), truncation, a short or lost
write, blocks moved, swapped or shifted (the block index weights the second sum), data of
another tensor. What it misses: words permuted inside one 512-byte block, and changes that
cancel within one block (+d in one word, -d in another). It is not a defence against someone
who can write the files on purpose: the sums are linear and easy to forge (docs/ssd.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BLOCK_BYTES", "Digest", "Accumulator", "digest_of"]

BLOCK_BYTES = 512
_WORDS = BLOCK_BYTES // 8
_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Digest:
    """The checksum of one byte range."""

    num_bytes: int
    total: int  # sum of block sums, mod 2**64
    weighted: int  # sum of (block index + 1) * block sum, mod 2**64

    def __str__(self) -> str:
        return f"{self.total:016x}:{self.weighted:016x}"


class Accumulator:
    """Builds the digest of a byte range from pieces given in any order.

    Each piece is ``(data, start)``: the bytes ``[start, start + len(data))`` of the range.
    Pieces must not overlap; every piece but the last one of the range must start and end on a
    ``BLOCK_BYTES`` boundary (the last may end anywhere). Not thread-safe: one caller adds.
    """

    def __init__(self) -> None:
        self._total = 0
        self._weighted = 0
        self._num_bytes = 0

    def add(self, data: torch.Tensor, start: int) -> None:
        """Add the bytes ``data`` (1-D contiguous uint8, any device) found at ``start``."""
        if start % BLOCK_BYTES:
            raise ValueError(f"a checksum piece must start on a {BLOCK_BYTES}-byte boundary, got {start}")
        n = data.numel()
        if n == 0:
            return
        first_block = start // BLOCK_BYTES
        num_full = n // BLOCK_BYTES
        total, weighted = _sums_torch(data, first_block, num_full)
        self._total = (self._total + total) & _MASK
        self._weighted = (self._weighted + weighted) & _MASK
        self._num_bytes += n

    def digest(self) -> Digest:
        return Digest(self._num_bytes, self._total, self._weighted)


# Note [Checksum threads]: torch runs a CPU op on its OpenMP pool once it has GRAIN_SIZE (32768)
# elements or more, and the pool's threads spin while idle. Next to the engine's I/O threads and
# the training thread on a busy 2-core machine that made verification cost +140% (once +1150%)
# of the posix engine's write+read time, where one thread cost about -6..+21% at the same load
# (io_bandwidth.py, 256 MiB, load average 4-6). torch.set_num_threads cannot help (it changes the
# setting for threads started later too), and numpy, single-threaded, reached 14 GB/s against
# 22 GB/s for torch ops on pieces under 32768 elements (8 MiB, cache-warm). So on the host the
# same torch ops run on pieces of 16384 elements (on the calling thread); on a GPU in one piece.
_SERIAL_ELEMENTS = 16384  # under GRAIN_SIZE (32768): torch runs the op on the calling thread


def _sums_torch(data: torch.Tensor, first_block: int, num_full: int) -> tuple[int, int]:
    """(sum of block sums, index-weighted sum) of ``data``'s blocks, with torch ops on its device."""
    parts: list[torch.Tensor] = []
    if num_full:
        words = _as_words(data[: num_full * BLOCK_BYTES]).view(num_full, _WORDS)
        on_host = data.device.type == "cpu"
        rows = _SERIAL_ELEMENTS // _WORDS if on_host else num_full
        sums = torch.empty(num_full, dtype=torch.int64, device=data.device)
        for a in range(0, num_full, rows):
            torch.sum(words[a : a + rows], dim=1, out=sums[a : a + rows])  # int64, wraps mod 2**64
        step = _SERIAL_ELEMENTS if on_host else num_full
        for a in range(0, num_full, step):
            piece = sums[a : a + step]
            index = first_block + a
            weights = torch.arange(index + 1, index + piece.numel() + 1, dtype=torch.int64, device=data.device)
            parts += [piece.sum(), (piece * weights).sum()]
    tail = data.numel() - num_full * BLOCK_BYTES
    if tail:
        padded = torch.zeros(BLOCK_BYTES, dtype=torch.uint8, device=data.device)
        padded[:tail] = data[num_full * BLOCK_BYTES :]
        parts.append(padded.view(torch.int64).sum())
    values = torch.stack(parts).tolist()  # one synchronisation for the piece
    pairs = values[: len(values) - 1] if tail else values
    total, weighted = sum(pairs[0::2]), sum(pairs[1::2])
    if tail:
        last = values[-1]
        total += last
        weighted += (first_block + num_full + 1) * last
    return total & _MASK, weighted & _MASK


def _as_words(data: torch.Tensor) -> torch.Tensor:
    """``data`` (a multiple of 8 bytes) as int64 words; copied first if not 8-byte aligned."""
    if data.data_ptr() % 8:
        data = data.clone()  # rare: a caller's unaligned view; the digest depends on bytes only
    return data.view(torch.int64)


def digest_of(data: torch.Tensor) -> Digest:
    """The digest of all of ``data`` (1-D contiguous uint8) in one piece."""
    accumulator = Accumulator()
    accumulator.add(data, 0)
    return accumulator.digest()
