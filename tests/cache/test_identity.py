"""Storage identity by version-counter family (issue 10, item 1).

Version counters belong to a view family, not to a storage: the outputs of ``unsafe_chunk`` /
``unsafe_split`` and tensors obtained through ``.data`` share one storage but each has its own
counter. Two of them can be saved at the same version number after the bytes changed; the
second save must not be served from the first one's (stale) copy. PyTorch's own CPU recurrent
kernels do exactly this (gates split with ``unsafe_chunk``, then changed in place).

Every test here trains >= 3 Adam steps against an untouched twin (``torch.equal`` on losses and
every grad), waits for the stores before each backward, and asserts bytes went out and came
back: stale bytes can only be served from a completed store.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from tba.testing import probe

from tests.twin import assert_bytes_moved, run_twins

# Every tensor offloaded, and a pack that creates an entry waits for the previous store to
# finish (max_inflight_bytes=1): the first family's bytes are written before the second
# family's in-place change, every run.
SMALL = dict(offload_devices=("cpu",), min_offload_bytes=0, keep_last_modules=0, adaptive=False,
             max_inflight_bytes=1)


def offloader_options(offloader: str, tmp_path: Path) -> dict:
    if offloader == "ssd":
        return dict(offloader="ssd", ssd_dirs=(str(tmp_path),), ssd_engine="posix")
    return dict(offloader=offloader)


OFFLOADERS = [pytest.param("host", id="host"), pytest.param("ssd", id="ssd")]


# ---------------------------------------------------------------- unsafe_chunk / unsafe_split
class UnsafeChunk(nn.Module):
    """The repro of the issue: r and z share one storage, each with its own version counter;
    both are saved at version 1, with z's bytes changed after r's save."""

    def __init__(self, split: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.split = split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.lin(x)
        r, z = gates.unsafe_split(4, dim=1) if self.split else gates.unsafe_chunk(2, dim=1)
        r = r.mul_(2)
        a = torch.sin(r)  # saves r at version 1
        e = torch.exp(self.lin(x))  # a new entry: waits until r's storage is written
        z = z.add_(1)
        b = torch.cos(z)  # saves z at version 1 (another family, same storage)
        return (a * b).sum() + e.sum()


class DataAlias(nn.Module):
    """The same through ``.data``: ``b`` is a slice of ``h.data`` (its own counter), changed
    after a slice of ``h`` itself was changed and saved; both saved at version 1."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        a = h[:, :4]
        b = h.data[:, 4:]
        a = a.mul_(2)
        s1 = torch.sin(a)  # saves a at version 1 (h's family)
        e = torch.exp(self.lin(x))  # a new entry: waits until h's storage is written
        b.add_(1)
        s2 = b * self.scale  # saves b at version 1 (the .data family) for scale's grad
        return (s1 * s2).sum() + e.sum()


def small_batch(seed: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))


FAMILY_MODELS = [
    pytest.param(UnsafeChunk, id="unsafe_chunk"),
    pytest.param(lambda: UnsafeChunk(split=True), id="unsafe_split"),
    pytest.param(DataAlias, id="data-alias"),
]


@pytest.mark.parametrize("make_model", FAMILY_MODELS)
@pytest.mark.parametrize("offloader", OFFLOADERS)
def test_families_on_one_storage_bit_exact(make_model, offloader: str, tmp_path: Path) -> None:
    cache = run_twins(make_model, small_batch, steps=3, settle=True,
                      **SMALL, **offloader_options(offloader, tmp_path))
    assert_bytes_moved(cache)


def test_saves_of_another_family_are_counted() -> None:
    cache = run_twins(UnsafeChunk, small_batch, steps=3, settle=True, **SMALL, offloader="host")
    total = assert_bytes_moved(cache)
    # z's save is of a storage already held under r's family: its own entry, counted; it is
    # the only such save of a forward (r's storage is saved by sin and cos, nothing else).
    assert total.num_family_entries > 0, total
    assert total.num_family_entries == total.num_steps == 3, total


