"""Small CPU stores of one unit made together (Note [Small transfers in batches] in
tba/cache/engine/batches.py): one store and one load per batch, each entry viewed in place in
the reloaded buffer whatever its dtype and size, and a batch's entry that backward wants, that
dies or whose storage is freed before the batch is stored leaves it, with nothing leaked."""

from __future__ import annotations

import threading
import warnings

import torch
from torch import nn

import tba
from tba.offloaders.host import HostOffloader
from tba.testing import probe
from tests import models
from tests.twin import assert_bytes_moved, run_twins

JOIN_S = 30.0


class CountingHost(HostOffloader):
    """The host pool, counting the stores made at once and the loads, by thread."""

    def __init__(self) -> None:
        super().__init__()
        self.stores_now: list[int] = []
        self.loads: list[tuple[str, int]] = []

    def store_now(self, storage):
        token = super().store_now(storage)
        if token is not None:
            self.stores_now.append(storage.nbytes())
        return token

    def load(self, token, dst):
        self.loads.append((threading.current_thread().name, dst.numel()))
        super().load(token, dst)


def _options(offloader, **extra):
    return dict(offloader=offloader, offload_devices=("cpu",), min_offload_bytes=0,
                keep_last_modules=0, adaptive=False, **extra)


def test_a_units_small_stores_share_one_store_and_one_load() -> None:
    offloader = CountingHost()
    cache = run_twins(lambda: models.Stack(num_blocks=3), models.vector_batch, steps=3,
                      settle=True, **_options(offloader))
    assert_bytes_moved(cache)
    stats = cache.stats(cumulative=True)
    main = threading.main_thread().name
    inline_loads = [n for thread, n in offloader.loads if thread == main]
    assert offloader.stores_now, "nothing was stored at once"
    # Several entries per store (each unit saves several small tensors) ...
    assert stats.num_offloaded > 2 * len(offloader.stores_now)
    # ... and each batch read back once, whole, by the thread that unpacks.
    assert sorted(inline_loads) == sorted(offloader.stores_now)


class MixedKinds(nn.Module):
    """One unit saving tensors of several dtypes and odd sizes: their bytes share one batch."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.sin(x.double() * 1.5)  # float64, 7 x 7
        b = torch.tanh(x.bfloat16())  # bfloat16 (tanh saves its result)
        mask = x[:, :3] > 0  # bool, 21 bytes
        c = torch.where(mask, x[:, :3], -x[:, :3])  # saves the mask
        z = torch.complex(x, x.flip(0))  # complex64
        d = (z * z.conj()).real  # saves z and its conjugate's view
        return (a.float() + b.float() + d).sum(0) * self.scale + c.sum()


class MixedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(7, 7)
        self.blocks = nn.ModuleList(MixedKinds() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        out = torch.zeros(7)
        for block in self.blocks:
            out = out + block(h)
        return out.pow(2).sum()


def test_entries_of_every_dtype_and_odd_size_come_back_from_their_batch() -> None:
    """Bit-exact with float64, bfloat16, bool and complex entries of odd sizes in one batch
    (each at an aligned offset, viewed in place in the reloaded buffer)."""
    offloader = CountingHost()
    cache = run_twins(MixedModel, lambda seed: models.vector_batch(seed, features=7, rows=7),
                      steps=3, settle=True, **_options(offloader))
    assert_bytes_moved(cache)
    assert offloader.stores_now and cache.stats(cumulative=True).num_offloaded > len(offloader.stores_now)


class Penalised(nn.Module):
    """A block whose forward differentiates part of itself (a gradient penalty): that inner
    backward unpacks tensors the block saved moments before, still in its pending batch."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        (grad,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return y + 0.1 * grad.pow(2)


def test_an_entry_wanted_while_its_batch_waits_stays_in_memory() -> None:
    offloader = CountingHost()
    checked: list[list[str]] = []

    def on_configure(cache: tba.TensorCache) -> None:
        cache.add_close_callback(lambda: checked.append(probe(cache).check_invariants()))

    cache = run_twins(lambda: models.Chain(Penalised, 2), models.vector_batch, steps=3, settle=True,
                      on_configure=on_configure, **_options(offloader))
    stats = cache.stats(cumulative=True)
    assert stats.num_cancelled > 0, "no store was cancelled: the test proves nothing"
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0
    assert checked == [[]]
    assert offloader.used_bytes == 0


class DropsASave(nn.Module):
    """Saves a tensor for a graph it throws away at once: that entry dies in its batch."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        torch.sin(h * 2)  # its graph (and the handle of h * 2) dies now
        return torch.tanh(h)


def test_an_entry_dying_while_its_batch_waits_leaves_it() -> None:
    offloader = CountingHost()
    model = nn.Sequential(nn.Linear(16, 32), DropsASave(32), DropsASave(32))
    with tba.configure_tensor_cache(model, **_options(offloader)) as cache:
        view = probe(cache)
        for step in range(3):
            loss = model(models.vector_batch(step)).pow(2).mean()
            cache.wait_for_stores(JOIN_S)
            loss.backward()
            assert view.num_entries == 0 and not view.check_invariants()
        stats = cache.stats(cumulative=True)
    assert stats.num_cancelled > 0 and stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0
    assert offloader.stores_now
    assert offloader.used_bytes == 0


def test_a_storage_freed_while_its_batch_waits_is_never_read() -> None:
    """Note [Storages freed behind tba's back]: a storage resized to zero while its entry waits
    in the batch is kept as it is (never read by the batch's store), with one warning."""
    offloader = CountingHost()

    class FreesInside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.free = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x) * 2
            out = torch.sin(h)  # saves h
            if self.free:
                h.untyped_storage().resize_(0)  # a framework's forced release, inside the unit
            return torch.tanh(out)

    block = FreesInside()
    model = nn.Sequential(nn.Linear(16, 16), block)
    with tba.configure_tensor_cache(model, **_options(offloader)) as cache:
        for seed in range(2):  # the pool grows (sized by what settled steps held)
            loss = model(models.vector_batch(seed)).sum()
            cache.wait_for_stores(JOIN_S)  # stores complete: none cancelled by backward
            loss.backward()
            cache.wait_for_stores(JOIN_S)
        block.free = True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model(models.vector_batch(2))
            cache.wait_for_stores(JOIN_S)
            del out  # the graph dies without backward (h has no bytes left to differentiate)
        stats = cache.stats(cumulative=True)
        assert not probe(cache).check_invariants()
        assert offloader.stores_now, "the third step stored nothing at once"
    assert stats.num_resized == 1
    assert sum("resized or freed" in str(w.message) for w in caught) == 1
    assert offloader.used_bytes == 0
