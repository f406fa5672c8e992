"""The ``"tba"`` backend as users meet it: registration, options, models without a cache,
closing or configuring again around compiled graphs, graph breaks in the model, I/O errors in
the training step, ``check_parity(compile="tba")``, the policy moving the boundary at run time
without recompiling."""

from __future__ import annotations

import logging
import warnings
from importlib.metadata import entry_points

import pytest
import torch

import tba
import tba.compile
from tba.compile.compiler import _parse
from tba.testing import FakeOffloader, check_parity
from tests import models
from tests.compile.training import BASE_OPTIONS, assert_same_training, reports, train

dynamo = torch._dynamo
from torch._dynamo.utils import counters  # noqa: E402

OPTIONS = dict(BASE_OPTIONS, offloader="host", keep_last_modules=0)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    dynamo.reset()
    counters.clear()
    yield
    dynamo.reset()


def _step(runner, seed: int = 0, cache: tba.TensorCache | None = None) -> torch.Tensor:
    torch.manual_seed(seed)
    loss = runner(models.vector_batch(seed))
    if cache is not None:
        cache.wait_for_stores(60)
    loss.backward()
    return loss.detach()


def _compiled(model: torch.nn.Module, **kwargs):
    return torch.compile(model, backend="tba", options={"inner": "aot_eager"}, **kwargs)


def test_registered_for_torch_compile_and_hugging_face() -> None:
    """An installed tba provides the backend by name: torch.compile(backend="tba") and HF
    TrainingArguments(torch_compile_backend="tba") look it up in this entry point group."""
    (entry,) = [e for e in entry_points(group="torch_dynamo_backends") if e.name == "tba"]
    assert entry.value == "tba.compile:backend"
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("tba") is tba.compile.backend
    assert "tba" in dynamo.list_backends()


def test_bad_options_are_listed_at_once() -> None:
    with pytest.raises(ValueError) as info:
        _parse(None, {"inner": "eager", "no_such_option": 1})
    assert "options['inner']='eager'" in str(info.value)
    with pytest.raises(ValueError, match="with options\\['inner'\\]='aot_eager' pass neither"):
        _parse("max-autotune", {"inner": "aot_eager"})
    with pytest.raises(ValueError, match="not an Inductor option"):
        _parse(None, {"no_such_option": 1})
    assert _parse("max-autotune-no-cudagraphs", {"inner": "inductor"})[1]["max_autotune"] is True


def test_cuda_graph_modes_are_refused_with_a_cache() -> None:
    model = models.Stack(num_blocks=2)
    cache = tba.configure_tensor_cache(model, **OPTIONS)
    try:
        with pytest.raises(Exception, match="does not support CUDA graphs"):
            _step(torch.compile(model, backend="tba", mode="reduce-overhead"))
    finally:
        cache.close()


class _Lone(torch.nn.Module):
    """A model without submodules: tba's only unit is the model, whose own hooks run outside
    the compiled graph, so Dynamo does not compile again when they come or go."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.relu(x @ self.weight) * 2).pow(2).mean()


def test_a_model_without_cache_compiles_as_the_inner_compiler(caplog: pytest.LogCaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal to the inner compiler alone, and the user is told (once) what tba needs."""
    monkeypatch.setattr(tba.compile.compiler, "_warned_no_cache", False)
    torch.manual_seed(0)
    model = models.Stack(num_blocks=2)
    reference = models.Stack(num_blocks=2)
    reference.load_state_dict(model.state_dict())
    with caplog.at_level(logging.WARNING, logger="tba.compile.compiler"):
        loss = _step(_compiled(model))
    assert torch.equal(loss, _step(torch.compile(reference, backend="aot_eager")))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    (record,) = [r for r in caplog.records if r.name == "tba.compile.compiler"]
    assert "no model configured with tba.configure_tensor_cache" in record.getMessage()
    assert "offloads nothing" in record.getMessage()


def test_configuring_after_compiling_says_to_reset() -> None:
    """Dynamo reuses the graph it compiled before the model had a cache (it did not trace a
    hook of tba's then, so none of its guards sees them come): that graph refuses to run
    without offloading, and after ``torch.compiler.reset()`` the model compiles with tba's
    ops."""
    model = models.Stack(num_blocks=2)
    runner = _compiled(model)
    _step(runner)
    cache = tba.configure_tensor_cache(model, **OPTIONS)
    try:
        with pytest.raises(tba.TBAError, match="torch.compiler.reset"):
            _step(runner, 1)
        dynamo.reset()
        _step(runner, 1, cache=cache)
        assert cache.stats().offloaded_bytes > 0 and cache.stats().reloaded_bytes > 0
    finally:
        cache.close()


