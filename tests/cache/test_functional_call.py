"""``torch.func.functional_call``: training with parameters passed in (as ``torch.func`` and
meta-learning code do) is bit-identical with offloading, and bytes really go out and back."""

from __future__ import annotations

import copy

import torch

import tba
from tests import models

NUM_STEPS = 3


def test_functional_call_bit_exact() -> None:
    torch.manual_seed(0)
    reference = models.Stack(num_blocks=3)
    model = copy.deepcopy(reference)
    runs = {}
    cache = tba.configure_tensor_cache(
        model, offload_devices="cpu", min_offload_bytes=0, adaptive=False
    )
    try:
        for label, net in (("reference", reference), ("tba", model)):
            params = {k: v.detach().clone().requires_grad_() for k, v in net.named_parameters()}
            optimizer = torch.optim.Adam(params.values(), lr=1e-3)
            losses, grads = [], []
            for step in range(NUM_STEPS):
                torch.manual_seed(step)  # dropout masks
                optimizer.zero_grad()
                loss = torch.func.functional_call(net, params, (models.vector_batch(step),))
                if net is model:
                    cache.wait_for_stores(timeout_s=30)  # backward then really reloads
                loss.backward()
                losses.append(loss.detach())
                grads.append({k: p.grad.clone() for k, p in params.items()})
                optimizer.step()
            runs[label] = losses, grads
        stats = cache.stats(cumulative=True)
    finally:
        cache.close()
    (ref_losses, ref_grads), (losses, grads) = runs["reference"], runs["tba"]
    for step in range(NUM_STEPS):
        assert torch.equal(ref_losses[step], losses[step]), f"step {step}: loss differs"
        for name, g in ref_grads[step].items():
            assert torch.equal(g, grads[step][name]), f"step {step}: grad of {name} differs"
    assert stats.num_steps == NUM_STEPS
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0, stats
