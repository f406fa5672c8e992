"""The ROK sweep's activation measure (Note [One measure of activation memory] in tba/rok/_saved.py)
counts what it says on a tiny GPT-2: keep's peak is every byte autograd saved, an offloading
strategy's is what stayed in memory, recompute's holds the block inputs and one recomputed block."""

from __future__ import annotations

import contextlib
import gc
import itertools

import pytest
import torch

pytest.importorskip("transformers")

import tba  # noqa: E402
from tba.rok import _saved  # noqa: E402
from tba.rok import _worker as _rok_worker  # noqa: E402
from tests.benchmarks.rok_spec import spec  # noqa: E402

MODEL = dict(layers=2, hidden=32, heads=2, seq_len=16, vocab=16)
BATCH = 2


def _model_and_ids() -> tuple[torch.nn.Module, torch.Tensor]:
    """The worker's model and input at ``spec()``'s shape (same seeds as the worker)."""
    model = _rok_worker.build_model(MODEL, "cpu", "float32")
    g = torch.Generator().manual_seed(1234)
    return model, torch.randint(0, MODEL["vocab"], (BATCH, MODEL["seq_len"]), generator=g)


def _saved_storages(model: torch.nn.Module, ids: torch.Tensor, kept_from: torch.nn.Module | None = None,
                    only_in: torch.nn.Module | None = None) -> dict[int, tuple[int, bool]]:
    """Every distinct storage autograd saves in one forward, parameters and buffers aside:
    data pointer -> (bytes, saved at least once from ``kept_from`` on in forward order).
    ``only_in``: only what is saved inside that module."""
    excluded = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    found: dict[int, tuple[int, bool]] = {}
    state = {"kept": False, "inside": only_in is None}

    def pack(x: torch.Tensor) -> torch.Tensor:
        base = x._base
        if not (x.requires_grad and x.is_leaf) and not (base is not None and base.requires_grad and base.is_leaf):
            storage = x.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in excluded and state["inside"]:
                found[ptr] = (storage.nbytes(), found.get(ptr, (0, False))[1] or state["kept"])
        return x

    handles = []
    if kept_from is not None:
        handles.append(kept_from.register_forward_pre_hook(lambda *_: state.update(kept=True)))
    if only_in is not None:
        handles.append(only_in.register_forward_pre_hook(lambda *_: state.update(inside=True)))
        handles.append(only_in.register_forward_hook(lambda *_: state.update(inside=False)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()  # every saved storage was alive together at the end of forward
    finally:
        for h in handles:
            h.remove()
    return found


@pytest.mark.parametrize("warmup_steps", [0, 1])  # counted on a step of its own, or on the warm-up step
def test_keep_counts_every_byte_autograd_saved(warmup_steps: int, monkeypatch: pytest.MonkeyPatch) -> None:
    model, ids = _model_and_ids()
    saved = sum(n for n, _ in _saved_storages(model, ids).values())
    freezes = []
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(1))
    row = _rok_worker.run_point(spec(strategy="keep", warmup_steps=warmup_steps))
    # Only a worker process freezes its imports: frozen garbage of this process (a cache of an
    # earlier test, with its SIGINT handler) would never be collected.
    assert not freezes, "run_point froze the objects of the process that called it"
    assert row["status"] == "ok", row
    assert row["activation_peak_source"] == "meter" and "cache_peak_resident_bytes" not in row
    assert row["activation_peak_bytes"] == saved > 0
    assert row["meter_saved_bytes"] == saved and row["meter_recomputed_bytes"] == row["meter_reloaded_bytes"] == 0
    # The same count as tba's cache keeping everything (offloader "none"), which the offloading
    # strategies report: one accounting for every strategy.
    model, ids = _model_and_ids()
    with tba.configure_tensor_cache(model, offloader="none", offload_devices=("cpu",)) as cache:
        model(input_ids=ids, labels=ids).loss.backward()
        assert cache.stats().peak_resident_bytes == saved


def test_offload_counts_what_stayed_resident() -> None:
    # Every storage is small: the host pool stores it on the training thread at its save
    # (Note [Small transfers inline] in tba/cache/engine/workers.py) once the pool has grown (the
    # warm-up steps), so what stays resident is exactly what the last block and the head
    # (keep_last_modules=1) save; an offloaded storage counts only for the moment of its save.
    model, ids = _model_and_ids()
    storages = _saved_storages(model, ids, kept_from=model.transformer.h[-1])
    kept = sum(n for n, k in storages.values() if k)
    largest_offloaded = max(n for n, k in storages.values() if not k)
    assert 0 < kept < sum(n for n, _ in storages.values())
    row = _rok_worker.run_point(spec(strategy="offload-host", warmup_steps=3, steps=2))
    assert row["status"] == "ok", row
    assert row["activation_peak_source"] == "cache" and row["cache_offloaded_bytes"] > 0
    assert row["activation_peak_bytes"] == row["cache_peak_resident_bytes"] == max(kept, largest_offloaded)
    assert row["cache_kept_bytes"] == kept


def test_recompute_counts_block_inputs_and_one_recomputed_block() -> None:
    model, ids = _model_and_ids()
    everything = sum(n for n, _ in _saved_storages(model, ids).values())
    last = model.transformer.h[-1]
    inputs: set[int] = set()  # the last block's tensor arguments: checkpoint keeps them from forward

    def note_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        inputs.update(t.untyped_storage().data_ptr() for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))

    handle = last.register_forward_pre_hook(note_inputs, with_kwargs=True)
    try:
        in_last = _saved_storages(model, ids, only_in=last)
    finally:
        handle.remove()
    row = _rok_worker.run_point(spec(strategy="recompute"))
    assert row["status"] == "ok", row
    peak = row["activation_peak_bytes"]
    assert row["meter_saved_bytes"] + row["meter_recomputed_bytes"] + row["meter_reloaded_bytes"] == peak
    # The peak is in backward, while the last block's recomputed tensors are alive together;
    # its inputs were counted when checkpoint saved them in forward.
    recomputed = sum(n for ptr, (n, _) in in_last.items() if ptr not in inputs)
    assert row["meter_recomputed_bytes"] == recomputed > 0
    assert row["meter_saved_bytes"] > 0 and peak < everything


