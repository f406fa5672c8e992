"""Who owns the cache, where steps end, and what is left behind (Note [The model owns its
cache], Note [Step boundaries]): the one-line use with the handle dropped, configuring again,
the model collected, kept forward-only graphs, retain_graph, gradient accumulation, failed
prefetch loads, and bounded waits."""

from __future__ import annotations

import copy
import gc
import os
import threading
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

import tba
from tba.testing import probe
from tests import models
from tests.cache.fakes import FakeOffloader

JOIN_S = 30.0


def _tba_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tba-") and t.is_alive()]


def _options(offloader: str, tmp_path: Path, **extra) -> dict:
    options = dict(offloader=offloader, offload_devices=("cpu",), min_offload_bytes=0,
                   keep_last_modules=0, adaptive=False, **extra)
    if offloader == "ssd":
        options.update(ssd_dirs=(str(tmp_path),), ssd_engine="posix")
    return options


def _hook_counts(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


# ---------------------------------------------------------------- the model owns its cache
@pytest.mark.parametrize("max_inflight_bytes", [1, 1 << 30], ids=["inflight-1", "inflight-default"])
@pytest.mark.parametrize("offloader", ["host", "ssd"])
def test_one_line_use_with_the_handle_dropped_offloads_bit_exact(
    offloader: str, max_inflight_bytes: int, tmp_path: Path
) -> None:
    """The README's one line, result not kept: the cache lives with the model, offloads and
    reloads bytes, and training is bit-exact (a dropped cache once did nothing, or hung)."""
    torch.manual_seed(0)
    reference = models.Stack(num_blocks=4)
    model = copy.deepcopy(reference)
    tba.configure_tensor_cache(model, **_options(offloader, tmp_path, max_inflight_bytes=max_inflight_bytes))
    gc.collect()  # nothing but the model holds the cache now
    opt_ref = torch.optim.Adam(reference.parameters(), lr=1e-3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(3):
        for net, optimizer in ((reference, opt_ref), (model, opt)):
            optimizer.zero_grad()
            torch.manual_seed(step)
            loss = net(models.vector_batch(step))
            if net is model:
                tba.get_tensor_cache(model).wait_for_stores(JOIN_S)  # every store completes
            loss.backward()
            optimizer.step()
        for a, b in zip(reference.parameters(), model.parameters()):
            assert torch.equal(a, b), f"step {step}: parameters differ"
    cache = tba.get_tensor_cache(model)
    assert cache is not None and not cache.closed
    total = cache.stats(cumulative=True)
    assert total.num_steps == 3
    assert total.offloaded_bytes > 0 and total.reloaded_bytes > 0, total
    cache.close()


def test_configuring_again_replaces_the_cache_and_its_hooks() -> None:
    model = models.Stack(num_blocks=3)
    before = _hook_counts(model)
    tba.configure_tensor_cache(model, offload_devices=("cpu",))  # handle dropped
    first = tba.get_tensor_cache(model)
    installed = _hook_counts(model) - before
    assert installed > 0
    second = tba.configure_tensor_cache(model, offload_devices=("cpu",), offloader="none")
    assert first is not None and first.closed and not second.closed
    assert tba.get_tensor_cache(model) is second
    assert _hook_counts(model) - before == installed  # only the new cache's hooks
    model(models.vector_batch(0)).backward()
    assert second.stats().num_packed > 0 and first.stats(cumulative=True).num_steps == 0
    second.close()
    assert _hook_counts(model) == before
    assert tba.get_tensor_cache(model) is None


def test_get_tensor_cache_sees_through_a_wrapper() -> None:
    class Wrapper(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    model = models.Stack(num_blocks=2)
    with tba.configure_tensor_cache(model, offload_devices=("cpu",)) as cache:
        assert tba.get_tensor_cache(Wrapper(model)) is cache
    assert tba.get_tensor_cache(Wrapper(model)) is None
    with pytest.raises(TypeError, match="torch.nn.Module"):
        tba.get_tensor_cache("model")  # type: ignore[arg-type]


@pytest.mark.parametrize("keep_handle", [False, True], ids=["handle-dropped", "handle-kept"])
def test_the_model_collected_stops_threads_and_removes_the_directory(
    tmp_path: Path, keep_handle: bool
) -> None:
    """No reference cycle through a live graph or a worker keeps the model: when the script
    drops it, its cache goes (by reference counting, no collector run), threads stop and the
    SSD directory is removed; a graph still alive then fails its backward with a TBAError."""
    threads_before = {id(t) for t in _tba_threads()}
    model = models.Stack(num_blocks=3)
    cache = tba.configure_tensor_cache(model, **_options("ssd", tmp_path))
    loss = model(models.vector_batch(0))
    cache.wait_for_stores(JOIN_S)
    loss.backward()
    kept = model(models.vector_batch(1))  # a graph that outlives the model
    cache.wait_for_stores(JOIN_S)
    (directory,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert any(directory.iterdir())
    model_ref = weakref.ref(model)
    cache_ref = weakref.ref(cache)
    gc.disable()  # prove reference counting alone frees them
    try:
        del model, loss
        if not keep_handle:
            del cache
        assert model_ref() is None, "something still holds the model"
        if keep_handle:
            assert cache_ref() is cache and not cache.closed  # the handle keeps the cache ...
            assert cache.stats(cumulative=True).num_steps == 1  # ... and it still answers
            del cache
        assert cache_ref() is None, "something still holds the cache"
    finally:
        gc.enable()
    assert not directory.exists(), "the SSD directory was not removed"
    for thread in _tba_threads():
        if id(thread) not in threads_before:
            thread.join(JOIN_S)
            assert not thread.is_alive(), f"{thread.name} still runs"
    with pytest.raises(tba.TBAError, match="tensor cache was closed"):
        kept.backward()


# ---------------------------------------------------------------- where steps end
def test_a_kept_preview_output_does_not_stop_step_boundaries() -> None:
    """A grad-enabled output kept across steps for logging and never backwarded (Note [Step
    boundaries], rule (c)): every training step is counted, and what tba holds (records,
    grad_fn hooks, entries) stays bounded by what is alive, over 1000 steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                               min_offload_bytes=0, keep_last_modules=0, adaptive=False)
    cache = tba.get_tensor_cache(model)
    view = probe(cache)
    preview = None
    worst = (0, 0, 0)
    for step in range(1000):
        x = torch.randn(2, 4)
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        preview = model(torch.randn(2, 4))  # kept until the next step: never backwarded
        if step % 100 == 99:
            worst = max(worst, (len(view.records), view.num_grad_fn_hooks, view.num_entries))
    assert preview is not None
    assert cache.stats(cumulative=True).num_steps == 1000
    records, hooks, entries = worst
    assert records <= 2 and hooks <= 8 and entries <= 12, worst
    del preview
    cache.stats()  # the release of the dead preview is done at tba's next call
    assert view.num_entries == 0 and not view.records and view.num_grad_fn_hooks == 0
    assert not view.check_invariants()
    cache.close()


def test_step_counts_of_accumulation_and_retain_graph() -> None:
    """The documented step counts (Note [Step boundaries]): forwards then one backward over
    all of them is one step; forward-backward pairs are a step each; a second backward of a
    retained graph is a step of its own; the retained graph's tensors stay until it dies."""
    model = models.Stack(num_blocks=3)
    with tba.configure_tensor_cache(model, offload_devices=("cpu",), min_offload_bytes=0,
                                    keep_last_modules=0, adaptive=False) as cache:
        view = probe(cache)
        a, b = model(models.vector_batch(0)), model(models.vector_batch(1))
        assert view.step_open and len(view.records) == 2
        (a + b).backward()
        assert not view.step_open and cache.stats(cumulative=True).num_steps == 1
        assert cache.stats().num_packed > 0
        for i in range(2):  # one microbatch at a time
            model(models.vector_batch(i)).backward()
        assert cache.stats(cumulative=True).num_steps == 3
        loss = model(models.vector_batch(5))
        cache.wait_for_stores(JOIN_S)
        loss.backward(retain_graph=True)
        assert cache.stats(cumulative=True).num_steps == 4
        first = cache.stats()
        assert first.num_packed > 0 and first.reloaded_bytes > 0
        assert view.num_entries > 0  # the retained graph still holds its tensors
        loss.backward()  # reads them again: a step of its own, with no forward
        assert cache.stats(cumulative=True).num_steps == 5
        assert cache.stats().num_packed == 0
        del loss
        cache.stats()
        assert view.num_entries == 0 and not view.check_invariants()


def test_offload_devices_without_the_models_device_counts_every_step_at_once() -> None:
    """A CPU model with the default offload_devices=("cuda",): nothing is managed, and each
    step is counted when it ends (not at the next forward)."""
    model = models.Stack(num_blocks=2)
    with tba.configure_tensor_cache(model, offloader="host") as cache:
        for step in range(3):
            model(models.vector_batch(step)).backward()
            assert cache.stats(cumulative=True).num_steps == step + 1


# ---------------------------------------------------------------- failures reach the step
class FailsFirstLoads(FakeOffloader):
    def __init__(self, num_failures: int) -> None:
        super().__init__()
        self.failures_left = num_failures

    def load(self, token: int, dst: torch.Tensor) -> None:
        with self.lock:
            fail = self.failures_left > 0
            self.failures_left -= fail
        if fail:
            raise OSError(5, "injected prefetch read failure")
        super().load(token, dst)


class _WaitIdle(torch.autograd.Function):
    """Identity whose backward waits until the cache's transfers are idle: the loads that
    backward started above it (prefetch) have finished, or failed, when it returns."""

    @staticmethod
    def forward(ctx, x, view):  # type: ignore[override]
        ctx.view = view
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.view.wait_idle(JOIN_S)
        return grad, None


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 32), nn.Linear(32, 8)])
        self.view = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](x)
        h = _WaitIdle.apply(h, self.view)
        return self.blocks[1](torch.tanh(h)).sum()


