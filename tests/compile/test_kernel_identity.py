"""Kernel identity, the goal of backend="tba" under Inductor: the kernels Inductor generates with
``backend="inductor"``, tba's ops aside, which is what would carry bit-exactness to devices CI
cannot run. Inductor's buffer reuse and in-place buffers stay on, the buffers the cache reads
after an op are kept out of reuse (Note [Stored buffers are not reused] in
tba/compile/lowering.py), and forward and backward are planned as plain Inductor plans them,
tba's ops then placed between Inductor's runs of kernels (Notes [Forward in plain Inductor's
order] and [Backward in plain Inductor's order] in tba/compile/scheduling.py), and a value a store
takes is realized where Inductor realizes a graph output (Note [Stored values are realized as
outputs] in tba/compile/lowering.py). Checked for FusedAttention (a model whose saved q, k^T and
v view one storage) and GPT-2 (tied embedding and head), forward and backward."""

from __future__ import annotations

import collections
import functools
import re
import pytest
import torch
from torch._inductor.utils import run_and_get_code

import tba
from tests.compile.training import BASE_OPTIONS, MODELS
from tests.twin import forward_loss

# A C++ kernel in Inductor's output code: its name, argument types and source.
_KERNEL = re.compile(
    r"^(cpp_fused_\w+) = async_compile\.cpp_pybinding\((\[[^\]]*\]), r'''(.*?)'''\)", re.M | re.S)


def kernels(code: str) -> list[tuple[str, str]]:
    """The (argument types, source) of each fused C++ kernel of one output code. The kernel's
    name (``cpp_fused_<ops>_<n>``: numbered in graph order, named after the FX ops fused into
    it) is left out: the source is ``extern "C" void kernel(...)`` whatever the name, and its
    buffers are positional (``in_ptr0``, ``out_ptr1``, ``in_out_ptr0``), so an in-place buffer
    or a split fusion still shows."""
    return [(types, source.strip()) for _, types, source in _KERNEL.findall(code)]


@functools.cache
def _step_code(model_name: str, backend: str) -> tuple[str, ...]:
    """Inductor's output code of one training step: forward, then backward (once a process:
    the forward and backward tests share it)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    make_model, make_batch = MODELS[model_name]
    model = make_model()
    cache = None
    if backend == "tba":
        cache = tba.configure_tensor_cache(
            model, **dict(BASE_OPTIONS, offloader="host", keep_last_modules=0))
    compiled = torch.compile(model, backend=backend, fullgraph=True)

    def step() -> None:
        forward_loss(compiled, make_batch(0)).backward()

    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            _, codes = run_and_get_code(step)
        if cache is not None:
            assert cache.stats().offloaded_bytes > 0, "nothing offloaded: no tba op ran"
    finally:
        if cache is not None:
            cache.close()
        torch._dynamo.reset()
    assert len(codes) == 2, f"expected a forward and a backward output code, got {len(codes)}"
    if backend == "tba":
        assert "torch.ops.tba.store" in codes[0]
        assert "torch.ops.tba.reload" in codes[1]
    return tuple(codes)


def _graph_kernels(model_name: str, backend: str,
                   graph: int) -> collections.Counter[tuple[str, str]]:
    found = collections.Counter(kernels(_step_code(model_name, backend)[graph]))
    assert found, "no C++ kernel found in Inductor's output code"
    return found


@pytest.mark.parametrize(("model_name", "graph"), [
    ("fused_attention", 0),
    ("fused_attention", 1),
    ("gpt2", 0),
    ("gpt2", 1),
], ids=["fused_attention-forward", "fused_attention-backward", "gpt2-forward", "gpt2-backward"])
def test_tba_keeps_inductors_kernels(model_name: str, graph: int) -> None:
    """GPT-2 (tied embedding and head) and a model whose saved q, k^T and v view one storage:
    one training step's kernels of the forward (``graph`` 0) or backward (1) graph, as a
    multiset."""
    reference = _graph_kernels(model_name, "inductor", graph)
    found = _graph_kernels(model_name, "tba", graph)
    missing, extra = reference - found, found - reference
    assert not missing and not extra, (
        f"backend='tba' changed Inductor's kernels: {sum(missing.values())} of "
        f"{sum(reference.values())} missing, {sum(extra.values())} new; first missing:\n"
        + "\n".join(source for _, source in list(missing)[:1]))
