"""Jagged nested tensors (``torch.nested``, ``layout=torch.jagged``) saved for backward
(issue 10, item 2).

An NJT is a wrapper subclass whose ragged dimension is identified by its offsets tensor
object: a rebuilt NJT with a new offsets tensor has a new ragged dimension, and NJT backward
rejects it. So the offsets (and lengths) must come back as the very same objects, while the
values may be offloaded and read back.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.twin import assert_bytes_moved, run_twins

LENGTHS = (3, 5, 2, 7)


class OffsetsProbe(torch.autograd.Function):
    """Identity that saves its jagged input and records, in backward, whether the saved
    tensor came back with the very offsets object it was saved with."""

    checks: list[bool] = []

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.offsets = x.offsets()
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        OffsetsProbe.checks.append(x.offsets() is ctx.offsets)
        return grad


class Jagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks[0](x))
        h = OffsetsProbe.apply(h)
        h = torch.nn.functional.gelu(self.blocks[1](h)) * h
        h = self.blocks[2](h).sin()
        return h.values().pow(2).mean()


def jagged_batch(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, 8, generator=g) for n in LENGTHS]
    return torch.nested.nested_tensor(parts, layout=torch.jagged)


def test_model_trains_without_tba() -> None:
    # The reference itself works (so a failure below is tba's).
    OffsetsProbe.checks = []
    Jagged()(jagged_batch(0)).backward()
    assert OffsetsProbe.checks == [True]


@pytest.mark.parametrize("offloader", ["none", "host"])
def test_jagged_bit_exact_and_offsets_kept(offloader: str) -> None:
    OffsetsProbe.checks = []
    cache = run_twins(Jagged, jagged_batch, steps=3, settle=offloader != "none",
                      offloader=offloader, offload_devices=("cpu",), min_offload_bytes=0,
                      keep_last_modules=0, adaptive=False)
    # One probe per backward, reference and tba runs alike: the offsets object always came back.
    assert OffsetsProbe.checks == [True] * 6, OffsetsProbe.checks
    total = cache.stats(cumulative=True)
    assert total.num_steps == 3 and total.num_packed > 0
    if offloader == "host":
        assert_bytes_moved(cache)  # the values really went out and came back
