"""Train a model compiled with ``backend="tba"`` and the same model compiled without tba."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import tba
from tba.compile import Partitioner
from tba.rok._saved import SavedActivationMeter
from tests import models
from tests.twin import forward_loss

# torch.use_deterministic_algorithms(True) asks cuBLAS (CUDA >= 10.2) for a fixed workspace
# configuration, without which it may raise on a matmul and cuBLAS may split a sum
# differently run to run; cuBLAS reads it once, at its first call in the process, so it is set
# when the tests' helpers are imported (collection), before any test uses CUDA. No effect on CPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

dynamo = torch._dynamo
from torch._dynamo.utils import counters  # noqa: E402


def gpt2(num_layers: int = 3) -> nn.Module:
    model = models.gpt2(num_layers)
    # transformers warns (logging: a graph break under Dynamo) when loss_type is unset.
    model.loss_type = "ForCausalLM"
    return model


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Any]]] = {
    "gpt2": (gpt2, models.lm_batch),
    "fused_attention": (models.FusedAttention, models.sequence_batch),
    "high_rank": (models.HighRank, models.vector_batch),
}

BASE_OPTIONS: dict[str, Any] = dict(offload_devices=("cpu",), min_offload_bytes=0, adaptive=False)


@dataclasses.dataclass
class Run:
    losses: list[torch.Tensor]
    grads: list[list[torch.Tensor | None]]
    breaks: dict[str, int]
    num_graphs: int
    stats: tba.CacheStats | None = None
    summary: str = ""
    reports: list[Any] = dataclasses.field(default_factory=list)
    peak_bytes: int = 0
    step_offloaded: list[int] = dataclasses.field(default_factory=list)
    decision: Any = None


@contextlib.contextmanager
def deterministic(on: bool = True) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(on)`` and Inductor's ``deterministic`` mode for
    the block (torch 2.13 source).

    CPU: Inductor's kernel for an embedding's gradient (GPT-2's ``wte``) adds rows with atomics
    from several threads, so two runs of one compiled model differ in low-order bits; in
    deterministic mode Inductor calls ATen's ``index_put_`` there instead. That holds on CUDA
    too (the Triton kernel would use ``atomic_add``; ATen's CUDA ``index_put_`` accumulates
    sorted indices in order), but there Inductor also picks each Triton reduction's block sizes
    by timing the candidates and may shrink a reduction's block for occupancy, both changing
    the order of a sum; a graph with tba's ops has other kernels than the reference (tba's ops
    split fusions), tuned apart. ``torch._inductor.config.deterministic`` picks configs by
    rule instead and turns the shrinking off (``triton_heuristics``). torch 2.13's
    ``use_deterministic_algorithms`` sets that flag itself (so CPU runs are as before); it is
    set here as well for torch versions whose call does not."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    inductor = torch._inductor.config.patch(deterministic=True) if on else contextlib.nullcontext()
    try:
        with inductor:
            yield
    finally:
        torch.use_deterministic_algorithms(before)


@contextlib.contextmanager
def reports() -> Iterator[list[Any]]:
    """The ``GraphReport`` of every graph tba's backend rewrites while the block runs."""
    found: list[Any] = []
    original = Partitioner.rewrite

    def rewrite(self: Partitioner, *args: Any) -> None:
        original(self, *args)
        found.append(self.reports[-1])

    Partitioner.rewrite = rewrite  # type: ignore[method-assign]
    try:
        yield found
    finally:
        Partitioner.rewrite = original  # type: ignore[method-assign]


@dataclasses.dataclass
class Joint:
    """A joint graph AOTAutograd handed tba's partitioner, to partition and rewrite again."""

    partitioner: Partitioner
    graph: Any
    inputs: Any
    kwargs: dict[str, Any]
    cache: tba.TensorCache

    def partition(self) -> tuple[Any, Any, int]:
        """A fresh min-cut partition (not rewritten): (forward, backward, user outputs)."""
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        fw, bw = min_cut_rematerialization_partition(self.graph, self.inputs, **self.kwargs)
        return fw, bw, self.kwargs["num_fwd_outputs"]


