"""Jagged nested tensors (``torch.nested``, ``layout=torch.jagged``) saved for backward
(issue 10, item 2).

An NJT is a wrapper subclass whose ragged dimension is identified by its offsets tensor
object: a rebuilt NJT with a new offsets tensor has a new ragged dimension, and NJT backward
rejects it. So the offsets (and lengths) must come back as the very same objects, while the
values may be offloaded and read back.

Nested tensors of either layout as the model's input (issue 30): the adaptive policy reads
their shape without a ragged dimension.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import tba

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


# ------------------------------------------------------- nested tensors as the model's input
class NestedInput(nn.Module):
    """Takes a batch of sequences of different lengths as a nested tensor (either layout),
    runs its first layer on it, pads it, and runs its blocks on the padded tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.relu(self.embed(x)).to_padded_tensor(0.0)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return h.pow(2).mean()


def ragged_batch(seed: int, layout: torch.layout = torch.strided, num_sequences: int = 4
                 ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 9, (num_sequences,), generator=g).tolist()  # new ones each batch
    return torch.nested.nested_tensor([torch.randn(n, 8, generator=g) for n in lengths],
                                      layout=layout)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_strided_nested_input_with_defaults_and_ssd(tmp_path) -> None:
    # Issue 30: the adaptive policy's input signature read `.shape`, which a strided nested
    # tensor does not have: the first forward raised. Default settings otherwise.
    cache = run_twins(NestedInput, ragged_batch, steps=4, settle=True, offloader="ssd",
                      ssd_dirs=(str(tmp_path),), offload_devices=("cpu",), min_offload_bytes=0)
    assert cache.stats(cumulative=True).num_steps == 4
    assert_bytes_moved(cache)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_ragged_input_profiles_once(layout: torch.layout, caplog: pytest.LogCaptureFixture
                                    ) -> None:
    # Note [Ragged inputs] in tba/cache/steps/steps.py: new lengths in every batch are the
    # same input; another number of sequences is a new one.
    model = NestedInput()
    batches = [ragged_batch(seed, layout) for seed in range(5)]
    batches.append(ragged_batch(5, layout, num_sequences=3))
    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                    min_offload_bytes=0, max_step_overhead=None) as cache:
        with caplog.at_level(logging.INFO, logger="tba.cache.steps.steps"):
            for batch in batches:
                loss = model(batch)
                cache.wait_for_stores(60)  # a profile needs completed stores (busy machine)
                loss.backward()
        assert cache.adaptive_decision is not None, cache.summary()
    # (The write bandwidth of these tiny steps may drift and re-profile too: not counted.)
    reasons = [r.getMessage() for r in caplog.records if "input shapes changed" in r.getMessage()]
    assert len(reasons) == 1, reasons
    assert "(4, None, 8)" in reasons[0] and "(3, None, 8)" in reasons[0], reasons
