"""Loud when it does nothing (Note [Loud when it does nothing]): steps and stats are true when
nothing is managed, one warning names why a step offloaded nothing, ``repr`` and ``summary()``
tell the truth, and ``str(cache.stats())`` is readable."""

from __future__ import annotations

import doctest
import itertools
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import tba
import tba.cache.observe.stats as stats_module
from tba.cache.observe.stats import format_bytes
from tba.testing import FakeStepClock, drive_closed_loop, probe
from tests import models
from tests.cache.fakes import FakeOffloader
from tests.twin import assert_bytes_moved, run_twins


class TbaWarnings:
    """The texts of the tba warnings recorded so far (live: read it at any point)."""

    def __init__(self, records: list[warnings.WarningMessage]) -> None:
        self._records = records

    def _texts(self) -> list[str]:
        return [str(w.message) for w in self._records if str(w.message).startswith("tba: ")]

    def __len__(self) -> int:
        return len(self._texts())

    def __getitem__(self, index: int) -> str:
        return self._texts()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._texts())

    def __eq__(self, other: object) -> bool:
        return self._texts() == other

    def __repr__(self) -> str:
        return repr(self._texts())


@contextmanager
def caught() -> Iterator[TbaWarnings]:
    """Every tba warning given inside the block."""
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        yield TbaWarnings(records)


def train(model: torch.nn.Module, steps: int, cache: tba.TensorCache | None = None) -> None:
    for i in range(steps):
        loss = model(models.vector_batch(i))
        if cache is not None:
            cache.wait_for_stores(60)
        loss.backward()


def saved_activations(model: torch.nn.Module) -> tuple[int, int]:
    """How many tensors ``model`` saves for backward that are not parameters (or views of
    one), and the bytes of the largest one's storage, measured with plain saved-tensor hooks
    (no tba)."""
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if not (base.requires_grad and base.is_leaf):
            sizes.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(models.vector_batch(0))
    return len(sizes), max(sizes)


# ---------------------------------------------------------------- steps when nothing is managed
def test_steps_are_counted_when_nothing_is_managed() -> None:
    # CPU model, default offload_devices=("cuda",): tba manages nothing. A forward that leaves
    # tba nothing to hold ends its step when it ends (Note [Step boundaries]): 4 steps.
    model = models.Stack()
    num_saved, largest = saved_activations(models.Stack())
    with caught() as messages:
        with tba.configure_tensor_cache(model, offloader="host") as cache:
            train(model, 4)
            total = cache.stats(cumulative=True)
            summary = cache.summary()
            text = repr(cache)
    assert total.num_steps == 4 and total.num_packed == 0 and total.offloaded_bytes == 0
    rows = [line for line in summary.splitlines() if line.strip()[:1].isdigit()]
    assert [row.split()[0] for row in rows] == ["1", "2", "3", "4"], summary
    assert all(row.endswith("none of 6") for row in rows), summary
    assert "no completed step" not in summary
    assert "steps=4" in text and "offloaded_blocks=0" in text and "offloaded_bytes=0" in text
    assert len(messages) == 1, messages
    (message,) = messages
    assert "step 1 offloaded nothing" in message
    assert f"{num_saved} on cpu (largest storage {format_bytes(largest)})" in message, message
    assert "offload_devices=('cuda',)" in message
    assert "pass offload_devices=('cpu',)" in message
    assert f"note: {message}" in summary


