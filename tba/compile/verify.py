"""Structural checks of a rewritten forward/backward pair, run after every rewrite.

Note [Checked placement]: a wrong placement gives right gradients more often than not (a
store before a later use reads a tensor nothing writes; a reload hoisted to the start of
backward only costs memory), so the rewrite is checked, on every compile, against the rules
of Note [What a compiled graph stores] and Note [Placing stores, prefetches and reloads]:
  * forward: every use of a stored storage (through any view) comes before its store; no
    storage is stored twice (alias identity is the fake tensors' storage); nothing stored
    views a graph input or a user-visible output; the stores run in index order, each taking
    the previous one's key, the last one marked last;
  * backward: the saved values of the forward are, in order, the first placeholders of the
    backward; a key or carrier feeds tba's ops only; every member's reload comes before every
    use of what it returns, and after the prefetch that started its load.
A violation is a tba bug: ``AssertionError`` naming the nodes, at compile time. Tested by
tests/compile/test_verify.py (each rule broken by hand) and by every compile in the tests.
"""

from __future__ import annotations

import operator
from typing import NoReturn

import torch
from torch import fx

from tba.compile import ops
from tba.compile.plan import reads, storage_key

__all__ = ["check_forward", "check_backward"]


def _fail(message: str) -> NoReturn:
    raise AssertionError(f"tba bug: {message} (Note [Checked placement] in tba/compile/verify.py)")


def check_forward(fw: fx.GraphModule, num_fwd_outputs: int) -> None:
    graph = fw.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    stores = [node for node in graph.nodes if node.target is ops.STORE]
    output = graph.find_nodes(op="output")[0]
    outputs = list(output.args[0])
    excluded = {storage_key(n) for n in graph.find_nodes(op="placeholder")}
    excluded |= {storage_key(n) for n in outputs[:num_fwd_outputs] if isinstance(n, fx.Node)}
    excluded.discard(None)
    viewers: dict[object, list[fx.Node]] = {}
    for node in graph.nodes:
        key = storage_key(node)
        if key is not None and not _is_ours(node):
            viewers.setdefault(key, []).append(node)
    stored: dict[object, fx.Node] = {}
    previous_key: fx.Node | None = None
    for index, store in enumerate(stores):
        members, chain, number, *_, last = store.args
        if number != index or chain is not previous_key or last != (index == len(stores) - 1):
            _fail(f"{store.name} is store {number} after {chain}, expected store {index} "
                  f"after {previous_key}")
        keys = {storage_key(member) for member in members}
        if len(keys) != 1 or len(members) != len(set(members)):
            _fail(f"{store.name} stores {len(keys)} storages in one group")
        key = keys.pop()
        if key is None:
            _fail(f"{store.name} stores a value that is no tensor")
        if key in excluded:
            _fail(f"{store.name} stores a view of a graph input or of a user output")
        if key in stored:
            _fail(f"{store.name} stores a storage {stored[key].name} already stored (an alias "
                  "stored twice)")
        stored[key] = store
        for viewer in viewers.get(key, []):
            for user in viewer.users:
                if reads(user, key) and not _is_ours(user) and order[user] > order[store]:
                    _fail(f"{store.name} stores {viewer.name}, still used later in forward by "
                          f"{user.name}")
        previous_key = next(u for u in store.users if u.args[1] == 0)


def _is_ours(node: fx.Node) -> bool:
    if node.target in ops.OPS:
        return True
    parent = node.args[0] if node.target is operator.getitem and node.args else None
    return isinstance(parent, fx.Node) and parent.target in ops.OPS


def check_backward(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
    outputs = list(fw.graph.find_nodes(op="output")[0].args[0])[num_fwd_outputs:]
    placeholders = list(bw.graph.find_nodes(op="placeholder"))
    # Backward takes the saved tensors in the order forward saves them (the saved symbolic
    # sizes of a dynamic graph come before them).
    tensors = [node.name for node in outputs
               if isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)]
    names = set(tensors)
    given = [node.name for node in placeholders if node.name in names]
    if tensors != given:
        _fail(f"forward saves {tensors} but backward takes {given}")
    order = {node: i for i, node in enumerate(bw.graph.nodes)}
    ours = {node.name for node in outputs if isinstance(node, fx.Node) and _is_ours(node)}
    for placeholder in placeholders:
        if placeholder.name not in ours:
            continue
        for user in placeholder.users:
            if user.target not in (ops.RELOAD, ops.PREFETCH):
                _fail(f"{placeholder.name} is used by {user.name}, not by a reload")
    for reload in bw.graph.nodes:
        if reload.target is not ops.RELOAD:
            continue
        for user in reload.users:
            if order[user] < order[reload]:
                _fail(f"{reload.name} comes after its use by {user.name}")
        marker = reload.args[4]
        if marker is not None and (marker.target is not ops.PREFETCH or order[marker] > order[reload]
                                   or reload.args[0] not in marker.args[0]):
            _fail(f"{reload.name} is not preceded by the prefetch of its group")
