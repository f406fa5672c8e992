"""torch.compile with tba (Note [tba under torch.compile]): per-block compile bit-exact and
offloading block by block as in eager, whole-model compile breaking only at tba's units,
``fullgraph=True`` refused with a TBAError naming the per-block recipe."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tba
from tba import _torch_compat as compat
from tba.testing import probe
from tests import models

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402

NUM_BLOCKS = 3
OPTIONS = dict(offloader="host", offload_devices=("cpu",), min_offload_bytes=0, adaptive=False)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    dynamo.reset()
    counters.clear()
    yield
    dynamo.reset()


def build(recipe: str, with_tba: bool, backend: str, fullgraph: bool = False) -> tuple[Any, Any]:
    """The model compiled by ``recipe`` ("eager": not at all), with a cache if ``with_tba``
    (configured where the recipe says: after wrapping blocks, before compiling in place)."""
    torch.manual_seed(0)
    model = models.Stack(num_blocks=NUM_BLOCKS)
    cache = None
    if recipe == "wrap":  # torchtitan's way: blocks replaced by compiled wrappers, then tba
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=backend, fullgraph=fullgraph)
    if with_tba:
        cache = tba.configure_tensor_cache(model, **OPTIONS)
    if recipe == "in_place":  # block.compile() after configuring
        for block in model.blocks:
            block.compile(backend=backend, fullgraph=fullgraph)
    runner = torch.compile(model, backend=backend, fullgraph=fullgraph) if recipe == "whole" else model
    return runner, cache


def train(recipe: str, with_tba: bool, backend: str = "aot_eager", fullgraph: bool = False,
          steps: int = 3) -> dict:
    """Three Adam steps; every store completes before backward, so backward reads back.

    Dynamo's caches are reset first: code compiled for a model without tba's hooks would be
    reused for one with them (Dynamo does not guard on module hooks by default), and the
    hooks would never run."""
    dynamo.reset()
    counters.clear()
    runner, cache = build(recipe, with_tba, backend, fullgraph)
    saves: list = []
    watch = probe(cache).watch_saves() if cache is not None else contextlib.nullcontext(saves)
    params = list(runner.parameters())
    optimizer = torch.optim.Adam(params, lr=1e-3)
    losses, grads = [], []
    try:
        with watch as saves:
            run_steps(runner, cache, optimizer, params, steps, losses, grads)
    finally:
        if cache is not None:
            cache.close()
    marked = {s.units[-1] if s.units else "model" for s in saves if s.new_entry and s.offloaded}
    return {
        "losses": losses, "grads": grads, "marked": marked,
        "stats": cache.stats(cumulative=True) if cache is not None else None,
        "breaks": dict(counters["graph_break"]),
    }


def run_steps(runner, cache, optimizer, params, steps, losses, grads) -> None:
    """Adam steps; every store completes before backward, so backward reads back."""
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        loss = runner(models.vector_batch(step))
        if cache is not None:
            cache.wait_for_stores(60)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in params])
        optimizer.step()


def assert_same_training(reference: dict, run: dict) -> None:
    for step, (a, b) in enumerate(zip(reference["losses"], run["losses"])):
        assert torch.equal(a, b), f"step {step}: loss {b.item()} != {a.item()}"
    for step, (ga, gb) in enumerate(zip(reference["grads"], run["grads"])):
        for i, (a, b) in enumerate(zip(ga, gb)):
            assert torch.equal(a, b), f"step {step}: grad of parameter {i} differs"


def eager_marked() -> set[str]:
    return train("eager", True, steps=1)["marked"]


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks-allowed", "fullgraph"])
@pytest.mark.parametrize("recipe", ["wrap", "in_place"])
def test_per_block_compile_bit_exact_offloading_block_by_block(recipe: str, fullgraph: bool) -> None:
    traced_before = compat.num_traced_hooks
    reference = train(recipe, False, fullgraph=fullgraph)
    run = train(recipe, True, fullgraph=fullgraph)
    assert_same_training(reference, run)
    stats = run["stats"]
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0, stats
    # Each block's saved tensors reached tba while that block's scope was open, as in eager:
    # the embedding and every block but the kept tail were offloaded.
    assert run["marked"] == eager_marked() == {"embed", "blocks.0", "blocks.1"}
    # tba's hooks ran outside the compiled blocks: Dynamo never traced them, nothing broke.
    assert run["breaks"] == {}, run["breaks"]
    assert compat.num_traced_hooks == traced_before


@pytest.mark.slow
def test_per_block_inductor_fullgraph_bit_exact() -> None:
    reference = train("wrap", False, backend="inductor", fullgraph=True)
    run = train("wrap", True, backend="inductor", fullgraph=True)
    assert_same_training(reference, run)
    assert run["stats"].offloaded_bytes > 0 and run["stats"].reloaded_bytes > 0
    assert run["marked"] == {"embed", "blocks.0", "blocks.1"}


def test_whole_model_compile_breaks_only_at_tba_units_and_says_so_once() -> None:
    reference = train("whole", False)
    assert reference["breaks"] == {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = train("whole", True)
    assert_same_training(reference, run)
    assert run["stats"].offloaded_bytes > 0 and run["stats"].reloaded_bytes > 0
    assert run["marked"] == {"embed", "blocks.0", "blocks.1"}
    # Every graph break is tba's deliberate one at a unit's hook; none comes from inside a
    # hook body, the saved-tensor hooks or anything they call.
    breaks = run["breaks"]
    assert breaks, "tba's hooks were expected to break the whole-model graph"
    assert all("call_outside_compile" in reason for reason in breaks), breaks
    with tba.configure_tensor_cache(models.Stack(num_blocks=NUM_BLOCKS)) as probe:
        num_units = len(probe.units)  # embed, the blocks, head
    assert sum(breaks.values()) <= 2 * (num_units + 1), breaks
    notes = [str(w.message) for w in caught if "runs under torch.compile" in str(w.message)]
    assert len(notes) == 1, notes
    assert "pytorch#148222" in notes[0] and "torch.compile(block)" in notes[0]
    assert 'backend="tba"' in notes[0]


def test_whole_model_fullgraph_fails_at_first_forward_with_the_recipe() -> None:
    runner, cache = build("whole", True, "aot_eager", fullgraph=True)
    try:
        with pytest.raises(tba.TBAError) as info:
            runner(models.vector_batch(0))
    finally:
        cache.close()
    message = str(info.value)
    assert message.startswith("tba: torch.compile(..., fullgraph=True)")
    assert "torch.compile(block, fullgraph=True)" in message and "configure_tensor_cache" in message
    assert "docs/integrations.md" in message and 'backend="tba"' in message
