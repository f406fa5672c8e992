"""Note [Reload buffers at the source's page offset] and Note [Direct windows] through the
cache: saved views at nonzero storage offsets of storages just below, at and above a page (and
multiples +-1), several views of one storage, dtypes of 1, 2 and 8 bytes, every store completed
before backward so every tensor goes to disk and back; bit-exact over 3 Adam steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.twin import assert_bytes_moved, run_twins


class _Views(nn.Module):
    def __init__(self, num_bytes: int) -> None:
        super().__init__()
        self.num_bytes = num_bytes
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).flatten()
        n = self.num_bytes
        k8 = max(n // 8, 3)  # float64: two overlapping views of one storage, offsets 1 and 0
        big = h.double().repeat(k8 // h.numel() + 1)[:k8].clone()
        total = (big[1:] * big[: k8 - 1]).sum()
        c = big[k8 // 2 :]
        total = total + (c * c.flip(0)).sum()
        k2 = max(n // 2, 3)  # float16 view at offset 1
        d = h.half().repeat(k2 // h.numel() + 1)[:k2].clone()[1:]
        total = total + (d * d).float().sum()
        k1 = max(n, 3)  # a bool mask of n bytes, saved by where through a view at offset 1
        src = h.repeat(k1 // h.numel() + 1)[:k1]
        mask = (src > 0).clone()[1:]
        return total + torch.where(mask, src[1:] * 2, src[1:] * 3).sum()


def _batch(seed: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("num_bytes", [1, 4095, 4096, 4097, 8191, 8193, 12289])
def test_views_at_storage_offsets_round_trip_through_the_ssd_bit_exact(tmp_path: Path, num_bytes: int) -> None:
    cache = run_twins(
        lambda: _Views(num_bytes), _batch, steps=3, settle=True, offloader="ssd", ssd_engine="posix",
        ssd_dirs=(str(tmp_path),), offload_devices=("cpu",), min_offload_bytes=0, adaptive=False,
        keep_last_modules=0, prefetch_modules=0,
    )
    total = assert_bytes_moved(cache)
    assert total.reloaded_bytes == total.offloaded_bytes  # every stored tensor came back from disk
    assert total.num_deduplicated > 0  # several views of one storage shared an entry
    assert total.num_io_errors == 0
