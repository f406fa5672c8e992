"""The block-sum checksum: a function of the bytes only (any split, any alignment, any device),
and changed by the corruptions it is meant to catch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tba.offloaders.ssd._checksum import BLOCK_BYTES, Accumulator, digest_of
from tests.offloaders.ssd_helpers import typed_tensor


def _data(size: int, seed: int = 0) -> torch.Tensor:
    return typed_tensor(size, torch.uint8, seed=seed)


@pytest.mark.parametrize("size", [1, 7, 512, 513, 4096 * 3 + 5])
def test_same_digest_for_any_split_and_alignment(size: int) -> None:
    data = _data(size)
    whole = digest_of(data)
    assert whole.num_bytes == size
    for piece in (BLOCK_BYTES, 2 * BLOCK_BYTES, 4096):
        acc = Accumulator()
        starts = list(range(0, size, piece))
        for start in reversed(starts):  # order does not matter
            acc.add(data[start : start + piece], start)
        assert acc.digest() == whole, (size, piece)
    unaligned = torch.empty(size + 3, dtype=torch.uint8)[3:]
    unaligned.copy_(data)
    assert digest_of(unaligned) == whole


@pytest.mark.parametrize("size", [1, 100, 4096 * 3 + 5, (1 << 20) + 33])
def test_pieces_may_start_and_end_anywhere(size: int) -> None:
    """The posix engine cuts ranges at page boundaries of the file, which are not block
    boundaries of the range: a block cut in two sums as its two zero-padded parts."""
    data = _data(size, seed=5)
    whole = digest_of(data)
    for cuts in ([100], [1, 2, 513], [4032, 4032 + 8192], [7, size // 2, size - 1]):
        bounds = [0] + [c for c in cuts if 0 < c < size] + [size]
        acc = Accumulator()
        for start, stop in zip(bounds, bounds[1:]):
            acc.add(data[start:stop], start)
        assert acc.digest() == whole, (size, cuts)


def test_every_single_bit_flip_changes_the_digest() -> None:
    data = _data(3 * BLOCK_BYTES + 100)
    original = digest_of(data)
    for position in range(0, data.numel(), 37):
        for bit in range(8):
            flipped = data.clone()
            flipped[position] ^= 1 << bit
            assert digest_of(flipped) != original, (position, bit)


def test_moved_blocks_and_shifts_change_the_digest() -> None:
    data = _data(8 * BLOCK_BYTES, seed=1)
    original = digest_of(data)
    blocks = data.view(8, BLOCK_BYTES)
    swapped = blocks[[1, 0, 2, 3, 4, 5, 6, 7]].reshape(-1)
    assert digest_of(swapped) != original
    shifted = torch.cat([torch.zeros(8, dtype=torch.uint8), data[:-8]])
    assert digest_of(shifted) != original
    assert digest_of(torch.zeros_like(data)) != original


@pytest.mark.gpu
def test_cuda_digest_equals_cpu_digest() -> None:
    data = _data(5 * (1 << 20) + 17, seed=2)
    assert digest_of(data.cuda()) == digest_of(data)
    acc = Accumulator()
    acc.add(data[: 1 << 20].cuda(), 0)
    acc.add(data[1 << 20 :], 1 << 20)  # pieces on different devices combine too
    assert acc.digest() == digest_of(data)


def _reference(data: torch.Tensor, first_block: int) -> tuple[int, int]:
    """The digest's definition, written out plainly in numpy (Note [Checksum choice])."""
    raw = data.numpy().tobytes()
    raw += bytes(-len(raw) % BLOCK_BYTES)
    blocks = np.frombuffer(raw, dtype="<u8").reshape(-1, BLOCK_BYTES // 8)
    sums = [int(b.sum(dtype=np.uint64)) for b in blocks]  # uint64 sums wrap modulo 2**64
    mask = (1 << 64) - 1
    return sum(sums) & mask, sum((first_block + i + 1) * r for i, r in enumerate(sums)) & mask


@pytest.mark.parametrize("size", [1, 511, 512, 4096 * 5 + 300, (1 << 20) + 17, (17 << 20) + 3])
@pytest.mark.parametrize("first_block", [0, 7, 2**40])
def test_matches_its_definition(size: int, first_block: int) -> None:
    """Both implementations: numpy's on the host, torch ops (what a GPU runs, here on the CPU);
    past the block-start table the host keeps (16384 blocks) too."""
    from tba.offloaders.ssd import _checksum

    data = _data(size, seed=size)
    expected = _reference(data, first_block)
    unaligned = torch.empty(size + 1, dtype=torch.uint8)[1:]
    unaligned.copy_(data)
    for sums in (_checksum._sums_torch, _checksum._sums_host):
        assert sums(data, first_block, size // BLOCK_BYTES) == expected, sums.__name__
        assert sums(unaligned, first_block, size // BLOCK_BYTES) == expected, sums.__name__
