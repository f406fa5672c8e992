"""Public API: configuration errors, close(), import side effects, stats, memory."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

import tba
from tba.testing import probe
from tests import models


def test_bad_config_lists_every_problem() -> None:
    with pytest.raises(ValueError) as info:
        tba.configure_tensor_cache(
            models.Stack(), offloader="floppy", min_offload_bytes=-1, prefetch_modules="2",
            on_io_error="ignore", bogus=1,
        )
    message = str(info.value)
    for expected in ("offloader='floppy'", "min_offload_bytes=-1", "prefetch_modules='2'",
                     "on_io_error='ignore'", "bogus: unknown option", "'host'", "'raise'"):
        assert expected in message, (expected, message)


def test_config_accepts_lists_and_is_frozen() -> None:
    cfg = tba.TensorCacheConfig(offload_devices=["cpu"], skip_modules=["lm_head"])
    assert cfg.offload_devices == ("cpu",) and cfg.skip_modules == ("lm_head",)
    with pytest.raises(AttributeError):
        cfg.min_offload_bytes = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        tba.TensorCacheConfig("host")  # type: ignore[misc]  # keyword-only


def test_bad_block_modules_names_the_fix() -> None:
    with pytest.raises(ValueError, match="matches no submodule"):
        tba.configure_tensor_cache(models.Stack(), block_modules=("nothing.*",))


def _hook_counts(model: torch.nn.Module) -> list[int]:
    return [
        len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
        + len(m._backward_pre_hooks) for m in model.modules()
    ]


def test_close_removes_every_hook_and_training_matches() -> None:
    torch.manual_seed(0)
    model = models.Stack()
    twin = copy.deepcopy(model)
    before = _hook_counts(model)
    cache = tba.configure_tensor_cache(model, offload_devices=("cpu",), min_offload_bytes=0)
    assert _hook_counts(model) != before
    model(models.vector_batch(0)).backward()
    cache.close()
    cache.close()  # idempotent
    assert _hook_counts(model) == before
    # No saved-tensor hooks are left on this thread's stack ...
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    # ... and the model's forward enters none any more: every tensor it saves reaches the
    # caller's own hooks, as many as the unconfigured twin saves.
    seen: list[torch.Tensor] = []
    twin_seen: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        model(models.vector_batch(9))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: twin_seen.append(t) or t, lambda t: t):
        twin(models.vector_batch(9))
    assert len(seen) == len(twin_seen) > 0, (len(seen), len(twin_seen))
    twin.zero_grad()
    model.zero_grad()
    for step in range(2):
        x = models.vector_batch(step)
        torch.manual_seed(step)
        a = model(x)
        a.backward()
        torch.manual_seed(step)
        b = twin(x)
        b.backward()
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_no_saved_tensor_hooks_outside_forward() -> None:
    model = models.Stack()
    with tba.configure_tensor_cache(model, offload_devices=("cpu",), min_offload_bytes=0) as cache:
        model(models.vector_batch(0)).backward()
        # Tensors saved outside the model's forward are not the cache's business.
        y = torch.randn(3, requires_grad=True)
        (y.exp() * 2).sum().backward()
        before = cache.stats(cumulative=True).num_packed
        (y.exp() * 2).sum().backward()
        assert cache.stats(cumulative=True).num_packed == before


def test_import_initialises_no_cuda_and_loads_no_native_library() -> None:
    code = (
        "import sys, torch\n"
        "before = set(open('/proc/self/maps').read().split())\n"
        "import tba, tba.offloaders, tba.cache.tensor_cache\n"
        "after = set(open('/proc/self/maps').read().split())\n"
        "new = sorted(p for p in after - before if p.endswith('.so') or '.so.' in p)\n"
        "assert not new, new\n"
        "assert not torch.cuda.is_initialized()\n"
        "import torch.autograd.graph as g\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.timing
def test_stats_cover_one_step_and_totals() -> None:
    model = models.Stack()
    with tba.configure_tensor_cache(
        model, offload_devices=("cpu",), min_offload_bytes=0, keep_last_modules=0, adaptive=False
    ) as cache:
        steps = []
        for step in range(3):
            loss = model(models.vector_batch(step))
            cache.wait_for_stores(60)  # let the stores run: nothing cancelled
            loss.backward()
            last = cache.stats()
            steps.append(last)
            assert last.num_steps == 1
            assert last.offloaded_bytes > 0
            assert last.reloaded_bytes + last.num_forwarded > 0
            assert last.write_bytes_per_s > 0
        total = cache.stats(cumulative=True)
    assert total.num_steps == 3
    # How much is written depends on how far the store thread got before backward needed
    # the tensor (the rest is cancelled), so compare with the per-step figures.
    assert total.offloaded_bytes == sum(s.offloaded_bytes for s in steps)
    assert total.reloaded_bytes == sum(s.reloaded_bytes for s in steps)
    assert total.peak_resident_bytes == max(s.peak_resident_bytes for s in steps)
    assert total.num_packed == 3 * last.num_packed


def _peak(offloader: str) -> int:
    torch.manual_seed(0)
    model = models.Stack(num_blocks=6, width=256)
    # At most one store in flight (max_inflight_bytes=1: each save waits for the store before
    # it): the peak does not depend on how far the store thread got, however busy the machine.
    with tba.configure_tensor_cache(
        model, offloader=offloader, offload_devices=("cpu",), min_offload_bytes=0,
        max_inflight_bytes=1, adaptive=False,
    ) as cache:
        for step in range(2):
            model(torch.randn(64, 16)).backward()
        return cache.stats().peak_resident_bytes


@pytest.mark.timing
def test_host_peak_is_at_most_60_percent_of_none() -> None:
    none, host = _peak("none"), _peak("host")
    assert none > 0
    assert host <= 0.6 * none, (host, none)


def test_module_list_free_model_uses_children_as_blocks() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    with tba.configure_tensor_cache(model, offload_devices=("cpu",), min_offload_bytes=0) as cache:
        assert cache.num_blocks == 3
        model(torch.randn(2, 4)).sum().backward()
        assert cache.stats().num_packed > 0


def test_forward_without_backward_ends_the_step_and_leaks_nothing() -> None:
    model = models.Stack(num_blocks=3)
    with tba.configure_tensor_cache(model, offload_devices=("cpu",), min_offload_bytes=0,
                                    keep_last_modules=0) as cache:
        for step in range(5):
            model(models.vector_batch(step))  # graph dropped without backward (eval with grad)
        assert cache.stats(cumulative=True).num_steps == 5
        view = probe(cache)
        assert not view.num_entries and not view.records and not view.num_grad_fn_hooks
        model(models.vector_batch(9)).backward()
        assert cache.stats().num_packed > 0


def test_retain_graph_keeps_tensors_until_the_graph_dies() -> None:
    torch.manual_seed(0)
    model = models.Stack(num_blocks=3)
    twin = copy.deepcopy(model)
    with tba.configure_tensor_cache(model, offload_devices=("cpu",), min_offload_bytes=0,
                                    keep_last_modules=0):
        torch.manual_seed(1)
        loss = model(models.vector_batch(0))
        loss.backward(retain_graph=True)
        loss.backward()  # second backward reads the offloaded tensors again
    torch.manual_seed(1)
    ref = twin(models.vector_batch(0))
    ref.backward(retain_graph=True)
    ref.backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_error_in_forward_leaves_no_hooks_active() -> None:
    class Boom(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.blocks[0](x).exp()  # saves a tensor, then fails
            raise RuntimeError("boom")

    model = Boom()
    with tba.configure_tensor_cache(model, offload_devices=("cpu",), min_offload_bytes=0) as cache:
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randn(2, 4, requires_grad=True))
        forward = probe(cache).forward
        assert not forward.hooks_active and not forward.has_record and forward.depth == 0
        # Tensors saved now are autograd's own again.
        x = torch.randn(3, requires_grad=True)
        before = cache.stats(cumulative=True).num_packed
        x.exp().sum().backward()
        assert cache.stats(cumulative=True).num_packed == before


def test_skip_modules_are_never_offloaded() -> None:
    """Note [Stepping aside]: the saves of a skipped module (by name, or by type: the dropout of
    every block) never reach tba; the other blocks' saves are offloaded."""
    seen = {}
    for skip in ((), ("blocks.1", torch.nn.Dropout)):
        torch.manual_seed(0)
        model = models.Stack(num_blocks=3)
        with tba.configure_tensor_cache(model, offload_devices=("cpu",), min_offload_bytes=0,
                                        keep_last_modules=0, adaptive=False,
                                        skip_modules=skip) as cache:
            with probe(cache).watch_saves() as saves:
                model(models.vector_batch(0)).backward()
        seen[skip] = saves
    everything, skipped = seen.values()
    in_block_1 = [s for s in everything if s.units == ("blocks.1",)]
    assert in_block_1 and all(s.offloaded for s in in_block_1 if s.new_entry)
    assert not [s for s in skipped if s.units == ("blocks.1",) or s.skip_depth]
    # Besides block 1's, the dropout masks of blocks 0 and 2 (one save each) are missing.
    assert len(skipped) == len(everything) - len(in_block_1) - 2
    elsewhere = [s.offloaded for s in skipped
                 if s.new_entry and s.units in (("blocks.0",), ("blocks.2",))]
    assert elsewhere and all(elsewhere)