class FailsLoadsOf(FakeOffloader):
    """Fails the first ``num_failures`` loads of ``nbytes``."""

    def __init__(self, nbytes: int, num_failures: int = 1) -> None:
        super().__init__()
        self.nbytes, self.failures_left = nbytes, num_failures

    def load(self, token: int, dst: torch.Tensor) -> None:
        with self.lock:
            fail = dst.numel() == self.nbytes and self.failures_left > 0
            self.failures_left -= fail
        if fail:
            raise OSError(5, "injected prefetch read failure")
        super().load(token, dst)


def test_a_failed_prefetch_is_raised_in_backward() -> None:
    """A load started by prefetch that failed before backward needed its tensor reaches the
    training step with on_io_error='raise' (it is not silently loaded again); the next step
    trains."""
    x = torch.randn(4, 8)
    offloader = FailsLoadsOf(x.numel() * 4)  # block 0's saved input
    model = TwoBlocks()
    with tba.configure_tensor_cache(model, **_options(offloader, Path("."), num_load_threads=1)) as cache:
        model.view = probe(cache)
        loss = model(x)
        cache.wait_for_stores(JOIN_S)
        # Backward enters block 1 and prefetches block 0 too; _WaitIdle lets that load fail
        # before block 0's backward asks for the tensor.
        with pytest.raises(tba.OffloadIOError, match="injected prefetch read failure"):
            loss.backward()
        assert offloader.failures_left == 0
        del loss
        model.zero_grad()
        loss = model(x)
        cache.wait_for_stores(JOIN_S)
        loss.backward()
        assert cache.stats().reloaded_bytes > 0


