"""Every kind of tensor autograd can save is managed correctly or passed through unmanaged
(Note [What tba manages] in tba/cache/capture/saving.py): each case below saves one kind inside a
configured block, and training with tba equals training without it, bit for bit, with each
offloader."""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

import tba
from tba.testing import probe
from tests import models
from tests.twin import assert_bytes_moved, run_twins

WIDTH = 8

pytestmark = pytest.mark.filterwarnings(
    "ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning",
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning",  # TwoTensor's import
)


class SaveOne(torch.autograd.Function):
    """``h.sin()``, saving ``make(h)`` beside ``h`` (and checking it comes back equal)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, make: Callable) -> torch.Tensor:
        extra = make(h.detach())
        ctx.save_for_backward(h, extra)
        ctx.expected = _fingerprint(extra)
        return h.sin()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        h, extra = ctx.saved_tensors
        assert _fingerprint(extra) == ctx.expected
        return grad * h.cos(), None


def _fingerprint(t: torch.Tensor) -> tuple:
    if t._is_zerotensor():
        return ("zero", tuple(t.shape), t.dtype)
    if t.is_quantized:
        t = t.dequantize()
    elif t.is_sparse:
        t = t.to_dense()
    elif t.is_nested:
        t = torch.cat([u.flatten() for u in t.unbind()]) if t.numel() else t.values()
    elif type(t) is not torch.Tensor and hasattr(t, "a"):
        t = t.a
    return (type(t).__name__, tuple(t.shape), t.dtype, t.device.type,
            t.tolist() if t.device.type != "meta" and t.numel() < 256 else None)


def _two_tensor(h: torch.Tensor) -> torch.Tensor:
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(h.clone(), h * 2)


class Tagged(torch.Tensor):
    """A plain Python subclass (``__torch_function__`` only)."""


def _quantized(h: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize_per_tensor is deprecated
        return torch.quantize_per_tensor(h, 0.05, 0, torch.qint8)


_SPARSE = (torch.arange(WIDTH * WIDTH).reshape(WIDTH, WIDTH) % 3 == 0).float().to_sparse()

# What each case saves (besides plain tensors), and how.
CASES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "plain": lambda h: h.sin() * h,
    "zero-tensor": lambda h: SaveOne.apply(h, lambda d: torch._efficientzerotensor(d.shape)),
    "strided-nested": lambda h: torch.cat(
        (lambda nt: list((nt * nt).unbind()))(torch.nested.as_nested_tensor([h[:3], h[3:]]))),
    "strided-nested-saved": lambda h: SaveOne.apply(
        h, lambda d: torch.nested.nested_tensor([d[:3].clone(), d[3:].clone()])),
    "jagged-nested": lambda h: torch.cat([h[:0], (lambda nt: (nt * nt).values())(
        torch.nested.as_nested_tensor([h[:3], h[3:]], layout=torch.jagged))]),
    "python-subclass": lambda h: h.as_subclass(Tagged).sin().as_subclass(torch.Tensor) * h,
    "wrapper-subclass": lambda h: SaveOne.apply(h, _two_tensor),
    "sparse": lambda h: torch.sparse.mm(_SPARSE, h) + h.sin(),
    "quantized": lambda h: SaveOne.apply(h, _quantized),
    "conjugate-view": lambda h: (lambda z: (z * z.conj()).real)(torch.complex(h, h.flip(0))),
    "negative-view": lambda h: h * torch._neg_view(h),
    "zero-dim": lambda h: h * h.sum(),
    "empty": lambda h: SaveOne.apply(h, lambda d: d[:0]),
    "bfloat16": lambda h: h.to(torch.bfloat16).sin().float() * h,
    "bool": lambda h: h * (h > 0),
    "offset-view": lambda h: torch.cat([h[:2], h[2:].sin() * h[2:]]),
    "meta": lambda h: SaveOne.apply(h, lambda d: torch.empty(d.shape, device="meta")),
}


class KindBlock(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return CASES[self.kind](self.lin(x))


class KindModel(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.embed = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH), KindBlock(kind),
                                     nn.Linear(WIDTH, WIDTH)])
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h).pow(2).mean()


def _options(offloader: str, tmp_path) -> dict:
    out = dict(offloader=offloader, offload_devices=("cpu",), min_offload_bytes=0,
               adaptive=False, keep_last_modules=1)
    if offloader == "ssd":
        out.update(ssd_dirs=(str(tmp_path),), ssd_engine="posix")
    return out


OFFLOADERS = ["none", "host", "ssd"]


def _check(cache: tba.TensorCache, offloader: str) -> None:
    if offloader != "none":
        assert_bytes_moved(cache)


@pytest.mark.parametrize("offloader", OFFLOADERS)
@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_kind_bit_exact(kind: str, offloader: str, tmp_path) -> None:
    types: collections.Counter[tuple[str, bool]] = collections.Counter()

    def watch(cache: tba.TensorCache) -> None:
        # Which tensors reached tba in the kind's block, and whether tba took them.
        def on_save(view) -> None:
            if view.units == ("blocks.1",):
                types[(view.tensor_type, view.managed)] += 1

        watching = probe(cache).watch_saves(on_save)
        watching.__enter__()
        cache.add_close_callback(lambda: watching.__exit__(None, None, None))

    cache = run_twins(lambda: KindModel(kind), models.vector_batch, steps=2, settle=True,
                      on_configure=watch, **_options(offloader, tmp_path))
    _check(cache, offloader)
    assert types, "the kind's block saved nothing through tba"
    if kind == "jagged-nested" and offloader != "none":
        assert types[("NestedTensor", True)], types  # its values are offloaded


def _dual_forward(tangents: dict) -> Callable:
    """Forward of the twins under forward AD: a dual input; the loss's tangent is kept."""

    def forward(net: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        tangent = torch.ones_like(batch)
        loss = net(fwAD.make_dual(batch, tangent))
        primal, loss_tangent = fwAD.unpack_dual(loss)
        tangents[_label(net)].append(loss_tangent)
        return primal

    return forward


def _label(net: nn.Module) -> str:
    return "tba" if tba.get_tensor_cache(net) is not None else "reference"


@pytest.mark.parametrize("offloader", OFFLOADERS)
def test_forward_ad_dual_tensors(offloader: str, tmp_path) -> None:
    """Forward-mode AD in the forward (efficient zero tangents are saved), then backward."""
    tangents: dict[str, list] = collections.defaultdict(list)
    cache = run_twins(lambda: models.Stack(num_blocks=3), models.vector_batch, steps=2,
                      settle=True, forward=_dual_forward(tangents),
                      around=lambda net: fwAD.dual_level(), **_options(offloader, tmp_path))
    _check(cache, offloader)
    assert len(tangents["tba"]) == 2
    for a, b in zip(tangents["reference"], tangents["tba"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("offloader", OFFLOADERS)
def test_forward_over_reverse(offloader: str, tmp_path) -> None:
    """A Hessian-vector product: the reverse pass over the configured forward's saves runs
    under forward AD, so tba's unpacked tensors carry their tangents again."""
    hvps: dict[str, list] = collections.defaultdict(list)

    def forward(net: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        x = batch.clone().requires_grad_(True)
        dual = fwAD.make_dual(x, torch.ones_like(x))
        loss = net(dual)
        (grad,) = torch.autograd.grad(loss, dual, create_graph=True)
        hvps[_label(net)].append(fwAD.unpack_dual(grad).tangent)
        return fwAD.unpack_dual(loss).primal

    cache = run_twins(lambda: models.Stack(num_blocks=3), models.vector_batch, steps=2,
                      settle=True, forward=forward, around=lambda net: fwAD.dual_level(),
                      **_options(offloader, tmp_path))
    if offloader != "none":
        assert cache.stats(cumulative=True).offloaded_bytes > 0
    assert len(hvps["tba"]) == 2 and all(h is not None for h in hvps["tba"])
    for a, b in zip(hvps["reference"], hvps["tba"]):
        assert torch.equal(a, b)


def test_model_on_meta_device() -> None:
    """A meta model (shapes only) trains through a cache that manages meta tensors: their
    storages have no bytes, so they stay with autograd."""
    with torch.device("meta"):
        model = models.Stack(num_blocks=3)
    with tba.configure_tensor_cache(model, offload_devices=("meta",), min_offload_bytes=0,
                                    adaptive=False) as cache:
        with probe(cache).watch_saves() as saves, pytest.warns(UserWarning) as warned:
            model(torch.empty(8, 16, device="meta")).backward()
    assert saves and not any(s.managed for s in saves)
    assert "are of kinds tba leaves to autograd" in str(warned[0].message)
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.parameters())
