"""An in-place change of a saved tensor after its save raises at backward, as in plain PyTorch
(issue 10, item 7).

With saved-tensor hooks installed, autograd skips its own version check, so tba has to do it:
the saved tensor's version at pack time against its version at unpack. The error is PyTorch's
kind (``RuntimeError``, "modified by an inplace operation") and names the tensor's shape.
Writes through ``.data`` do not bump the saved tensor's counter: PyTorch does not raise for
them, and neither may tba.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tba

PHRASE = "modified by an inplace operation"
SHAPE = (7, 13)  # odd sizes, so "7, 13" in a message is this tensor's shape


class ChangesSaved(nn.Module):
    """``s`` is saved (by sigmoid and by the second linear), then changed in place."""

    def __init__(self, how: str = "inplace") -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(SHAPE[1], SHAPE[1]), nn.Linear(SHAPE[1], SHAPE[1])])
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(self.blocks[0](x))
        out = self.blocks[1](s)
        if self.how == "inplace":
            s.mul_(2)  # bumps s's version: backward must refuse the saved s
        elif self.how == "data":
            s.data.mul_(2)  # no version bump: PyTorch's backward silently sees the new bytes
        return out.pow(2).mean()


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(SHAPE[1], 32), nn.Linear(32, 5)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](torch.tanh(self.blocks[0](x))).pow(2).mean()


def batch() -> torch.Tensor:
    return torch.randn(*SHAPE, generator=torch.Generator().manual_seed(0))


def configure(model: nn.Module, offloader: str) -> tba.TensorCache:
    return tba.configure_tensor_cache(model, offloader=offloader, offload_devices=("cpu",),
                                      min_offload_bytes=0, keep_last_modules=0, adaptive=False)


def test_plain_pytorch_raises() -> None:
    # The behaviour tba must keep (so the tests below compare with something real).
    with pytest.raises(RuntimeError, match=PHRASE):
        ChangesSaved()(batch()).backward()


@pytest.mark.parametrize("offloader", ["none", "host"])
def test_inplace_change_after_save_raises_at_backward(offloader: str) -> None:
    model = ChangesSaved()
    with configure(model, offloader) as cache:
        loss = model(batch())
        cache.wait_for_stores(60)  # with "host", s has been written out: the check survives it
        with pytest.raises(RuntimeError, match=PHRASE) as info:
            loss.backward()
    message = str(info.value)
    assert f"{SHAPE[0]}, {SHAPE[1]}" in message, f"the error does not name the shape {SHAPE}: {message}"


@pytest.mark.parametrize("offloader", ["none", "host"])
def test_parameter_changed_between_forward_and_backward_raises(offloader: str) -> None:
    torch.manual_seed(0)
    model = Plain()
    reference = copy.deepcopy(model)
    ref_loss = reference(batch())
    with torch.no_grad():
        reference.blocks[1].weight.add_(1.0)  # what an optimizer step does
    with pytest.raises(RuntimeError, match=PHRASE):
        ref_loss.backward()

    with configure(model, offloader) as cache:
        loss = model(batch())
        cache.wait_for_stores(60)
        with torch.no_grad():
            model.blocks[1].weight.add_(1.0)
        with pytest.raises(RuntimeError, match=PHRASE):
            loss.backward()


def test_write_through_data_does_not_raise_and_matches_pytorch() -> None:
    # Without offloading the saved storage is the live one, so tba sees what PyTorch sees.
    torch.manual_seed(0)
    model = ChangesSaved(how="data")
    reference = copy.deepcopy(model)
    reference(batch()).backward()
    with configure(model, "none"):
        model(batch()).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), f"grad of {name} differs"


@pytest.mark.parametrize("offloader", ["none", "host"])
def test_unchanged_saves_do_not_raise(offloader: str) -> None:
    # The check compares versions, nothing else: an ordinary model trains.
    torch.manual_seed(0)
    model = Plain()
    reference = copy.deepcopy(model)
    with configure(model, offloader) as cache:
        for _ in range(3):
            loss = model(batch())
            cache.wait_for_stores(60)
            loss.backward()
            reference(batch()).backward()
        total = cache.stats(cumulative=True)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    if offloader == "host":
        assert total.offloaded_bytes > 0 and total.reloaded_bytes > 0, total