def test_closing_under_a_compiled_graph_then_configuring_again() -> None:
    """After ``close()`` a graph compiled with tba's ops raises a TBAError naming the fix;
    configuring the model again makes it run again, with the new cache. (A model whose
    blocks carry tba's hooks inside the compiled code compiles again without tba after
    ``close()``, Dynamo's guards seeing the hooks go; configuring it again then needs
    ``torch.compiler.reset()``, as ``test_configuring_after_compiling_says_to_reset``.)"""
    model = _Lone()
    cache = tba.configure_tensor_cache(model, **OPTIONS)
    runner = _compiled(model, fullgraph=True)
    _step(runner, cache=cache)
    cache.close()
    with pytest.raises(tba.TBAError, match="no open tensor cache"):
        _step(runner)
    again = tba.configure_tensor_cache(model, **OPTIONS)  # the compiled graph uses this one
    try:
        _step(runner, 1, cache=again)
        assert again.stats().offloaded_bytes > 0 and again.stats().reloaded_bytes > 0
        assert counters["stats"]["unique_graphs"] == 1  # not compiled again
    finally:
        again.close()
    other = tba.configure_tensor_cache(model, **dict(OPTIONS, offload_devices=("cpu", "cuda")))
    try:
        with pytest.raises(tba.TBAError, match="torch.compiler.reset"):
            _step(runner, 2)
    finally:
        other.close()


def test_a_block_compiled_with_tba_inside_an_eager_forward_is_refused() -> None:
    model = models.Stack(num_blocks=2)
    model.blocks[0] = _compiled(model.blocks[0])
    cache = tba.configure_tensor_cache(model, **OPTIONS)
    try:
        with pytest.raises(tba.TBAError, match="inside an eager forward"):
            _step(model)
    finally:
        cache.close()


class _Breaks(torch.nn.Module):
    """A model with a graph break of its own in the middle of its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = models.Stack(num_blocks=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner.embed(x)
        for i, block in enumerate(self.inner.blocks):
            h = block(h)
            if i == 1:
                torch._dynamo.graph_break()
        return self.inner.head(h).pow(2).mean()


def test_graph_breaks_of_the_model_compile_each_graph_with_offload() -> None:
    results = []
    with reports() as rewritten:
        _train_both(results)
    (ref_losses, ref_grads, _), (losses, grads, stats) = results
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert all(torch.equal(a, b) for a, b in zip(ref_grads, grads))
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0
    assert counters["stats"]["unique_graphs"] >= 2
    assert any(r.num_groups for r in rewritten), rewritten


def _train_both(results: list) -> None:
    for with_tba in (False, True):
        dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = _Breaks()
        cache = tba.configure_tensor_cache(model, **OPTIONS) if with_tba else None
        runner = _compiled(model) if with_tba else torch.compile(model, backend="aot_eager")
        losses = [_step(runner, seed, cache) for seed in range(2)]
        results.append((losses, [p.grad.clone() for p in model.parameters()], cache and cache.stats(cumulative=True)))
        if cache is not None:
            cache.close()


@pytest.mark.parametrize("phase", ["store", "load"])
def test_io_errors_are_raised_in_the_training_step(phase: str) -> None:
    offloader = FakeOffloader()
    model = models.Stack(num_blocks=3)
    cache = tba.configure_tensor_cache(model, **dict(OPTIONS, offloader=offloader))
    runner = _compiled(model, fullgraph=True)
    try:
        _step(runner, cache=cache)
        setattr(offloader, f"fail_{phase}", True)
        with pytest.raises(tba.OffloadIOError):
            _step(runner, 1, cache=cache)
            _step(runner, 2, cache=cache)
    finally:
        cache.close()


def test_check_parity_checks_a_compiled_model() -> None:
    batches = [models.vector_batch(seed) for seed in range(3)]
    report = check_parity(models.Stack(num_blocks=3), batches, force=True, compile="tba",
                          compile_options={"inner": "aot_eager"})
    assert report.ok, report
    dynamo.reset()
    compiled = torch.compile(models.Stack(num_blocks=3), backend="tba", options={"inner": "aot_eager"})
    report = check_parity(compiled, batches, force=True, compile_options={"inner": "aot_eager"})
    assert report.ok and report.offloaded_bytes > 0, report


def test_the_policy_moves_the_boundary_at_run_time_without_recompiling() -> None:
    """Budget mode profiles step 1 with every block offloaded, then keeps every block (the
    budget is ample; only what runs before the first block, the embeddings, still goes out,
    as in eager mode): the compiled graph's stores ask the boundary at run time, so the
    decision takes effect with no recompile, and training stays bit-exact."""
    options = dict(offloader="host", keep_last_modules=0, activation_budget_bytes=1 << 40, profile_step=1)
    run = train("gpt2", "aot_eager", options, steps=3)
    assert_same_training(train("gpt2", "aot_eager", None, steps=3), run)
    first, *later = run.step_offloaded
    assert later[0] == later[1] < first / 10, run.step_offloaded
    assert run.decision is not None and run.decision.tail_start == 0, run.decision
    # Each compiled store group was saved under its block's unit: the profile has every
    # block's bytes (the policy decides from them).
    block_bytes = run.decision.block_bytes
    assert len(block_bytes) == run.decision.num_blocks > 1 and all(b > 0 for b in block_bytes), block_bytes
    assert run.num_graphs == 1 and run.breaks == {}


def test_one_graph_for_two_models_offloads_each_into_its_own_cache() -> None:
    """Note [Whose graph is it] (tba/compile/runtime.py): Dynamo runs the graph it compiled
    for one model's block (the models' own graph breaks make it compile the block's frame)
    for every block of every instance; each step goes to its model's cache."""
    first, second = _Breaks(), _Breaks()
    caches = [tba.configure_tensor_cache(m, **OPTIONS) for m in (first, second)]
    try:
        runners = [_compiled(m) for m in (first, second)]
        for runner, cache in zip(runners, caches):
            _step(runner, cache=cache)
        for cache in caches:
            stats = cache.stats(cumulative=True)
            assert stats.num_steps == 1 and stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0
        assert counters["stats"]["unique_graphs"] == 3  # embedding, block, head: shared
    finally:
        for cache in caches:
            cache.close()


