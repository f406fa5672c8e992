"""The accelerate recipe of docs/integrations.md, as written there: ``prepare`` first, then
``configure_tensor_cache(accelerator.unwrap_model(model), ...)``. Bit-identical to the same
loop without tba over 3 Adam steps, with bytes really offloaded and reloaded."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import tba
from tests import models

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason="accelerate is not installed (pip install 'tba[hf]')",
)

NUM_STEPS = 3


def _train(with_tba: bool) -> tuple[torch.nn.Module, list, list]:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    set_seed(0)
    accelerator = Accelerator(cpu=True)
    model = models.gpt2()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    cache = None
    if with_tba:
        cache = tba.configure_tensor_cache(
            accelerator.unwrap_model(model), offload_devices="cpu", min_offload_bytes=0,
            adaptive=False,
        )
    losses, stats = [], []
    try:
        for step in range(NUM_STEPS):
            loss = model(**models.lm_batch(step)).loss
            if cache is not None:
                cache.wait_for_stores(timeout_s=60)  # backward then really reloads
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
            if cache is not None:
                stats.append(cache.stats())
    finally:
        if cache is not None:
            cache.close()
    return accelerator.unwrap_model(model), losses, stats


def test_accelerate_recipe_is_bit_exact():
    reference, ref_losses, _ = _train(with_tba=False)
    model, losses, stats = _train(with_tba=True)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses, strict=True))
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a, b), f"parameter {name} differs after {NUM_STEPS} steps"
    for s in stats:
        assert s.offloaded_bytes > 0 and s.reloaded_bytes > 0, s
