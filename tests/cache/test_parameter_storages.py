"""The parameter and buffer storages the pack hook leaves to autograd are those of the model as
it is at each forward, though the model is walked only when it changed (Note [Parameter
storages, checked not rebuilt] in tba/cache/capture/parameters.py): every way a parameter,
buffer or submodule changes is seen, and a model that does not change is not walked again."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable

import pytest
import torch
from torch import nn

import tba
from tba.cache.capture.parameters import ParameterStorages
from tba.testing import probe


class Net(nn.Module):
    """Two linears and a buffer that autograd saves (``x * scale`` saves ``scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.second(torch.tanh(self.first(x))) * self.scale).sum()


def _walked(model: nn.Module) -> frozenset[int]:
    """The storages as a full walk finds them (what the pack hook must leave alone)."""
    return frozenset(
        t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())
    )


def _regrow(storage: torch.UntypedStorage) -> None:
    """Free a storage and give it bytes again (FSDP's reshard and unshard), keeping others alive
    meanwhile so that the allocator cannot hand back the same address."""
    nbytes = storage.nbytes()
    storage.resize_(0)
    blocker = torch.empty(nbytes, dtype=torch.uint8)
    storage.resize_(nbytes)
    del blocker


_kept: list[nn.Module] = []


def _replace_keeping_the_old(model: Net) -> None:
    """The old submodule stays alive (an optimizer or a list elsewhere holds it)."""
    _kept.append(model.second)
    model.second = nn.Linear(8, 8)


def _swap(model: Net) -> None:
    torch.utils.swap_tensors(model.first.weight, nn.Parameter(torch.randn(8, 8)))


MUTATIONS: dict[str, Callable[[Net], object]] = {
    "parameter assigned": lambda m: setattr(m.first, "weight", nn.Parameter(torch.randn(8, 8))),
    "parameter .data": lambda m: setattr(m.first.weight, "data", torch.randn(8, 8)),
    "buffer assigned": lambda m: setattr(m, "scale", torch.ones(8)),
    "buffer registered": lambda m: m.first.register_buffer("extra", torch.ones(3)),
    "to(float64)": lambda m: m.to(torch.float64),
    "load_state_dict(assign=True)": lambda m: m.load_state_dict(
        {k: v.clone() for k, v in m.state_dict().items()}, assign=True),
    "swap_tensors": _swap,
    "storage freed and regrown": lambda m: _regrow(m.second.weight.untyped_storage()),
    "submodule replaced": lambda m: setattr(m, "second", nn.Linear(8, 8)),
    "submodule replaced, the old one kept": _replace_keeping_the_old,
    "submodule added": lambda m: m.first.add_module("inner", nn.Linear(2, 2)),
    "submodule deleted": lambda m: delattr(m, "second"),
    "parameter deleted": lambda m: delattr(m.first, "bias"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_each_change_is_seen(mutation: str) -> None:
    model = Net()
    storages = ParameterStorages()
    assert storages.current(model) == _walked(model)
    before = storages.current(model)
    MUTATIONS[mutation](model)
    gc.collect()
    assert storages.current(model) == _walked(model), mutation
    assert storages.current(model) != before or mutation == "submodule added", (
        "the mutation changed no storage: the test proves nothing")


def test_an_unchanged_model_is_not_walked_again() -> None:
    model = Net()
    storages = ParameterStorages()
    storages.current(model)
    walks = storages.num_rebuilds
    model.load_state_dict({k: v + 1 for k, v in model.state_dict().items()})  # copies in place
    for _ in range(3):
        assert storages.current(model) == _walked(model)
    assert storages.num_rebuilds == walks


def test_another_model_is_walked() -> None:
    first, second = Net(), Net()
    storages = ParameterStorages()
    assert storages.current(first) == _walked(first)
    assert storages.current(second) == _walked(second)


def test_functional_call_stand_ins_are_the_parameters_of_that_call() -> None:
    """``torch.func.functional_call`` puts its tensors in the module's dicts for one call: the
    pack hook must treat them as the parameters then (and the model's own ones after)."""
    model = Net()
    storages = ParameterStorages()
    seen: list[tuple[frozenset[int], frozenset[int]]] = []
    hook = model.register_forward_pre_hook(
        lambda module, args: seen.append((storages.current(module), _walked(module))))
    stand_ins = {k: v.detach().clone() for k, v in model.named_parameters()}
    torch.func.functional_call(model, stand_ins, (torch.randn(8),))
    model(torch.randn(8))
    hook.remove()
    (inside, walked_inside), (after, walked_after) = seen
    assert inside == walked_inside and after == walked_after
    assert {t.untyped_storage().data_ptr() for t in stand_ins.values()} <= inside


def test_a_replaced_buffer_is_left_to_autograd_by_the_cache() -> None:
    """End to end: after ``to(float64)`` (new buffer and parameter storages) and a buffer
    assigned, the buffer autograd saves is still not taken by tba, while activations are."""
    model = Net()
    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                    min_offload_bytes=0, keep_last_modules=0,
                                    adaptive=False) as cache:
        for change in (lambda: None, lambda: model.to(torch.float64),
                       lambda: setattr(model, "scale", torch.full((8,), 2.0, dtype=torch.float64))):
            change()
            with probe(cache).watch_saves() as saves:
                model(torch.randn(8, dtype=model.scale.dtype)).backward()
            buffer = [s for s in saves if s.storage_ptr == model.scale.untyped_storage().data_ptr()]
            assert buffer and not any(s.managed for s in buffer), saves
            assert any(s.managed for s in saves), "tba took no activation"