def joint_of(model_name: str, **tba_options: Any) -> Joint:
    """Compile ``model_name`` with ``backend="tba"`` over ``aot_eager`` and keep the joint
    graph and the (open) cache; close ``joint.cache`` when done."""
    dynamo.reset()
    make_model, make_batch = MODELS[model_name]
    torch.manual_seed(0)
    model = make_model()
    cache = tba.configure_tensor_cache(model, **{**BASE_OPTIONS, "offloader": "host", **tba_options})
    found: list[Joint] = []
    original = Partitioner.__call__

    def call(self: Partitioner, gm: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        found.append(Joint(self, gm, joint_inputs, kwargs, cache))
        return original(self, gm, joint_inputs, **kwargs)

    Partitioner.__call__ = call  # type: ignore[method-assign]
    try:
        compiled = torch.compile(model, backend="tba", fullgraph=True, options={"inner": "aot_eager"})
        batch = make_batch(0)
        forward_loss(compiled, batch)
    finally:
        Partitioner.__call__ = original  # type: ignore[method-assign]
    joint = found[0]
    joint.model = model  # type: ignore[attr-defined]  # keeps the model (and its cache) alive
    return joint


def train(model_name: str, inner: str, tba_options: dict[str, Any] | None, *, steps: int = 3,
          settle: bool = True, measure: bool = False, dynamic: bool | None = None,
          batches: Callable[[int], Any] | None = None, device: str = "cpu",
          after_forward: Callable[[tba.TensorCache | None], None] | None = None) -> Run:
    """``steps`` Adam steps of ``model_name`` compiled with ``fullgraph=True``: by ``inner``
    alone (``tba_options`` None) or by ``backend="tba"`` over ``inner`` with a cache made from
    ``tba_options``. With ``settle`` every store completes before backward (so backward reads
    back); with ``measure`` the saved-activation meter of the ROK sweep counts the step. On
    ``device`` (model, batches and ``offload_devices``). ``after_forward(cache)`` runs after
    each forward (and the settle), before its backward."""
    dynamo.reset()
    counters.clear()
    make_model, make_batch = MODELS[model_name]
    make_batch = batches or make_batch
    torch.manual_seed(0)
    model = make_model().to(device)
    cache = None
    if tba_options is not None:
        cache = tba.configure_tensor_cache(model, **{**BASE_OPTIONS, "offload_devices": (device,), **tba_options})
        compiled = torch.compile(model, backend="tba", fullgraph=True, dynamic=dynamic,
                                 options={"inner": inner})
    else:
        compiled = torch.compile(model, backend=inner, fullgraph=True, dynamic=dynamic)
    meter = SavedActivationMeter(model, "cpu") if measure else None
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = Run([], [], {}, 0)
    try:
        with reports() as found, deterministic(inner == "inductor"):
            for step in range(steps):
                optimizer.zero_grad(set_to_none=True)
                torch.manual_seed(step)
                with _measuring(meter, step == steps - 1):
                    batch = _to(make_batch(step), device)
                    loss = forward_loss(compiled, batch)
                    if cache is not None and settle:
                        cache.wait_for_stores(60)
                    if after_forward is not None:
                        after_forward(cache)
                    loss.backward()
                if cache is not None:
                    run.step_offloaded.append(cache.stats().offloaded_bytes)
                run.losses.append(loss.detach())
                run.grads.append([None if p.grad is None else p.grad.clone()
                                  for p in model.parameters()])
                optimizer.step()
        run.reports = found
        if meter is not None:
            run.peak_bytes = meter.peak_bytes
        if cache is not None:
            run.stats = cache.stats(cumulative=True)
            run.summary = cache.summary()
            run.decision = cache.adaptive_decision
    finally:
        if cache is not None:
            cache.close()
    run.breaks = dict(counters["graph_break"])
    run.num_graphs = counters["stats"]["unique_graphs"]
    return run


def _to(batch: Any, device: str) -> Any:
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch.to(device) if isinstance(batch, torch.Tensor) else batch


@contextlib.contextmanager
def _measuring(meter: SavedActivationMeter | None, on: bool) -> Iterator[None]:
    if meter is None or not on:
        yield
        return
    with meter.measuring(), tba.compile.watch(meter.observe):
        yield


def assert_same_training(reference: Run, run: Run) -> None:
    assert len(reference.losses) == len(run.losses)
    for step, (a, b) in enumerate(zip(reference.losses, run.losses)):
        assert torch.equal(a, b), f"step {step}: loss {b.item()} != {a.item()}"
    for step, (grads_a, grads_b) in enumerate(zip(reference.grads, run.grads)):
        for i, (a, b) in enumerate(zip(grads_a, grads_b)):
            assert (a is None) == (b is None), f"step {step}: grad of parameter {i}"
            if a is not None:
                assert torch.equal(a, b), f"step {step}: grad of parameter {i} differs"


def assert_offloaded_in_one_graph(run: Run) -> None:
    """Bytes really went out and came back, in one graph without a break."""
    stats = run.stats
    assert stats is not None
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0, stats
    assert run.breaks == {}, run.breaks
    assert run.num_graphs == 1, run.num_graphs
    assert run.reports and all(report.num_groups > 0 for report in run.reports), run.reports