def test_an_instance_without_a_cache_running_the_shared_graph_is_refused() -> None:
    """Note [Whose graph is it]: the graph compiled for a configured model also serves another
    instance of its class that has no cache; its steps must not land in the first model's
    cache (they did: the graph fell back to the model it was compiled for)."""
    first, second = _Breaks(), _Breaks()
    cache = tba.configure_tensor_cache(first, **OPTIONS)
    try:
        runners = [_compiled(m) for m in (first, second)]
        _step(runners[0], cache=cache)
        before = cache.stats(cumulative=True)
        with pytest.raises(tba.TBAError, match="another instance of its class that has none"):
            _step(runners[1])
        after = cache.stats(cumulative=True)
        assert (after.num_steps, after.offloaded_bytes) == (before.num_steps, before.offloaded_bytes)
        _step(runners[0], cache=cache)  # the configured model trains on
        assert cache.stats(cumulative=True).num_steps == before.num_steps + 1
    finally:
        cache.close()


def test_graphs_with_offload_stay_out_of_torch_compile_caches() -> None:
    """Note [Rewritten graphs are not cached]: a graph tba rewrites is neither looked up in
    nor written to Inductor's FX graph cache or AOTAutograd's cache (before, the key failed to
    pickle the partitioner: a warning per compile on torch 2.11, a bypass on 2.13)."""
    model = models.Stack(num_blocks=1, width=16)
    cache = tba.configure_tensor_cache(model, **OPTIONS)
    try:
        compiled = torch.compile(model, backend="tba")
        _step(compiled, cache=cache)
        assert cache.stats().offloaded_bytes > 0
    finally:
        cache.close()
    used = {k: v for group in ("inductor", "aot_autograd") for k, v in counters[group].items()
            if "cache" in k}
    assert used == {}, used


@pytest.mark.parametrize(("options", "message"), [
    # Small and off-device (the default offload_devices is CUDA's): the device is what to fix.
    (dict(adaptive=False), r"saves no activation on offload_devices=\('cuda',\)"),
    (dict(offload_devices=("cpu",), adaptive=False),
     r"stores nothing: its \d+ saved activations are each smaller than min_offload_bytes=1048576"),
])
def test_a_graph_that_stores_nothing_says_why(options: dict, message: str) -> None:
    """A configured model whose compiled graph stores nothing (its cache then sees no step:
    stats() and summary() stay empty) warns with the option to change."""
    model = models.Stack(num_blocks=2)
    cache = tba.configure_tensor_cache(model, offloader="host", **options)
    compiled = torch.compile(model, backend="tba", fullgraph=True, options={"inner": "aot_eager"})
    try:
        with pytest.warns(UserWarning, match=message):
            _step(compiled)
        assert cache.stats(cumulative=True).offloaded_bytes == 0
    finally:
        cache.close()


def test_a_graph_that_stores_says_nothing_of_it() -> None:
    model = models.Stack(num_blocks=2)
    cache = tba.configure_tensor_cache(model, **OPTIONS)
    compiled = torch.compile(model, backend="tba", fullgraph=True, options={"inner": "aot_eager"})
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(compiled, cache=cache)
        assert not [w for w in caught if str(w.message).startswith("tba:")], caught
        assert cache.stats(cumulative=True).offloaded_bytes > 0
    finally:
        cache.close()