@pytest.mark.timing
def test_meter_above_the_cache_changes_nothing_it_measures() -> None:
    # The meter pushes its hooks above tba's (as in recompute+offload): every tensor still
    # reaches tba and comes back bit-exact, and the meter counts each saved storage once.
    from tests import models

    def run(meter: bool) -> tuple[list[torch.Tensor], tba.CacheStats, int]:
        torch.manual_seed(0)
        model = models.Stack(num_blocks=4, width=64)
        counter = _saved.SavedActivationMeter(model, "cpu")
        with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",), min_offload_bytes=0,
                                        adaptive=False) as cache:
            for step in range(3):
                with counter.measuring() if meter else contextlib.nullcontext():
                    loss = model(models.vector_batch(step))
                    cache.wait_for_stores()  # backward then reads every offloaded tensor back
                    loss.backward()
            return [p.grad.clone() for p in model.parameters()], cache.stats(), counter.num_storages

    with_meter, stats, counted = run(True)
    without, _, _ = run(False)
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0 and counted > 0
    assert all(torch.equal(a, b) for a, b in zip(with_meter, without))


def test_meter_counts_neither_parameters_nor_buffers() -> None:
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)  # saves its input and a view (the transpose) of its weight
            self.register_buffer("scale", torch.full((8,), 2.0))  # saved by the product

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.lin(x) * self.scale).sin().sum()

    model, x = Scaled(), torch.randn(4, 8)
    meter = _saved.SavedActivationMeter(model, "cpu")
    with meter.measuring():
        model(x).backward()
    assert meter.peak_bytes == 2 * 4 * 8 * 4 and meter.num_storages == 2  # x, and the product sin saves
    with tba.configure_tensor_cache(model, offloader="none", offload_devices=("cpu",)) as cache:
        model(x).backward()
        assert cache.stats().peak_resident_bytes == meter.peak_bytes