def test_a_failed_prefetch_with_keep_warns_reads_again_and_stays_bit_exact() -> None:
    torch.manual_seed(0)
    reference = models.Stack(num_blocks=4)
    model = copy.deepcopy(reference)
    offloader = FailsFirstLoads(2)  # a prefetched load fails, then its read again fails once more
    with tba.configure_tensor_cache(model, **_options(offloader, Path("."), on_io_error="keep")) as cache:
        torch.manual_seed(1)
        loss = model(models.vector_batch(0))
        cache.wait_for_stores(JOIN_S)
        with pytest.warns(RuntimeWarning, match="reads the tensor again"):
            loss.backward()
        stats = cache.stats()
    torch.manual_seed(1)
    reference(models.vector_batch(0)).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert stats.num_io_errors == 2 and stats.reloaded_bytes > 0


def test_a_failed_reserve_is_raised_in_the_training_step() -> None:
    """The pool's reserve() runs on a store worker; its failure is raised in the next step,
    not swallowed on the worker."""

    class FailingReserve(FakeOffloader):
        def reserve(self, num_bytes: int) -> None:
            raise OSError(28, "injected: no space to reserve")

    model = models.Stack(num_blocks=3)
    with tba.configure_tensor_cache(model, **_options(FailingReserve(), Path("."))) as cache:
        model(models.vector_batch(0)).backward()  # step 1 ends: the reserve is asked for
        with pytest.raises(tba.OffloadIOError, match="no space to reserve"):
            for step in range(1, 3):
                loss = model(models.vector_batch(step))
                cache.wait_for_stores(JOIN_S)
                loss.backward()
        loss = None
        model(models.vector_batch(3)).backward()  # the next step trains


