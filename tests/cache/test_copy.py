"""Copies of a configured model: ``copy.deepcopy`` (EMA, teacher, reference models) and
``torch.save`` / ``torch.load`` (issue 10, item 5).

Both must work; the copy behaves exactly like an unconfigured model (tba's hooks on it are inert, its
forward never reaches the original's cache, it trains like a plain model), and the original keeps
its cache and still offloads.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import tba
from tba.integrations import registry
from tests import models

OPTIONS = dict(offloader="host", offload_devices=("cpu",), min_offload_bytes=0,
               keep_last_modules=0, adaptive=False)


def hook_counts(model: nn.Module) -> list[int]:
    """Hooks that can act, per module. A copy keeps the hook slots of the original (torch
    copies the hook dicts) but tba's hooks become
    ``tba.cache.capture.module_hook.inert_hook``, which does nothing: those are not counted."""
    from tba.cache.capture.module_hook import inert_hook

    return [
        sum(
            hook is not inert_hook
            for hooks in (m._forward_pre_hooks, m._forward_hooks, m._backward_hooks,
                          m._backward_pre_hooks)
            for hook in hooks.values()
        )
        for m in model.modules()
    ]


def train_pair(model: nn.Module, reference: nn.Module, steps: int, *, first_seed: int,
               cache: tba.TensorCache | None = None) -> None:
    """``steps`` Adam steps of ``model`` and ``reference``, asserting equal losses and grads
    (``torch.equal``); with ``cache``, stores complete before each backward of ``model``."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.Adam(reference.parameters(), lr=1e-3)
    for step in range(first_seed, first_seed + steps):
        x = models.vector_batch(step)
        for net, optimizer in ((reference, opt_ref), (model, opt)):
            optimizer.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            loss = net(x)
            if net is model and cache is not None:
                cache.wait_for_stores(60)
            loss.backward()
            if net is reference:
                ref_loss = loss.detach()
        assert torch.equal(ref_loss, loss.detach()), f"step {step}: loss differs"
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: grad of {name} differs"
        opt.step()
        opt_ref.step()


def deepcopy_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def save_and_load(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("make_copy", [deepcopy_model, save_and_load], ids=["deepcopy", "torch.save"])
def test_copy_of_configured_model_is_a_plain_model(make_copy) -> None:
    torch.manual_seed(0)
    model = models.Stack(num_blocks=4)
    reference = copy.deepcopy(model)
    plain_hooks = hook_counts(reference)
    cache = tba.configure_tensor_cache(model, **OPTIONS)
    try:
        train_pair(model, reference, 2, first_seed=0, cache=cache)  # threads started, entries used

        duplicate = make_copy(model)
        twin = copy.deepcopy(reference)  # the copy's unconfigured counterpart, same state

        # No tba hook on the copy, nothing of tba in its state, not registered anywhere.
        assert hook_counts(duplicate) == plain_hooks
        assert duplicate.state_dict().keys() == reference.state_dict().keys()
        assert registry.lookup(duplicate) is None
        for p, q in zip(duplicate.parameters(), model.parameters()):
            assert torch.equal(p, q) and p.data_ptr() != q.data_ptr()

        # The copy's forward and backward never reach the original's cache ...
        before = cache.stats(cumulative=True)
        train_pair(duplicate, twin, 3, first_seed=10)
        after = cache.stats(cumulative=True)
        assert after.num_packed == before.num_packed, (before, after)
        assert after.num_steps == before.num_steps, (before, after)

        # ... and the original keeps its cache: it still offloads, reads back, stays exact.
        train_pair(model, reference, 3, first_seed=20, cache=cache)
        final = cache.stats(cumulative=True)
        assert final.num_steps == before.num_steps + 3
        assert final.offloaded_bytes > after.offloaded_bytes
        assert final.reloaded_bytes > after.reloaded_bytes
        assert registry.lookup(model) is cache
    finally:
        cache.close()
    assert hook_counts(model) == plain_hooks


def test_copy_of_a_copy_and_closing_the_original() -> None:
    # Closing the original leaves the copy working, and a copy of the copy is plain too.
    torch.manual_seed(0)
    model = models.Stack(num_blocks=3)
    reference = copy.deepcopy(model)
    cache = tba.configure_tensor_cache(model, **OPTIONS)
    model(models.vector_batch(0)).backward()
    duplicate = copy.deepcopy(model)
    cache.close()
    second = save_and_load(copy.deepcopy(duplicate))
    assert hook_counts(second) == hook_counts(reference)
    reference.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    for p, q in zip(second.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    train_pair(second, reference, 3, first_seed=5)
    # A copy can be configured on its own, like any model.
    with tba.configure_tensor_cache(duplicate, **OPTIONS) as own:
        duplicate(models.vector_batch(1)).backward()
        assert own.stats().num_packed > 0