def test_block_modules_override() -> None:
    model = models.Stack(num_blocks=4)
    with tba.configure_tensor_cache(model, offload_devices=("cpu",),
                                    block_modules=(models.MLPBlock,)) as by_type:
        assert [u.name for u in by_type.units if u.block_index is not None] == [
            "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    with tba.configure_tensor_cache(model, offload_devices=("cpu",),
                                    block_modules=("blocks.[02]", model.head)) as by_name:
        blocks = [u.name for u in by_name.units if u.block_index is not None]
        assert blocks == ["blocks.0", "blocks.2", "head"]
        # Everything else still opens scopes of its own.
        assert {"embed", "blocks.1", "blocks.3"} <= {u.name for u in by_name.units}


def test_set_stage_validates_logs_and_decides_the_tail() -> None:
    model = models.Stack(num_blocks=3)
    with tba.configure_tensor_cache(model, offload_devices=("cpu",), min_offload_bytes=0,
                                    adaptive=False) as cache:
        with pytest.raises(ValueError, match="action='fwd'.*next_action='bwd'"):
            cache.set_stage(microbatch=0, action="fwd", next_action="bwd")
        # No hint: the last block and what follows it stay in memory.
        loss = model(models.vector_batch(0))
        (record,) = probe(cache).records
        assert [s.keep for s in record.scopes][-2:] == [True, True]
        loss.backward()
        # GPipe-like hint: the next action is another forward, so no tail is kept.
        cache.set_stage(microbatch=0, action="forward", next_microbatch=1, next_action="forward")
        loss = model(models.vector_batch(0))
        records = {r.key: r for r in probe(cache).records}
        assert not any(s.keep for s in records[(0, 0)].scopes)
        # 1F1B on the last stage: this microbatch's backward comes next, so keep its tail.
        cache.set_stage(microbatch=1, action="forward", next_microbatch=1, next_action="backward")
        loss2 = model(models.vector_batch(1))
        records = {r.key: r for r in probe(cache).records}
        assert records[(0, 1)].scopes[-1].keep
        cache.set_stage(microbatch=1, action="backward", next_microbatch=0, next_action="backward")
        loss2.backward()
        cache.set_stage(microbatch=0, action="backward")
        loss.backward()
        assert list(cache.stage_log) == [(0, 0, "forward"), (0, 1, "forward"), (0, 1, "backward"),
                                         (0, 0, "backward")]
        # The unhinted step, then one pipelined step holding both microbatches.
        assert cache.stats(cumulative=True).num_steps == 2


