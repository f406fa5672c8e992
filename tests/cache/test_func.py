"""``torch.func`` transforms over a configured model (issue 10, item 4).

Per-sample gradients, ``vmap(grad(functional_call(model, ...)))``, hand tba functorch-wrapped
tensors in its pack hook (they have no storage of their own): they must pass through untouched,
and the results equal those of the unconfigured model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import tba
from tests import models


def per_sample_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss_of_one(params: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, params, (xi.unsqueeze(0),))
        return F.mse_loss(out, yi.unsqueeze(0))

    return vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, x, y)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            [torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks[:-1]:
            x = torch.tanh(block(x))
        return self.blocks[-1](x)


@pytest.mark.parametrize("offloader", ["none", "host"])
def test_per_sample_grads_equal_without_tba(offloader: str) -> None:
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)
    expected = per_sample_grads(reference, x, y)
    with tba.configure_tensor_cache(model, offloader=offloader, offload_devices=("cpu",),
                                    min_offload_bytes=0, keep_last_modules=0,
                                    adaptive=False) as cache:
        for _ in range(2):  # and again, after the cache has seen a transformed forward
            got = per_sample_grads(model, x, y)
            assert got.keys() == expected.keys()
            for name in expected:
                assert got[name].shape == (6, *dict(model.named_parameters())[name].shape)
                assert torch.equal(got[name], expected[name]), f"per-sample grad of {name} differs"
        # Ordinary training through the same cache still offloads and stays exact.
        loss = model(models.vector_batch(0)).pow(2).mean()
        cache.wait_for_stores(60)
        loss.backward()
        stats = cache.stats()
    ref_loss = reference(models.vector_batch(0)).pow(2).mean()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), f"grad of {name} differs"
    assert stats.num_packed > 0
    if offloader == "host":
        assert stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0, stats


def test_transformed_forward_is_logged_once_at_info(caplog: pytest.LogCaptureFixture) -> None:
    model = Net()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                    min_offload_bytes=0):
        with caplog.at_level("INFO", logger="tba"):
            per_sample_grads(model, x, y)
            first = [r for r in caplog.records if r.name.startswith("tba") and r.levelname == "INFO"]
            per_sample_grads(model, x, y)
            second = [r for r in caplog.records if r.name.startswith("tba") and r.levelname == "INFO"]
    assert first, "passing functorch tensors through untouched is not logged at INFO"
    assert second == first, [r.getMessage() for r in second[len(first):]]