class OneFamily(nn.Module):
    """Ordinary views (``chunk``) share the version counter of their base: one family."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.lin(x).chunk(3, dim=1)
        return (torch.sin(q) * torch.cos(k) * v).sum()


def test_views_of_one_family_share_an_entry() -> None:
    cache = run_twins(OneFamily, small_batch, steps=3, settle=True, **SMALL, offloader="host")
    total = assert_bytes_moved(cache)
    assert total.num_family_entries == 0, total
    assert total.num_deduplicated > 0, total  # q, k and v: written once


# ---------------------------------------------------------------- PyTorch's recurrent modules
class CellLoop(nn.Module):
    """A GRUCell or LSTMCell stepped over the sequence, then a head."""

    def __init__(self, kind: str, input_size: int, hidden: int) -> None:
        super().__init__()
        self.kind = kind
        self.cell = (nn.GRUCell if kind == "gru_cell" else nn.LSTMCell)(input_size, hidden)
        self.head = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (T, B, input_size)
        h = x.new_zeros(x.shape[1], self.cell.hidden_size)
        c = h
        for t in range(x.shape[0]):
            if self.kind == "gru_cell":
                h = self.cell(x[t], h)
            else:
                h, c = self.cell(x[t], (h, c))
        return self.head(h).pow(2).mean()


class Recurrent(nn.Module):
    """nn.GRU on a padded batch, or nn.LSTM fed a PackedSequence, then a head."""

    def __init__(self, kind: str, input_size: int, hidden: int) -> None:
        super().__init__()
        self.kind = kind
        self.rnn = (nn.GRU if kind == "gru" else nn.LSTM)(input_size, hidden)
        self.head = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (T, B, input_size)
        if self.kind == "gru":
            _, h = self.rnn(x)
        else:
            steps, batch = x.shape[0], x.shape[1]
            lengths = torch.tensor([steps - (i % 3) for i in range(batch)])
            _, (h, _) = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
        return self.head(h[-1]).pow(2).mean()


def make_recurrent(kind: str, input_size: int, hidden: int) -> nn.Module:
    if kind.endswith("_cell"):
        return CellLoop(kind, input_size, hidden)
    return Recurrent(kind, input_size, hidden)


def sequence_batch(steps: int, batch: int, input_size: int):
    def make(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(steps, batch, input_size, generator=g)

    return make


RECURRENT = [pytest.param(kind, id=kind) for kind in ("gru", "gru_cell", "lstm_cell", "lstm_packed")]


class StoreAtEachPack:
    """Makes every pack of ``cache`` wait until its store has completed, so a storage is
    written right when it is first saved, before the kernel changes another family's part of
    it (inside one GRU cell there is no second new entry for max_inflight_bytes=1 to wait on).
    ``num_calls`` proves it ran."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.num_calls = 0
        self._watch = probe(cache).watch_saves(on_save=self)
        self._watch.__enter__()  # for the cache's whole life

    def __call__(self, save) -> None:
        self.num_calls += 1
        self.cache.wait_for_stores(60)


@pytest.mark.parametrize("kind", RECURRENT)
@pytest.mark.parametrize("offloader", OFFLOADERS)
def test_recurrent_small_bit_exact(kind: str, offloader: str, tmp_path: Path) -> None:
    wrappers = []
    cache = run_twins(lambda: make_recurrent(kind, 8, 16), sequence_batch(5, 4, 8), steps=3,
                      settle=True, on_configure=lambda c: wrappers.append(StoreAtEachPack(c)),
                      **SMALL, **offloader_options(offloader, tmp_path))
    assert_bytes_moved(cache)
    assert wrappers[0].num_calls > 0, "no save was watched"


@pytest.mark.slow
@pytest.mark.parametrize("kind", RECURRENT)
@pytest.mark.parametrize("offloader", OFFLOADERS)
def test_recurrent_default_options_bit_exact(kind: str, offloader: str, tmp_path: Path) -> None:
    # Default options (min_offload_bytes=1 MiB, adaptive, kept tail, 1 GiB in flight); batch 256
    # and hidden 512 make every gate storage 1.5 MiB (GRU) or 2 MiB (LSTM): offloaded.
    hidden, batch = 512, 256
    assert batch * 3 * hidden * 4 > 1 << 20
    cache = run_twins(lambda: make_recurrent(kind, 32, hidden), sequence_batch(4, batch, 32),
                      steps=4, settle=True, offload_devices=("cpu",),
                      **offloader_options(offloader, tmp_path))
    assert_bytes_moved(cache)