class ScaledStack(models.Stack):
    """Also saves a buffer (``mul`` saves ``scale`` for the embedding's gradient): a tensor on
    a managed device that tba leaves to autograd, which is not a reason to name."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((64,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) * self.scale
        for block in self.blocks:
            h = block(h)
        return self.head(h).pow(2).mean()


def test_small_storages_name_min_offload_bytes_and_the_largest_storage() -> None:
    torch.manual_seed(0)
    model = ScaledStack()
    _, largest = saved_activations(ScaledStack())
    assert largest < 1 << 20
    with caught() as messages:
        with tba.configure_tensor_cache(model, offloader="host", offload_devices="cpu") as cache:
            train(model, 3)
            last = cache.stats()
    assert last.num_steps == 1 and last.num_packed > 0 and last.kept_bytes > 0
    assert len(messages) == 1, messages
    assert f"largest saved storage on ('cpu',) is" in messages[0]
    assert f"({largest} bytes), below min_offload_bytes={1 << 20}" in messages[0], messages[0]
    assert "devices tba does not manage" not in messages[0]  # the buffer is no reason


def test_whole_model_in_reentrant_checkpoint_warns_at_first_backward() -> None:
    def forward(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return checkpoint(model, batch.requires_grad_(), use_reentrant=True)

    with caught() as messages:
        cache = run_twins(models.Stack, models.vector_batch, steps=3, forward=forward,
                          offloader="host", offload_devices=("cpu",), min_offload_bytes=0)
    assert cache.stats(cumulative=True).offloaded_bytes == 0
    assert len(messages) == 1, messages
    assert "reentrant torch.utils.checkpoint" in messages[0]
    assert "1 forward(s) without grad" in messages[0]  # warned at the first backward
    assert "use_reentrant=False" in messages[0]


def test_kept_tail_covering_every_block_names_keep_last_modules() -> None:
    model = models.Stack(num_blocks=2)
    with caught() as messages:
        # The embedding (before every block) is skipped: every managed storage is kept.
        with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                        min_offload_bytes=0, keep_last_modules=2,
                                        skip_modules="embed") as cache:
            train(model, 2)
            num_packed = cache.stats().num_packed
    assert len(messages) == 1, messages
    assert f"step 1 offloaded nothing ({num_packed} saved tensors managed" in messages[0]
    assert "keep_last_modules=2 keeps all 2 blocks in memory" in messages[0]
    assert "min_offload_bytes" not in messages[0]


def test_forward_that_saves_nothing_says_so() -> None:
    model = models.Stack().requires_grad_(False)  # nothing requires grad: nothing is saved
    with caught() as messages:
        with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                        min_offload_bytes=0) as cache:
            with torch.no_grad():
                model(models.vector_batch(0))  # not a step: no warning from this one
            for i in range(3):
                model(models.vector_batch(i))  # a step each: it leaves tba nothing to hold
            steps = cache.stats(cumulative=True).num_steps
    assert steps == 3
    assert len(messages) == 1, messages
    assert "no tensor saved for backward reached tba" in messages[0]


class _Clock:
    """Stands in for the ``time`` module of the transfer engine: every reading is 1000 s
    after the last, so every store seems to take 1000 s and the measured write bandwidth is a
    few bytes per second."""

    def __init__(self) -> None:
        self._readings = itertools.count(0.0, 1000.0)
        self.monotonic = time.monotonic

    def perf_counter(self) -> float:
        return next(self._readings)


def test_adaptive_keep_everything_names_the_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    import tba.cache.engine.batches as batches
    import tba.cache.engine.waits as waits
    import tba.cache.engine.workers as workers

    clock = _Clock()
    monkeypatch.setattr(workers, "time", clock)  # the workers time the stores ...
    monkeypatch.setattr(batches, "time", clock)  # ... the training thread its batched ones ...
    monkeypatch.setattr(waits, "time", clock)  # ... and the engine its waits
    model = models.Stack()
    with caught() as messages:
        # The embedding (before every block) is skipped so that "keep every block" keeps all.
        with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                        min_offload_bytes=0, skip_modules="embed", adaptive=True,
                                        profile_step=2) as cache:
            train(model, 4, cache)
            decision = cache.adaptive_decision
            history = [cache.stats(cumulative=True).num_steps]
    assert decision is not None and decision.tail_start == 0, decision
    assert history == [4]
    assert len(messages) == 1, messages
    assert "step 3 offloaded nothing" in messages[0]
    assert "the adaptive policy keeps every block" in messages[0]
    assert decision.reason in messages[0]


def test_keep_everything_decision_gives_offloader_memory_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # Note [A keep-everything decision holds no offloader memory] (tba/cache/steps/steps.py):
    # once the policy keeps every block, the offloader gets reserve(0) once and its pool holds
    # nothing; a policy that offloads never gets it.
    import tba.cache.engine.batches as batches
    import tba.cache.engine.waits as waits
    import tba.cache.engine.workers as workers
    from tba.offloaders import HostOffloader

    class Recording(HostOffloader):
        def __init__(self) -> None:
            super().__init__()
            self.reserved: list[int] = []

        def reserve(self, num_bytes: int) -> None:
            self.reserved.append(num_bytes)
            super().reserve(num_bytes)

    def run(slow: bool) -> tuple[tba.TensorCache, Recording]:
        offloader = Recording()
        model = models.Stack()
        with monkeypatch.context() as patch:
            if slow:  # every store seems to take 1000 s: the rule keeps every block
                clock = _Clock()
                patch.setattr(workers, "time", clock)
                patch.setattr(batches, "time", clock)
                patch.setattr(waits, "time", clock)
            with caught():
                with tba.configure_tensor_cache(model, offloader=offloader, offload_devices=("cpu",),
                                                min_offload_bytes=0, skip_modules="embed", adaptive=True,
                                                profile_step=2) as cache:
                    if not slow:  # each block computes 1 s: any working copy keeps up, however busy
                        clock = FakeStepClock()
                        drive_closed_loop(cache, clock=clock)
                        for block in model.blocks:
                            block.register_forward_pre_hook(lambda *_: clock.advance(1.0))
                    train(model, 6, cache)
                    cache.wait_for_stores(60)  # the reserve(0) is made by the store worker
                    return cache, offloader

    cache, offloader = run(slow=True)
    assert cache.adaptive_decision.tail_start == 0
    # The pool grew in the profiled step; given back once (the sizing the same step asked for
    # is overtaken by it: the store worker makes the latest request), and stays empty.
    assert offloader.reserved == [0] and offloader.capacity_bytes == 0
    cache, offloader = run(slow=False)
    assert cache.adaptive_decision.tail_start > 0 and 0 not in offloader.reserved


def test_failed_stores_are_named() -> None:
    offloader = FakeOffloader()
    offloader.fail_store = True
    model = models.Stack()
    with caught() as messages:
        with tba.configure_tensor_cache(model, offloader=offloader, offload_devices=("cpu",),
                                        min_offload_bytes=0, on_io_error="keep") as cache:
            train(model, 2, cache)
            errors = cache.stats().num_io_errors
    mine = [m for m in messages if "offloaded nothing" in m]
    assert len(mine) == 1, messages
    assert f"0 cancelled" in mine[0] and f"{errors} failed and were kept in memory" in mine[0]


def test_cancelled_stores_are_named() -> None:
    # The first store blocks on a gate: backward cancels every queued store (and reads the
    # blocked one from memory), so the steps end with nothing written. One such step may be
    # a passing accident and is not warned about; the second is.
    offloader = FakeOffloader()
    offloader.gate = threading.Event()
    model = models.Stack()
    with caught() as messages:
        cache = tba.configure_tensor_cache(model, offloader=offloader, offload_devices=("cpu",),
                                           min_offload_bytes=0, adaptive=False)
        try:
            model(models.vector_batch(0)).backward()
            assert messages == [] and cache.stats().num_cancelled > 0  # one step may be timing
            model(models.vector_batch(1)).backward()
            last = cache.stats()
        finally:
            offloader.gate.set()
            cache.close()
    assert last.num_steps == 1 and last.offloaded_bytes == 0 and last.num_cancelled > 0
    assert len(messages) == 1, messages
    assert "step 2 offloaded nothing" in messages[0]
    assert f"{last.num_cancelled} cancelled" in messages[0]


def test_no_warning_when_offloading_or_with_offloader_none() -> None:
    with caught() as messages:
        # max_step_overhead=None: no closed-loop keep step (it offloads nothing, on purpose).
        cache = run_twins(models.Stack, models.vector_batch, steps=3, settle=True,
                          offloader="host", offload_devices=("cpu",), min_offload_bytes=0,
                          max_step_overhead=None)
        with tba.configure_tensor_cache(models.Stack(), offloader="none") as none:
            pass
    assert_bytes_moved(cache)
    assert messages == []
    assert probe(none).sampling is False
    # Sampling ended with the first step that offloaded: forwards enter the bare pack hook.
    assert probe(cache).sampling is False
    assert "offloaded_blocks=5" in repr(cache) and "steps=3" in repr(cache)


def test_warning_is_given_once_per_cache() -> None:
    with caught() as messages:
        for _ in range(2):
            model = models.Stack()
            with tba.configure_tensor_cache(model, offloader="host"):
                train(model, 4)
    assert len(messages) == 2, messages


# ---------------------------------------------------------------- readable stats
def test_stats_print_readably_and_repr_keeps_every_field() -> None:
    stats = tba.CacheStats(
        num_steps=2, num_packed=10, num_offloaded=4, offloaded_bytes=3 << 20,
        reloaded_bytes=3 << 20, kept_bytes=1536, peak_resident_bytes=5 << 20, stall_s=0.0125,
        store_wait_s=0.002, write_s=0.003, read_s=0.006, num_io_errors=1,
    )
    stats.finish_rates()
    text = str(stats)
    for expected in ("2 steps", "offloaded      3.0 MiB in 4 stores", "write 1.05 GB/s",
                     "read 0.52 GB/s", "1.5 KiB in memory", "peak resident 5.0 MiB",
                     "stall 12.5 ms", "store wait 2.0 ms", "10 packed", "I/O errors 1"):
        assert expected in text, (expected, text)
    assert "_s=" not in text and "bytes_per_s" not in text
    assert repr(stats).startswith("CacheStats(num_steps=2, ")
    assert "write_bytes_per_s=" in repr(stats)
    result = doctest.testmod(stats_module, raise_on_error=False, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_summary_names_the_offloaded_blocks() -> None:
    """The blocks column: "0 of 6" is the first block alone, "0-4 of 6" blocks 0 to 4, "none"
    a step that wrote nothing (whatever the policy chose)."""
    wrote = tba.CacheStats(num_steps=1, offloaded_bytes=1 << 20)
    rows = [(1, wrote, 1), (2, wrote, 5), (3, tba.CacheStats(num_steps=1), 5)]
    table = stats_module.format_summary(rows, 6, None).splitlines()
    assert [line.split("  ")[-1].strip() for line in table[2:5]] == ["0 of 6", "0-4 of 6", "none of 6"]
