"""No parameter of any module is ever offloaded, trainable or frozen, of the configured model
or passed in from outside it (Note [Parameters are never offloaded] in
tba/cache/capture/saving.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tba
from tba.testing import probe
from tests import models
from tests.twin import assert_bytes_moved, run_twins

_CPU = dict(offload_devices=("cpu",), min_offload_bytes=0, adaptive=False)


class LoRALinear(nn.Module):
    """A frozen base weight plus a trainable low-rank adapter."""

    def __init__(self, width: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.down = nn.Parameter(torch.randn(rank, width) * 0.1)
        self.up = nn.Parameter(torch.zeros(width, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.down), self.up)


class LoRAStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.embed.requires_grad_(False)
        self.blocks = nn.ModuleList(LoRALinear(32) for _ in range(4))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h).pow(2).mean()


class Inner(nn.Module):
    """The configured module: it is handed a frozen weight of the module around it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))

    def forward(
        self, x: torch.Tensor, shared: torch.Tensor, trainable: torch.Tensor
    ) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(F.linear(block(x), shared)) * trainable
        return x


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Parameter(torch.randn(32, 32) * 0.1, requires_grad=False)
        self.trainable = nn.Parameter(torch.ones(32))
        self.embed = nn.Linear(16, 32)
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.embed(x), self.shared, self.trainable).pow(2).mean()


def _parameter_storages(model: nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def _watch(saves: list):
    def configure(cache: tba.TensorCache) -> None:
        context = probe(cache).watch_saves()
        saves.append(context.__enter__())
        cache.add_close_callback(lambda: context.__exit__(None, None, None))

    return configure


def _check_no_parameter_offloaded(saves: list, storages: set[int]) -> None:
    seen = [s for s in saves[0] if s.storage_ptr in storages]
    assert seen, "no save of a parameter's storage reached tba: the test proves nothing"
    assert not [s for s in seen if s.managed], seen


def test_frozen_base_weights_with_trainable_adapters() -> None:
    saves: list = []
    storages: set[int] = set()

    def configure(cache: tba.TensorCache) -> None:
        assert cache.model is not None
        storages.update(_parameter_storages(cache.model))
        _watch(saves)(cache)

    cache = run_twins(LoRAStack, models.vector_batch, steps=2, settle=True,
                      on_configure=configure, **_CPU)
    assert_bytes_moved(cache)
    _check_no_parameter_offloaded(saves, storages)


@pytest.mark.timing
@pytest.mark.parametrize("outer_hooks", [False, True], ids=["plain", "with-outer-hooks"])
def test_outer_modules_frozen_parameter_passed_in(outer_hooks: bool) -> None:
    """``F.linear(x, outer.shared)`` saves ``shared.t()``: a view of a frozen parameter of the
    module around the configured one (outside the configured module's parameter storages).
    With the script's own hooks (Note [Outer saved-tensor hooks]) it reaches tba as their
    pack's result, ``shared.t().detach()``: no longer a view, so tba must look at what the
    outer pack was given."""
    saves: list = []
    outer_storages: set[int] = set()
    caches: list[tba.TensorCache] = []
    seen_by_outer: list[int] = []

    def configure_inner(cache: tba.TensorCache) -> None:
        # run_twins configured the tba twin (an Outer): configure its inner module instead.
        model = cache.model
        assert model is not None
        cache.close()
        outer_storages.update(_parameter_storages(model) - _parameter_storages(model.inner))
        caches.append(tba.configure_tensor_cache(model.inner, **_CPU))
        _watch(saves)(caches[0])

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        seen_by_outer.append(base.untyped_storage().data_ptr())
        return tensor.detach()

    def around(net: nn.Module) -> contextlib.AbstractContextManager:
        if not outer_hooks:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    run_twins(Outer, models.vector_batch, steps=2, settle=True, on_configure=configure_inner,
              around=around, **_CPU)
    inner = caches[0]
    inner.close()
    assert_bytes_moved(inner)
    if outer_hooks:
        assert outer_storages & set(seen_by_outer), "the shared weight was never saved"
        assert not [s for s in saves[0] if s.storage_ptr in outer_storages and s.managed]
    else:
        _check_no_parameter_offloaded(saves, outer_storages)


def test_nothing_offloaded_warning_does_not_count_frozen_parameters() -> None:
    """Note [Loud when it does nothing]: the saves it counts on devices tba does not manage
    are activations; frozen parameters (and their views) are not among them."""
    model = LoRAStack()
    storages = _parameter_storages(model)
    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cuda",)) as cache:
        with probe(cache).watch_saves() as saves, pytest.warns(UserWarning) as warned:
            model(models.vector_batch(0)).backward()
    activations = [s for s in saves if s.storage_ptr not in storages]
    frozen = [s for s in saves if s.storage_ptr in storages]
    assert activations and frozen
    assert f"saved tensors on devices tba does not manage: {len(activations)} on cpu" in str(
        warned[0].message), warned[0].message
