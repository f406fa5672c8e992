"""Kernel identity, the goal of backend="tba" under Inductor: the kernels Inductor generates with
``backend="inductor"``, tba's ops aside, which is what would carry bit-exactness to devices CI
cannot run. Not reached (the test says so, strictly): the rewritten graphs are compiled without
buffer reuse and in-place buffers (Note [Stored buffers are not reused] in
tba/compile/compiler.py), and tba's stores, reloads and prefetches are extern kernels whose
ordering (store chain, reload and prefetch anchors) changes where Inductor fuses. Measured on
torch 2.13 CPU, one training step, backend="inductor" vs "tba": GPT-2 3 x 32 forward 15 vs 19
kernels, backward 9 vs 21; FusedAttention 7 vs 8 and 13 vs 11; even with reuse on (and the
stored buffers held to the graph's end) both stay apart."""

from __future__ import annotations

import collections
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


def _step_code(model_name: str, backend: str) -> list[str]:
    """Inductor's output code of one training step: forward, then backward."""
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
    return list(codes)


def _step_kernels(model_name: str, backend: str) -> collections.Counter[tuple[str, str]]:
    found = collections.Counter(kernel for code in _step_code(model_name, backend)
                                for kernel in kernels(code))
    assert found, "no C++ kernel found in Inductor's output code"
    return found


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="tba's ops change where Inductor fuses (module docstring)")
@pytest.mark.parametrize("model_name", ["gpt2", "fused_attention"])
def test_tba_keeps_inductors_kernels(model_name: str) -> None:
    """GPT-2 (tied embedding and head) and a model whose saved q, k^T and v view one storage:
    one training step's kernels, forward and backward, as a multiset."""
    reference = _step_kernels(model_name, "inductor")
    found = _step_kernels(model_name, "tba")
    missing, extra = reference - found, found - reference
    assert not missing and not extra, (
        f"backend='tba' changed Inductor's kernels: {sum(missing.values())} of "
        f"{sum(reference.values())} missing, {sum(extra.values())} new; first missing:\n"
        + "\n".join(source for _, source in list(missing)[:1]))
