"""Checksums of offloaded bytes, computed where the bytes are: torch ops on a GPU, numpy on the host.

Note [Checksum choice]: the digest of a byte range is built from its 512-byte blocks (the sector
size). Each block is read as 64 little-endian int64 words and summed (``R_i``, modulo 2**64);
the digest is ``(num_bytes, sum R_i, sum (i + 1) * R_i)``, modulo 2**64. A short last block is
zero-padded. Why this and not a CRC or xxHash:

- It runs where the bytes are. Under GPUDirect Storage a reload lands in GPU memory and never
  passes through host memory, so a host checksum would need an extra device-to-host copy; two
  reductions on the tensor's own device cost nothing next to the drive (GPU memory moves TB/s).
  The CPU tests run this code too (and the host's numpy version, Note [Checksum threads]).
- It is fast on the host too. Measured on the 2-core development machine (256 MiB, median of 5,
  torch 2.13.0 CPU): these sums 24 GB/s on 2 threads (12 GB/s on one), xxh3_64 (python-xxhash
  4.1.0) 13 GB/s, crc32c 2.9 13 GB/s, zlib.crc32 2.2 GB/s. So no dependency is needed.
- It is exact integer arithmetic: the same bytes give the same digest on any device, in any
  order of summation, split into any pieces (``Digest`` parts combine: see ``Accumulator``).
  That lets the posix engine checksum chunk k while chunk k+1 is still on its way to or from
  the drive, so verification hides behind the I/O. The sums are linear in the bytes (modulo
  2**64), so a block cut in two by a piece boundary is the sum of its two parts, each summed
  as a block zero-padded around it: pieces may start and end anywhere (the posix engine cuts
  at page boundaries of the file, which are not block boundaries of the range).

What it detects: any change confined to one 8-byte word (every single-bit flip), random or
zeroed data (missed with probability about 2**-64 per block sum), truncation, a short or lost
write, blocks moved, swapped or shifted (the block index weights the second sum), data of
another tensor. What it misses: words permuted inside one 512-byte block, and changes that
cancel within one block (+d in one word, -d in another). It is not a defence against someone
who can write the files on purpose: the sums are linear and easy to forge (docs/ssd.md).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from tba.offloaders._byte_views import bytes_view
from tba.settings import CHECKSUM_BLOCK_BYTES

__all__ = ["BLOCK_BYTES", "Digest", "Accumulator", "digest_of", "piece_sums"]

BLOCK_BYTES = CHECKSUM_BLOCK_BYTES
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
    Pieces must not overlap and may start and end anywhere. Not thread-safe: one caller adds.
    """

    def __init__(self) -> None:
        self._total = 0
        self._weighted = 0
        self._num_bytes = 0

    def add(self, data: torch.Tensor, start: int) -> None:
        """Add the bytes ``data`` (1-D contiguous uint8, any device) found at ``start``."""
        self.add_sums(data.numel(), piece_sums(data, start))

    def add_sums(self, num_bytes: int, sums: tuple[int, int]) -> None:
        """Add a piece of ``num_bytes`` whose :func:`piece_sums` are ``sums``."""
        self._total = (self._total + sums[0]) & _MASK
        self._weighted = (self._weighted + sums[1]) & _MASK
        self._num_bytes += num_bytes

    def digest(self) -> Digest:
        return Digest(self._num_bytes, self._total, self._weighted)