# ---------------------------------------------------------------- bounded waits
@pytest.mark.parametrize("what", ["backpressure", "load"])
def test_a_stuck_offloader_fails_the_step_instead_of_hanging(what: str) -> None:
    """transfer_timeout_s: a forward waiting for room, or a backward waiting for a load, whose
    offloader makes no progress raises a TBAError naming what it waited for."""

    class Stuck(FakeOffloader):
        def __init__(self) -> None:
            super().__init__()
            self.release_gate = threading.Event()
            self.stick = what

        def store(self, src: torch.Tensor) -> int:
            if self.stick == "backpressure":
                assert self.release_gate.wait(JOIN_S), "test gate never opened"
            return super().store(src)

        def load(self, token: int, dst: torch.Tensor) -> None:
            if self.stick == "load":
                assert self.release_gate.wait(JOIN_S), "test gate never opened"
            super().load(token, dst)

    offloader = Stuck()
    model = models.Stack(num_blocks=3)
    options = _options(offloader, Path("."), transfer_timeout_s=0.5,
                       max_inflight_bytes=1 if what == "backpressure" else 1 << 30)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            loss = model(models.vector_batch(0))
            if what == "load":
                tba.get_tensor_cache(model).wait_for_stores(JOIN_S)
            loss.backward()
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    cache = tba.configure_tensor_cache(model, **options)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(JOIN_S)
    try:
        assert not thread.is_alive(), "the step hung on a stuck offloader"
        (error,) = outcome
        assert isinstance(error, tba.TBAError), error
        expected = "room for a store" if what == "backpressure" else "the load of"
        assert expected in str(error) and "transfer_timeout_s" in str(error), error
    finally:
        offloader.release_gate.set()
        cache.close()


def test_transfer_timeout_is_validated() -> None:
    with pytest.raises(ValueError, match="transfer_timeout_s=0"):
        tba.TensorCacheConfig(transfer_timeout_s=0)


def test_import_and_configure_leave_sigint_alone_until_a_cache_exists() -> None:
    """tba's wrapper of the SIGINT handler (Note [Interrupt-safe bookkeeping]) is installed by
    a cache on the main thread and the handler put back when the last cache closes."""
    import signal

    from tba.cache.engine import interrupts

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("the test runner installed its own SIGINT handler")
    model = models.Stack(num_blocks=2)
    with tba.configure_tensor_cache(model, offload_devices=("cpu",)):
        wrapper = signal.getsignal(signal.SIGINT)
        assert isinstance(wrapper, interrupts._Deferring)
        assert wrapper.handler is signal.default_int_handler
    gc.collect()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert os.getpid()  # the process is still ours
