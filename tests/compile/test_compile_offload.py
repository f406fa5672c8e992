"""``torch.compile(model, backend="tba", fullgraph=True)`` (Note [Offload inside the compiled
graph] in tba/compile/__init__.py): losses and every gradient equal those of the same model
compiled without tba, bytes really go out and come back, one graph, no break, and the
saved-activation peak of the ROK sweep's measure falls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests import models
from tests.compile.training import assert_offloaded_in_one_graph, assert_same_training, train

_REFERENCES: dict[tuple[str, str], Any] = {}


def _reference(model: str, inner: str) -> Any:
    """The model compiled by ``inner`` alone (once per module: every offloader compares
    with it)."""
    key = (model, inner)
    if key not in _REFERENCES:
        _REFERENCES[key] = train(model, inner, None)
    return _REFERENCES[key]


def _offloader(name: str, tmp_path: Path) -> dict[str, Any]:
    options: dict[str, Any] = dict(offloader=name)
    if name in ("ssd", "host+ssd"):
        options.update(ssd_dirs=(str(tmp_path),), ssd_engine="posix")
    if name == "host+ssd":
        options.update(host_budget_bytes=16 << 10)  # some tensors in the pool, the rest on SSD
    return options


# The everyday suite runs the small model with aot_eager; Inductor and GPT-2 are slow.
_MATRIX = [
    pytest.param(inner, model, offloader, id=f"{inner}-{model}-{offloader}",
                 marks=[pytest.mark.slow] if inner == "inductor" or model == "gpt2" else [])
    for inner in ("aot_eager", "inductor") for model in ("fused_attention", "gpt2")
    for offloader in ("host", "ssd", "host+ssd")
]


@pytest.mark.parametrize(("inner", "model", "offloader"), _MATRIX)
def test_bit_exact_offloading_in_one_graph(inner: str, model: str, offloader: str, tmp_path: Path) -> None:
    """Three Adam steps equal to ``backend=inner`` without tba, stores settled so bytes go out
    and come back (host+ssd: through both tiers), one graph, no graph break."""
    run = train(model, inner, _offloader(offloader, tmp_path))
    assert_same_training(_reference(model, inner), run)
    assert_offloaded_in_one_graph(run)
    if offloader == "host+ssd":
        assert set(run.stats.tiers) == {"host", "ssd"}, run.stats.tiers
        assert all(t.stored_bytes > 0 for t in run.stats.tiers.values()), run.stats.tiers


@pytest.mark.gpu
@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("offloader", ["host", "ssd"])
def test_bit_exact_offloading_in_one_graph_on_cuda(inner: str, offloader: str, tmp_path: Path) -> None:
    """The same on the GPU: tba's ops run on CUDA tensors (stores from the compiled graph's
    stream, reloads before their first use), GPT-2 three Adam steps equal to ``backend=inner``."""
    reference = train("gpt2", inner, None, device="cuda")
    # The reference must repeat itself bit for bit (deterministic() in training.py: Inductor
    # tunes Triton reductions by timing unless told not to); a failure here is torch's, not
    # tba's.
    assert_same_training(reference, train("gpt2", inner, None, device="cuda"))
    run = train("gpt2", inner, _offloader(offloader, tmp_path), device="cuda")
    assert_same_training(reference, run)
    assert_offloaded_in_one_graph(run)


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_activations_whose_sizes_and_strides_overflow_int64_as_dims(inner: str) -> None:
    """A saved activation whose sizes and strides multiply past 2**63 (as GPT-2's do at
    hidden 2048, batch 32) compiles and trains bit-exact: its shape carrier has those values as
    dims, which contiguous strides cannot describe (Note [Keys and shape carriers]; was
    "Stride calculation overflowed" while compiling)."""
    run = train("high_rank", inner, dict(offloader="host"))
    assert_same_training(_reference("high_rank", inner), run)
    assert_offloaded_in_one_graph(run)


def test_aliases_are_stored_once() -> None:
    """q, k^T and v view one storage: one store op, one entry, the other members deduplicated
    against it (Note [What a compiled graph stores])."""
    run = train("fused_attention", "aot_eager", dict(offloader="host", keep_last_modules=0))
    (report,) = run.reports
    assert report.num_members > report.num_groups, report
    assert run.stats.num_deduplicated == 3 * (report.num_members - report.num_groups), run.stats


def _peaks(inner: str) -> tuple[int, int]:
    keep = train("gpt2", inner, None, steps=2, measure=True, batches=_long_batch)
    run = train("gpt2", inner, dict(offloader="host", prefetch_modules=1, max_inflight_bytes=1),
                steps=2, measure=True, batches=_long_batch)
    assert_same_training(keep, run)
    return keep.peak_bytes, run.peak_bytes


def _long_batch(seed: int) -> dict:
    return models.lm_batch(seed)


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_saved_activation_peak_at_most_half_of_compiled_keep(inner: str) -> None:
    """The ROK sweep's measure (Note [One measure of activation memory] in tba/rok/_saved.py):
    every storage saved for backward counted while it lives in training memory, the stores'
    and reloads' included. Every block but the last offloaded; one store in flight at a time
    (``max_inflight_bytes=1``) so the peak does not depend on how fast the store thread runs."""
    keep, offload = _peaks(inner)
    assert keep > 0 and offload <= 0.5 * keep, (offload, keep, offload / keep)


def test_dynamic_shapes_and_recompiles_keep_offloading() -> None:
    """A new batch size recompiles (then Dynamo marks the size dynamic): every graph is
    rewritten, backward binds the dynamic sizes from the shape carriers (Note [Keys and shape
    carriers]), results stay bit-exact."""
    def batches(seed: int) -> torch.Tensor:
        return models.sequence_batch(seed)[: 4 - seed % 3]

    reference = train("fused_attention", "aot_eager", None, steps=4, batches=batches)
    run = train("fused_attention", "aot_eager", dict(offloader="host"), steps=4, batches=batches)
    assert_same_training(reference, run)
    assert len(run.reports) == 2 and all(r.num_groups for r in run.reports), run.reports
    assert run.stats.offloaded_bytes > 0 and run.stats.reloaded_bytes > 0
    assert run.breaks == {}


@pytest.mark.slow
def test_dynamic_true_bit_exact() -> None:
    reference = train("fused_attention", "aot_eager", None, dynamic=True)
    run = train("fused_attention", "aot_eager", dict(offloader="host"), dynamic=True)
    assert_same_training(reference, run)
    assert run.stats.offloaded_bytes > 0 and run.stats.reloaded_bytes > 0


def test_a_units_small_stores_leave_its_batch_when_the_next_unit_begins() -> None:
    """Note [Small transfers in batches]: small CPU stores wait in the engine's pending batch
    until the unit that saved them ends, then go together; in eager mode the unit's post-hook
    stores the batch. Under backend="tba" the store that enters the next unit does: no entry of
    an earlier unit still waits in the batch when a store of a later unit saves (before, the
    batch waited for 1 MiB or the forward's end, holding the memory)."""
    import tba

    model = models.gpt2(3)
    model.loss_type = "ForCausalLM"
    cache = tba.configure_tensor_cache(
        model, offloader="host", offload_devices=("cpu",), min_offload_bytes=0,
        keep_last_modules=0, adaptive=False)
    compiled = torch.compile(model, backend="tba", fullgraph=True, options={"inner": "aot_eager"})
    engine, tracker = cache._engine, cache._saved.tracker
    stale: list[tuple[Any, Any]] = []
    scopes: list[Any] = []

    def observe(tensor: torch.Tensor, kind: str) -> None:
        if kind == "saved":
            scope = tracker.local.forward.scope()
            if not scopes or scopes[-1] is not scope:
                scopes.append(scope)
            stale.extend((entry.scope, scope) for entry in engine._batch if entry.scope is not scope)

    try:
        for seed in range(2):
            with tba.compile.watch(observe):
                compiled(**models.lm_batch(seed)).loss.backward()
        stats = cache.stats(cumulative=True)
    finally:
        cache.close()
    assert len(scopes) >= 6, "the stores saw fewer units than the model's blocks"
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0, stats
    assert not stale, f"{len(stale)} saves found an earlier unit's entries waiting in the batch"