def piece_sums(data: torch.Tensor, start: int) -> tuple[int, int]:
    """The (total, weighted) contribution of the bytes ``data`` (1-D contiguous uint8, any
    device) found at byte ``start`` of a range; pieces' contributions add up modulo 2**64."""
    n = data.numel()
    offset = start % BLOCK_BYTES
    if n == 0 or not offset:
        return _sums(data, start // BLOCK_BYTES)
    # A partial first block: its bytes in place in a zeroed block (Note [Checksum choice]).
    lead = min(n, BLOCK_BYTES - offset)
    padded = torch.zeros(BLOCK_BYTES, dtype=torch.uint8, device=data.device)
    padded[offset : offset + lead] = data[:lead]
    total, weighted = _sums(padded, start // BLOCK_BYTES)
    rest_total, rest_weighted = _sums(data[lead:], start // BLOCK_BYTES + 1)
    return (total + rest_total) & _MASK, (weighted + rest_weighted) & _MASK


def _sums(data: torch.Tensor, first_block: int) -> tuple[int, int]:
    """The sums of ``data`` starting at block ``first_block`` (a short last block zero-padded)."""
    if data.numel() == 0:
        return 0, 0
    num_full = data.numel() // BLOCK_BYTES
    if data.device.type == "cpu":
        return _sums_host(data, first_block, num_full)
    return _sums_torch(data, first_block, num_full)


# Note [Checksum threads]: torch runs a CPU op on its OpenMP pool once it has GRAIN_SIZE (32768)
# elements or more, and the pool's threads spin while idle. Next to the engine's I/O threads and
# the training thread on a busy 2-core machine that made verification cost +140% (once +1150%)
# of the posix engine's write+read time, where one thread cost about -6..+21% at the same load
# (io_bandwidth.py, 256 MiB, load average 4-6). torch.set_num_threads cannot help (it changes the
# setting for threads started later too), and torch ops on pieces under GRAIN_SIZE pay a call
# per piece: 0.069 CPU-s per GB for the block sums of 8 MiB, where numpy's ``add.reduceat``
# (single-threaded by construction, on the calling thread) takes 0.037 in one pass (2-core
# Xeon, torch 2.13.0, numpy 2.4.6, time.thread_time over an 8 MiB cache-warm buffer). So on the
# host the block sums are numpy's (the same int64 arithmetic, wrapping modulo 2**64); on a GPU
# they are torch ops on the tensor's device.
_starts_lock = threading.Lock()
_starts = np.arange(0, _WORDS * 16384, _WORDS, dtype=np.int64)  # first word of each block


def _block_starts(num_blocks: int) -> np.ndarray:
    global _starts
    starts = _starts
    if len(starts) < num_blocks:
        with _starts_lock:
            if len(_starts) < num_blocks:
                _starts = np.arange(0, _WORDS * max(num_blocks, 2 * len(_starts)), _WORDS, dtype=np.int64)
            starts = _starts
    return starts[:num_blocks]


def _sums_host(data: torch.Tensor, first_block: int, num_full: int) -> tuple[int, int]:
    """:func:`_sums_torch` for host memory, with numpy on the calling thread."""
    total = weighted = 0
    if num_full:
        body = data[: num_full * BLOCK_BYTES]
        if body.data_ptr() % 8:
            body = body.clone()  # rare: a caller's unaligned view; the digest depends on bytes only
        words = bytes_view(body).view(np.int64)
        sums = np.add.reduceat(words, _block_starts(num_full))  # int64, wraps mod 2**64
        weights = np.arange(first_block + 1, first_block + num_full + 1, dtype=np.int64)
        total = int(sums.sum()) & _MASK
        weighted = int(np.dot(sums, weights)) & _MASK
    tail = data.numel() - num_full * BLOCK_BYTES
    if tail:
        padded = np.zeros(BLOCK_BYTES, dtype=np.uint8)
        padded[:tail] = bytes_view(data[num_full * BLOCK_BYTES :])
        last = int(padded.view(np.int64).sum()) & _MASK
        total = (total + last) & _MASK
        weighted = (weighted + (first_block + num_full + 1) * last) & _MASK
    return total, weighted


def _sums_torch(data: torch.Tensor, first_block: int, num_full: int) -> tuple[int, int]:
    """(sum of block sums, index-weighted sum) of ``data``'s blocks, with torch ops on its device."""
    parts: list[torch.Tensor] = []
    if num_full:
        words = _as_words(data[: num_full * BLOCK_BYTES]).view(num_full, _WORDS)
        sums = torch.sum(words, dim=1)  # int64, wraps mod 2**64
        weights = torch.arange(first_block + 1, first_block + num_full + 1, dtype=torch.int64, device=data.device)
        parts += [sums.sum(), (sums * weights).sum()]
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
