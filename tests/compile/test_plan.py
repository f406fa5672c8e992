"""Note [What a compiled graph stores] (tba/compile/plan.py): which saved values a compiled
graph stores, grouped by storage, in which unit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tba.compile.partition import rules_for
from tba.compile.plan import normalize_path, plan_stores, storage_key
from tests.compile.training import Joint, joint_of


@pytest.fixture(scope="module")
def gpt2_joint() -> Iterator[Joint]:
    found = joint_of("gpt2")
    yield found
    found.cache.close()


@pytest.mark.parametrize(("raw", "path"), [
    ("L['self'].transformer.h[0]._modules['attn']", "transformer.h.0.attn"),
    ("L['self'].transformer.h.0.ln_1", "transformer.h.0.ln_1"),
    ("L['self']._modules['lm_head']", "lm_head"),
    ("L['self']", ""),
])
def test_module_paths_read_as_named_modules_spells_them(raw: str, path: str) -> None:
    assert normalize_path(raw) == path


def test_groups_are_storages_of_activations(gpt2_joint: Joint) -> None:
    fw, _, num_outputs = gpt2_joint.partition()
    groups = plan_stores(fw, num_outputs, rules_for(gpt2_joint.cache, gpt2_joint.model))  # type: ignore[attr-defined]
    graph = fw.graph
    outputs = list(graph.find_nodes(op="output")[0].args[0])
    inputs = {storage_key(node) for node in graph.find_nodes(op="placeholder")}
    user_outputs = {storage_key(node) for node in outputs[:num_outputs]}
    keys = [storage_key(group.members[0]) for group in groups]
    assert len(set(keys)) == len(keys)  # one group per storage
    for group, key in zip(groups, keys):
        assert {storage_key(member) for member in group.members} == {key}
        assert key not in inputs and key not in user_outputs  # never a parameter or an output
        assert all(member in outputs[num_outputs:] for member in group.members)
    # Every saved activation (computed from the inputs, not a view of an input or an output)
    # is stored.
    computed: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" or any(a in computed for a in node.all_input_nodes):
            computed.add(node)
    saved = [n for n in outputs[num_outputs:] if isinstance(n.meta.get("val"), torch.Tensor)
             and n in computed and storage_key(n) not in inputs | user_outputs]
    assert sum(len(group.members) for group in groups) == len(saved) > 0
    order = {node: i for i, node in enumerate(graph.nodes)}
    assert [order[g.after] for g in groups] == sorted(order[g.after] for g in groups)


def test_groups_belong_to_the_unit_of_their_last_use(gpt2_joint: Joint) -> None:
    """The unit that saves a block's output is the next block (whose first op saves it), as
    in eager mode; everything after the last block is the head."""
    fw, _, num_outputs = gpt2_joint.partition()
    groups = plan_stores(fw, num_outputs, rules_for(gpt2_joint.cache, gpt2_joint.model))  # type: ignore[attr-defined]
    units = [group.unit for group in groups]
    blocks = [u for u in units if u is not None and u.startswith("transformer.h.")]
    assert sorted(set(blocks)) == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    # Stores run in forward order: the block numbers never go back.
    numbers = [int(u.rsplit(".", 1)[1]) for u in blocks]
    assert numbers == sorted(numbers)
    assert units.index("transformer.h.2") < max(i for i, u in enumerate(units) if u in ("lm_head", None))


def test_skip_modules_and_other_devices_store_nothing(gpt2_joint: Joint) -> None:
    fw, _, num_outputs = gpt2_joint.partition()
    rules = rules_for(gpt2_joint.cache, gpt2_joint.model)  # type: ignore[attr-defined]
    skipping = type(rules)(rules.devices, rules.unit_of, lambda path: path.startswith("transformer.h.1"))
    kept = {g.unit for g in plan_stores(fw, num_outputs, skipping)}
    assert "transformer.h.1" not in kept and "transformer.h.0" in kept
    assert plan_stores(fw, num_outputs, type(rules)(frozenset({"cuda"}), rules.unit_of, rules.skipped)) == []
