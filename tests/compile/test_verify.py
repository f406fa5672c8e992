"""Note [Checked placement] (tba/compile/verify.py): each placement rule broken by hand in a
rewritten graph pair, and the check fails naming it; a planted alias stored twice is caught at
compile time by the check and, with the check out of the way, at run time by the invariant."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import tba
from tba.compile import ops, partition, verify
from tba.compile.partition import rules_for
from tba.compile.plan import StoreGroup, plan_stores
from tba.compile.rewrite import rewrite_backward, rewrite_forward
from tests.compile.training import Joint, joint_of, train


@pytest.fixture(scope="module")
def joint() -> Iterator[Joint]:
    found = joint_of("fused_attention", keep_last_modules=0)
    yield found
    found.cache.close()


def _rewritten(joint: Joint, split_groups: bool = False) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, int]:
    fw, bw, num_outputs = joint.partition()
    groups = plan_stores(fw, num_outputs, rules_for(joint.cache, joint.model))  # type: ignore[attr-defined]
    if split_groups:
        groups = _split(groups)
    swaps = rewrite_forward(fw, groups, num_outputs, graph_id=-1)
    rewrite_backward(bw, swaps, prefetch_modules=1)
    return fw, bw, num_outputs


def _split(groups: list[StoreGroup]) -> list[StoreGroup]:
    """The planted bug: one store per saved tensor, however many view one storage."""
    return [StoreGroup([member], group.after, group.unit, group.module, group.moved if i == 0 else [])
            for group in groups for i, member in enumerate(group.members)]


def _nodes(graph_module: torch.fx.GraphModule, target: object) -> list[torch.fx.Node]:
    return [node for node in graph_module.graph.nodes if node.target is target]


def test_a_correct_rewrite_passes(joint: Joint) -> None:
    fw, bw, num_outputs = _rewritten(joint)
    verify.check_forward(fw, num_outputs)
    verify.check_backward(fw, bw, num_outputs)
    assert any(len(store.args[0]) > 1 for store in _nodes(fw, ops.STORE)), "no aliases to check"


def test_a_store_before_a_later_use_fails(joint: Joint) -> None:
    fw, _, num_outputs = _rewritten(joint)
    for store in _nodes(fw, ops.STORE):
        members = store.args[0]
        defined = max(members, key=list(fw.graph.nodes).index)
        if store.args[1] is None and defined.next is not store:
            defined.append(store)  # right after its tensor is made, before its other uses
            break
    else:
        pytest.fail("no store to move")
    with pytest.raises(AssertionError, match="still used later in forward"):
        verify.check_forward(fw, num_outputs)


def test_an_alias_stored_twice_fails_at_compile_time(joint: Joint) -> None:
    fw, _, num_outputs = _rewritten(joint, split_groups=True)
    with pytest.raises(AssertionError, match="an alias stored twice"):
        verify.check_forward(fw, num_outputs)


def _reload_after_its_first_use(bw: torch.fx.GraphModule) -> None:
    reload = _nodes(bw, ops.RELOAD)[0]
    first = min(reload.users, key=list(bw.graph.nodes).index)
    first.append(reload)


def _prefetch_after_its_reload(bw: torch.fx.GraphModule) -> None:
    prefetch = _nodes(bw, ops.PREFETCH)[0]
    reload = next(user for user in prefetch.users if user.target is ops.RELOAD)
    reload.append(prefetch)


def _carrier_used_as_the_tensor(bw: torch.fx.GraphModule) -> None:
    reload = _nodes(bw, ops.RELOAD)[0]
    (user, *_) = reload.users
    user.replace_input_with(reload, reload.args[1])


@pytest.mark.parametrize(("break_it", "message"), [
    (_reload_after_its_first_use, "comes after its use"),
    (_prefetch_after_its_reload, "not preceded by the prefetch"),
    (_carrier_used_as_the_tensor, "not by a reload"),
])
def test_a_broken_backward_fails(joint: Joint, break_it, message: str) -> None:
    fw, bw, num_outputs = _rewritten(joint)
    break_it(bw)
    with pytest.raises(AssertionError, match=message):
        verify.check_backward(fw, bw, num_outputs)


def test_saved_values_out_of_step_with_backward_fail(joint: Joint) -> None:
    fw, bw, num_outputs = _rewritten(joint)
    output = fw.graph.find_nodes(op="output")[0]
    outputs = list(output.args[0])
    saved = outputs[num_outputs:]
    output.args = (tuple(outputs[:num_outputs] + saved[1:] + saved[:1]),)
    with pytest.raises(AssertionError, match="but backward takes"):
        verify.check_backward(fw, bw, num_outputs)


def test_an_alias_stored_twice_fails_at_run_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the compile-time check out of the way, the run-time invariant (the suite runs with
    TBA_CHECK_INVARIANTS=1) sees two stores of one storage in one forward."""
    planned = partition.plan_stores
    monkeypatch.setattr(partition, "plan_stores", lambda *a, **k: _split(planned(*a, **k)))
    monkeypatch.setattr(verify, "check_forward", lambda *a, **k: None)
    with pytest.raises(tba.TBAError, match="an alias stored twice"):
        train("fused_attention", "aot_eager", dict(offloader="host"), steps=1)
