"""bf16 autocast (CPU): training under ``torch.autocast`` is bit-identical with offloading, and
bf16 activations really go out and come back."""

from __future__ import annotations

import torch

from tba.integrations import registry
from tests import models
from tests.twin import run_twins

OPTIONS = dict(offload_devices="cpu", min_offload_bytes=0, adaptive=False)


def _autocast_forward(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(batch)
    cache = registry.lookup(model)
    if cache is not None:
        cache.wait_for_stores(timeout_s=30)  # backward then really reloads
    return loss.float()


def test_bf16_autocast_bit_exact() -> None:
    dtypes: set[torch.dtype] = set()

    def forward(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: dtypes.add(t.dtype) or t, lambda t: t):
            return _autocast_forward(model, batch)

    cache = run_twins(models.Stack, models.vector_batch, steps=3, forward=forward, **OPTIONS)
    total = cache.stats(cumulative=True)
    assert total.num_steps == 3
    assert total.offloaded_bytes > 0 and total.reloaded_bytes > 0, total
    assert torch.bfloat16 in dtypes  # autocast really ran in bf16 (seen in the reference run)
