"""The script's own saved-tensor hooks around a configured forward (Note [Outer saved-tensor
hooks] in tba/cache/capture/hook_stack.py), ``skip_modules`` stepping aside (Note [Stepping
aside]) and ``register_hooks`` on a raw saved tensor (Note [register_hooks on a saved tensor]
in tba/_torch_compat.py)."""

from __future__ import annotations

import collections
import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import tba
from tba import _torch_compat as compat
from tba.testing import probe
from tests import models
from tests.twin import assert_bytes_moved, run_twins

_CPU = dict(offload_devices=("cpu",), min_offload_bytes=0, adaptive=False)


def _label(net: nn.Module) -> str:
    return "tba" if tba.get_tensor_cache(net) is not None else "reference"


class Bf16Copies:
    """Activation compression: keeps a bf16 copy of every saved floating tensor."""

    def __init__(self) -> None:
        self.num_packs: collections.Counter[str] = collections.Counter()
        self.num_unpacks: collections.Counter[str] = collections.Counter()
        self.label = ""

    def __call__(self, net: nn.Module) -> contextlib.AbstractContextManager:
        self.label = _label(net)
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> tuple:
        self.num_packs[self.label] += 1
        data = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        return data, tensor.dtype

    def unpack(self, packed: tuple) -> torch.Tensor:
        self.num_unpacks[self.label] += 1
        data, dtype = packed
        return data.to(dtype)


class Tracker:
    """A memory tracker: logs the shape and dtype of every save, keeps the tensor itself."""

    def __init__(self) -> None:
        self.log: dict[str, list] = collections.defaultdict(list)
        self.label = ""

    def __call__(self, net: nn.Module) -> contextlib.AbstractContextManager:
        self.label = _label(net)
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.log[self.label].append(("pack", tuple(tensor.shape), tensor.dtype))
        return tensor.detach()

    def unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.log[self.label].append(("unpack", tuple(tensor.shape), tensor.dtype))
        return tensor


def test_bf16_copies_reach_the_outer_hooks_and_are_offloaded() -> None:
    """The issue's example: without the chain tba shadowed the script's hooks (fewer packs,
    other gradients). Every save reaches them as without tba; tba offloads their bf16 copies."""
    hooks = Bf16Copies()
    cache = run_twins(lambda: models.Stack(num_blocks=4), models.vector_batch, steps=3,
                      settle=True, around=hooks, **_CPU)
    assert hooks.num_packs["tba"] == hooks.num_packs["reference"] > 0, hooks.num_packs
    assert hooks.num_unpacks["tba"] == hooks.num_unpacks["reference"] > 0, hooks.num_unpacks
    total = assert_bytes_moved(cache)
    # What went out are the bf16 copies: half the bytes of the float32 activations.
    full = run_twins(lambda: models.Stack(num_blocks=4), models.vector_batch, steps=3,
                     settle=True, **_CPU).stats(cumulative=True)
    assert total.offloaded_bytes < full.offloaded_bytes


@pytest.mark.parametrize("skip", [(), ("blocks.1",)], ids=["all", "skip-block-1"])
def test_tracking_hook_sees_every_save_as_without_tba(skip: tuple) -> None:
    tracker = Tracker()
    cache = run_twins(lambda: models.Stack(num_blocks=4), models.vector_batch, steps=2,
                      settle=True, around=tracker, skip_modules=skip, **_CPU)
    assert tracker.log["tba"] == tracker.log["reference"]
    assert any(kind == "pack" for kind, _, _ in tracker.log["tba"])
    assert_bytes_moved(cache)