def test_a_model_calling_itself_is_one_forward() -> None:
    """Note [Interrupted forwards]: a nested call of the configured model (a forward that
    calls the model again) is not mistaken for an interrupted one."""

    class Recursive(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8)])

        def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
            x = torch.tanh(self.blocks[0](x))
            # sin saves its input after the nested call returned: still inside this forward
            return x if depth == 0 else torch.sin(self(x, depth - 1))

    torch.manual_seed(0)
    model = Recursive()
    twin = copy.deepcopy(model)
    activations = []  # what the twin saves that tba would manage (not parameters or their views)

    def count(t: torch.Tensor) -> torch.Tensor:
        param = (t.requires_grad and t.is_leaf) or (t._base is not None and t._base.is_leaf and t._base.requires_grad)
        activations.append(not param)
        return t

    with tba.configure_tensor_cache(model, offload_devices=("cpu",), min_offload_bytes=0,
                                    keep_last_modules=0, adaptive=False) as cache:
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            model(x).sum().backward()
            with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
                loss = twin(x).sum()
            loss.backward()
        stats = cache.stats(cumulative=True)
    # Every save of the outer forward, also those after the nested call returned, went through tba.
    assert stats.num_steps == 3 and stats.num_packed == sum(activations) > 0
    assert probe(cache).forward.depth == 0
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)
