"""Train a model with tba and an identical twin without it, and compare bit for bit."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import tba


def loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    return output.loss if hasattr(output, "loss") else output[0]


def forward_loss(model: Callable[..., Any], batch: Any) -> torch.Tensor:
    """The loss of ``model`` on ``batch`` (a dict is passed as keyword arguments)."""
    return loss_of(model(**batch) if isinstance(batch, dict) else model(batch))


def run_twins(
    make_model: Callable[[], nn.Module],
    make_batch: Callable[[int], Any],
    *,
    steps: int = 3,
    microbatches: int = 1,
    forward: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    settle: bool = False,
    settle_timeout_s: float = 60.0,
    on_configure: Callable[[tba.TensorCache], None] | None = None,
    around: Callable[[nn.Module], contextlib.AbstractContextManager] | None = None,
    **options: Any,
) -> tba.TensorCache:
    """Train ``steps`` Adam steps twice from one initial state: once with tba (``options``),
    once without. Asserts every loss and every parameter gradient are equal (``torch.equal``)
    at every step, and returns the (closed) cache for further checks.

    With ``settle``, every forward of the tba model is followed by
    ``wait_for_stores(settle_timeout_s)`` of every cache configured on it or on a module inside
    it (``on_configure`` may configure an inner module instead) before its backward: every store
    has completed, so backward reads offloaded tensors back instead of cancelling their stores
    (pair it with :func:`assert_bytes_moved`). ``on_configure`` is called with the new cache before the first
    forward. ``around(model)``, if given, makes a context manager that each microbatch's forward
    and backward of ``model`` (either twin) run inside (the script's own saved-tensor hooks).

    RNG is reseeded identically before each microbatch of both runs, so dropout masks match
    only if tba consumes no random numbers.
    """
    forward = forward or forward_loss
    torch.manual_seed(0)
    reference = make_model()
    model = copy.deepcopy(reference)
    reference.train()
    model.train()
    opt_ref = torch.optim.Adam(reference.parameters(), lr=1e-3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    cache = tba.configure_tensor_cache(model, **options)
    if on_configure is not None:
        on_configure(cache)
    try:
        for step in range(steps):
            for net, optimizer, label in ((reference, opt_ref, "reference"), (model, opt, "tba")):
                optimizer.zero_grad(set_to_none=True)
                losses = []
                for micro in range(microbatches):
                    torch.manual_seed(1000 * step + micro)
                    with around(net) if around is not None else contextlib.nullcontext():
                        loss = forward(net, make_batch(1000 * step + micro))
                        if settle and label == "tba":
                            settle_stores(net, settle_timeout_s)
                        loss.backward()
                    losses.append(loss.detach())
                if label == "reference":
                    ref_losses = losses
                    ref_grads = [p.grad for p in net.parameters()]
                else:
                    for a, b in zip(ref_losses, losses):
                        assert torch.equal(a, b), f"step {step}: loss {b.item()} != {a.item()}"
                    names = [n for n, _ in net.named_parameters()]
                    for name, g_ref, p in zip(names, ref_grads, net.parameters()):
                        assert (g_ref is None) == (p.grad is None), f"step {step}: grad of {name}"
                        if g_ref is not None:
                            assert torch.equal(g_ref, p.grad), f"step {step}: grad of {name} differs"
                optimizer.step()
    finally:
        cache.close()
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)
    return cache


def settle_stores(model: nn.Module, timeout_s: float = 60.0) -> None:
    """Complete the stores of every cache configured on ``model`` or on a module inside it
    (``wait_for_stores``): a backward that follows reads every offloaded tensor back, whatever
    the machine's load. Fails when no cache is configured there: a settle that waits on
    nothing would leave the stores racing backward."""
    caches = {id(c): c for c in map(tba.get_tensor_cache, model.modules()) if c is not None}
    assert caches, "settle: no tba cache is configured on the model or inside it"
    for cache in caches.values():
        cache.wait_for_stores(timeout_s)


def assert_bytes_moved(cache: tba.TensorCache) -> tba.CacheStats:
    """Assert that ``cache`` really wrote bytes to its offloader and read bytes back (over all
    steps): a bit-exact comparison proves nothing about offloading otherwise. Returns the
    cumulative stats."""
    total = cache.stats(cumulative=True)
    assert total.offloaded_bytes > 0, f"nothing was offloaded, the test proves nothing: {total}"
    assert total.reloaded_bytes > 0, f"nothing was read back, the test proves nothing: {total}"
    return total