@pytest.mark.parametrize("offloader", ["host", "ssd"])
def test_save_on_cpu_as_the_outer_pair(offloader: str, tmp_path) -> None:
    num_packs: collections.Counter[str] = collections.Counter()

    def around(net: nn.Module) -> contextlib.AbstractContextManager:
        context = torch.autograd.graph.save_on_cpu()
        pack, label = context.pack_hook, _label(net)

        def counting_pack(tensor: torch.Tensor) -> tuple:
            num_packs[label] += 1
            return pack(tensor)

        context.pack_hook = counting_pack
        return context

    extra = dict(ssd_dirs=(str(tmp_path),), ssd_engine="posix") if offloader == "ssd" else {}
    cache = run_twins(lambda: models.Stack(num_blocks=4), models.vector_batch, steps=2,
                      settle=True, around=around, offloader=offloader, **extra, **_CPU)
    assert num_packs["tba"] == num_packs["reference"] > 0, num_packs
    assert_bytes_moved(cache)  # save_on_cpu's (device, tensor) items are managed


class MutatingBlock(nn.Module):
    """Modifies a tensor saved for backward in place: an error in plain PyTorch, allowed under
    ``allow_mutation_on_saved_tensors`` (which clones the original first).

    The block keeps the mutated tensor until its next forward. torch's context knows a saved
    tensor by (id, data_ptr, version) (``torch.autograd.graph._get_tid``): once the mutated
    tensor dies, a later tensor that gets its id and its memory at version 0 is taken for it,
    and backward reads the clone of the wrong tensor. Plain PyTorch without tba got a wrong
    gradient of this model in 1 of 2000 steps that way, and run_twins then failed in whichever
    twin it hit (1 of about 12 full loaded runs; 6 of 200 twin runs with a probe that moved the
    allocations). Kept alive, nothing can take its place within the step."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.mutated: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y = h * h  # saves h
        h.mul_(0.5)
        self.mutated = h
        return y + h


def _mutating() -> nn.Module:
    return models.Chain(MutatingBlock, 3)


def test_allow_mutation_on_saved_tensors_works() -> None:
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _mutating()(models.vector_batch(0)).backward()  # the mutation is an error in plain PyTorch
    with pytest.warns(UserWarning, match="went to the script's own saved-tensor hooks"):
        # Its pack returns handles, not tensors: nothing for tba to offload, and tba says so.
        run_twins(_mutating, models.vector_batch, steps=2, settle=True, offloader="host",
                  around=lambda net: torch.autograd.graph.allow_mutation_on_saved_tensors(),
                  **_CPU)


def test_pair_entered_per_forward() -> None:
    """Without hooks of the script's own, the forward enters tba's plain pair (nothing
    chained: no cost per save); with them, a chained pair whose outer half is the script's."""
    model = models.Stack(num_blocks=2)
    seen = []
    model.blocks[0].register_forward_hook(
        lambda *args: seen.append(compat.top_saved_tensors_hooks()))
    tracker = Tracker()
    with tba.configure_tensor_cache(model, **_CPU) as cache:
        _, unpack = probe(cache).saved_tensor_hooks
        model(models.vector_batch(0)).backward()
        with tracker(model):
            model(models.vector_batch(1)).backward()
        model(models.vector_batch(2)).backward()
    plain, chained, again = seen
    assert plain[1] == unpack and again[1] == unpack  # tba's own unpack: no chain
    assert chained[0].__self__.outer_pack == tracker.pack
    assert chained[1].__self__.outer_unpack == tracker.unpack


