"""What the backward rewrite hands Inductor: reloads it may reuse only where plain Inductor could
reuse the saved tensor (Note [Stored buffers are not reused] in tba/compile/lowering.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tba.compile import lowering, ops
from tba.compile.partition import rules_for
from tba.compile.plan import plan_stores
from tba.compile.rewrite import rewrite_backward, rewrite_forward
from tests.compile.training import Joint, joint_of


@pytest.fixture(scope="module")
def joint() -> Iterator[Joint]:
    found = joint_of("fused_attention", keep_last_modules=0)
    yield found
    found.cache.close()


def _backward(joint: Joint) -> tuple[torch.fx.GraphModule, list[torch.fx.Node]]:
    fw, bw, num_outputs = joint.partition()
    groups = plan_stores(fw, num_outputs, rules_for(joint.cache, joint.model))  # type: ignore[attr-defined]
    reusable = lowering.reusable_saved(fw, bw, num_outputs)
    swaps = rewrite_forward(fw, groups, num_outputs, graph_id=-1)
    rewrite_backward(bw, swaps, prefetch_modules=1, reusable=reusable)
    return bw, [node for node in bw.graph.nodes if node.target is ops.RELOAD]


def test_only_reloads_plain_inductor_could_reuse_are_left_to_reuse(joint: Joint) -> None:
    """FusedAttention saves q, k^T and v, views of one storage, as one group: their reloads
    return views of one buffer and stay out of reuse; a lone member whose saved tensor AOTAutograd
    would donate is left to reuse."""
    bw, reloads = _backward(joint)
    marked = {node.name for node in reloads if node.meta.get(lowering.REUSABLE)}
    shared = {node.name for node in reloads if node.args[2] != 0 or any(
        other is not node and other.args[0] is node.args[0] for other in reloads)}
    assert shared, "no group with several members: nothing checked"
    assert marked, "no reload left to reuse"
    assert not marked & shared, f"reloads of a shared storage left to reuse: {sorted(marked & shared)}"