def test_nested_caches_chain_to_the_scripts_pair() -> None:
    """A configured model run inside another configured model: the inner cache takes over its
    saves (as before) and the script's pair still sees every save."""

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = nn.Linear(16, 16)
            self.inner = models.Stack(num_blocks=3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(torch.tanh(self.pre(x)))

    tracker = Tracker()

    def configure(cache: tba.TensorCache) -> None:
        model = cache.model
        assert model is not None
        inner_caches.append(tba.configure_tensor_cache(model.inner, **_CPU))

    inner_caches: list[tba.TensorCache] = []
    try:
        run_twins(Outer, models.vector_batch, steps=2, settle=True, around=tracker,
                  on_configure=configure, **_CPU)
    finally:
        for inner in inner_caches:
            inner.close()
    assert tracker.log["tba"] == tracker.log["reference"]
    assert inner_caches[0].stats(cumulative=True).num_packed > 0


# ---------------------------------------------------------------------------- register_hooks
class RawHooks(nn.Module):
    """Sets a hook pair on one saved tensor of its own, as PyTorch's docs show."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.num_calls = collections.Counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x).exp()
        y.grad_fn._raw_saved_result.register_hooks(self._pack, self._unpack)
        return y

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.num_calls["pack"] += 1
        return tensor.detach() * 2

    def _unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.num_calls["unpack"] += 1
        return tensor / 2


class WithRawHooks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16), RawHooks(), nn.Linear(16, 16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.pow(2).mean()


def test_register_hooks_inside_a_configured_forward_names_tba_and_the_fix() -> None:
    model = WithRawHooks()
    with tba.configure_tensor_cache(model, **_CPU):
        with pytest.raises(tba.TBAError) as info:
            model(models.vector_batch(0))
    message = str(info.value)
    for expected in ("tba", "one pack/unpack pair per saved tensor", "skip_modules=(RawHooks,)",
                     "unit 'blocks.1'"):
        assert expected in message, message
    assert "already been set" in str(info.value.__cause__)


def test_register_hooks_works_in_a_skipped_module() -> None:
    cache = run_twins(WithRawHooks, models.vector_batch, steps=2, settle=True,
                      skip_modules=(RawHooks,), **_CPU)
    assert_bytes_moved(cache)


def test_register_hooks_error_of_the_scripts_own_pair_stays_pytorchs() -> None:
    """Without tba the same call fails too (the script's pair packed the tensor): PyTorch's
    error, unchanged."""
    model = WithRawHooks()
    tracker = Tracker()
    with tba.configure_tensor_cache(model, **_CPU):
        with tracker(model), pytest.raises(RuntimeError) as info:
            model(models.vector_batch(0))
    assert not isinstance(info.value, tba.TBAError)
    assert "already been set" in str(info.value)


_LIFETIME = """
import gc, torch, tba
from tests import models

def wrapped():
    return getattr(torch._C._autograd.SavedTensor.register_hooks, "_tba_wrapper", False)

options = dict(offload_devices=("cpu",), min_offload_bytes=0)
states = [wrapped()]  # after import
first = tba.configure_tensor_cache(models.Stack(), **options)
second = tba.configure_tensor_cache(models.Stack(), **options)
states.append(wrapped())
first.close()
states.append(wrapped())
second.close()
states.append(wrapped())
model = models.Stack()
tba.configure_tensor_cache(model, **options)  # handle dropped: the model owns the cache
states.append(wrapped())
del model
gc.collect()
states.append(wrapped())
print(states)
"""


def test_register_hooks_wrapper_lives_with_the_caches() -> None:
    """Not at import; installed by the first cache, removed by the last (closed or collected
    with its model). In a process of its own: no other test's cache is alive there."""
    out = subprocess.run([sys.executable, "-c", _LIFETIME], capture_output=True, text=True,
                         check=True, cwd=str(Path(__file__).parents[2]))
    assert out.stdout.strip().splitlines()[-1] == str([False, True, True, False, True, False])


def test_interrupt_inside_a_skipped_module_leaves_the_scripts_pair() -> None:
    """Note [Stepping aside]: a KeyboardInterrupt skips the skipped module's post hook (and the
    model's); the forward closed later must not take the script's pair off the stack."""
    model = models.Stack(num_blocks=3)
    tracker = Tracker()

    def interrupt(x: torch.Tensor) -> torch.Tensor:
        raise KeyboardInterrupt

    with tba.configure_tensor_cache(model, skip_modules=("blocks.1",), **_CPU):
        with tracker(model):
            model.blocks[1].forward = interrupt
            with pytest.raises(KeyboardInterrupt):
                model(models.vector_batch(0))
            del model.blocks[1].forward
            model(models.vector_batch(1)).backward()  # closes the interrupted forward
            assert compat.top_saved_tensors_hooks() == (tracker.pack, tracker.unpack)
        assert compat.top_saved_tensors_hooks() is None
