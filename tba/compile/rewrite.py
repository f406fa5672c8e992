"""Put tba's ops into a partitioned forward and backward graph pair.

Note [Placing stores, prefetches and reloads]: forward: each group's ``tba::store`` goes after
the group's last forward use (``StoreGroup.after``; a later group's store never goes before
an earlier one's: the stores run in graph order), and the graph saves, in each member's place,
the group's key (before its first member) and the member's shape carrier. Backward: the
placeholders follow suit (the partitioner gives them the saved values' names and order), and
each member's ``tba::reload`` goes right before its first use (Inductor's scheduler keeps it
there: Note [Backward in plain Inductor's order] in scheduling.py). Prefetch works in units,
as eager mode's ``prefetch_modules`` does: the groups, in the order backward first needs them, form runs of
one unit each; the loads of run ``j`` start (one ``tba::prefetch`` for them) where run
``j - prefetch_modules`` begins, the first runs' at the first reload. Every reload of a
prefetched group takes that prefetch's marker, so the load is started before it is waited
for, whatever order a scheduler picks. Checked by verify.py after every rewrite.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch import fx

from tba.compile import lowering, ops
from tba.compile.plan import StoreGroup

__all__ = ["Swap", "rewrite_forward", "rewrite_backward"]


@dataclasses.dataclass
class Swap:
    """One stored group after the forward rewrite.

    Attributes:
        group: what was stored.
        index: the store's position among the graph's stores.
        key: the forward node of the group's key.
        carriers: the forward nodes of the members' shape carriers (member order).
    """

    group: StoreGroup
    index: int
    key: fx.Node
    carriers: list[fx.Node]


def _fake_mode(node: fx.Node) -> Any:
    return node.meta["val"].fake_mode


def _call(graph: fx.Graph, target: Any, args: tuple[Any, ...], name: str, value: Any) -> fx.Node:
    node = graph.create_node("call_function", target, args, name=name)
    node.meta["val"] = value
    return node


def rewrite_forward(fw: fx.GraphModule, groups: list[StoreGroup], num_fwd_outputs: int,
                    graph_id: int, late: bool = False) -> list[Swap]:
    """Insert the stores (Note [Placing stores, prefetches and reloads]) and save keys and
    carriers instead of the members; with ``late``, every store at the graph's end (Note
    [Forward in plain Inductor's order] in scheduling.py)."""
    graph = fw.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    swaps: list[Swap] = []
    end = graph.find_nodes(op="output")[0].prev
    previous_end: fx.Node | None = None
    chain: fx.Node | None = None
    for index, group in enumerate(groups):
        after = end if late and previous_end is None else group.after
        if previous_end is not None and (late or order[after] <= order[previous_end]):
            after = previous_end  # a later store never runs before an earlier one
        slot = order[after]
        for node in [] if late else group.moved:  # views only backward needs, up to the store
            after.append(node)
            after = node
            order[node] = slot
        values = [member.meta["val"] for member in group.members]
        last = index == len(groups) - 1
        marker, marker_path = group.marker or (None, None)
        args = (list(group.members), chain, index, graph_id, group.module, marker, marker_path, last)
        with _fake_mode(group.members[0]):
            outputs = ops._store_fake(values, None, index, graph_id, None, None, None, last)
        with graph.inserting_after(after):
            store = _call(graph, ops.STORE, args, f"tba_store_{index}", outputs)
        fakes = (values, None, index, graph_id, group.module,
                 marker.meta["val"] if marker is not None else None, marker_path, last)
        store.meta["eager_input_vals"] = (fakes, {})
        items = []
        cursor = store
        for i, value in enumerate(outputs):
            name = f"tba_key_{index}" if i == 0 else f"tba_shape_{group.members[i - 1].name}"
            with graph.inserting_after(cursor):
                cursor = _call(graph, operator.getitem, (store, i), name, value)
            items.append(cursor)
        order[store] = order[cursor] = slot  # one slot: ties resolve to insertion order
        previous_end = cursor
        chain = items[0]
        swaps.append(Swap(group, index, items[0], items[1:]))
    output = graph.find_nodes(op="output")[0]
    outputs_in = list(output.args[0])
    replaced = {m: (swap, i) for swap in swaps for i, m in enumerate(swap.group.members)}
    saved_out: list[Any] = []
    keyed: set[int] = set()
    for node in outputs_in[num_fwd_outputs:]:
        found = replaced.get(node) if isinstance(node, fx.Node) else None
        if found is None:
            saved_out.append(node)
            continue
        swap, i = found
        if swap.index not in keyed:
            keyed.add(swap.index)
            saved_out.append(swap.key)
        saved_out.append(swap.carriers[i])
    output.args = (tuple(outputs_in[:num_fwd_outputs] + saved_out),)
    graph.lint()
    fw.recompile()
    return swaps


def rewrite_backward(bw: fx.GraphModule, swaps: list[Swap], prefetch_modules: int,
                     reusable: frozenset[str] = frozenset()) -> None:
    """Replace the members' placeholders by keys, carriers and reloads, and add the
    prefetches (Note [Placing stores, prefetches and reloads]). The reload of a member named
    in ``reusable``, alone in its group, is marked so Inductor may reuse its output (Note
    [Stored buffers are not reused] in lowering.py)."""
    graph = bw.graph
    position = {node: i for i, node in enumerate(graph.nodes)}
    placeholders = {node.name: node for node in graph.find_nodes(op="placeholder")}
    # (swap, member index, placeholder, first user or None)
    members: list[tuple[Swap, int, fx.Node, fx.Node | None]] = []
    keys: dict[int, fx.Node] = {}
    for swap in swaps:
        for i, member in enumerate(swap.group.members):
            placeholder = placeholders.get(member.name)
            if placeholder is None:
                raise AssertionError(f"tba bug: backward has no input for saved {member.name!r}")
            with graph.inserting_before(placeholder):
                if swap.index not in keys:
                    keys[swap.index] = _placeholder(graph, swap.key)
                carrier = _placeholder(graph, swap.carriers[i])
            swap.carriers[i] = carrier
            users = sorted(placeholder.users, key=position.__getitem__)
            members.append((swap, i, placeholder, users[0] if users else None))
    markers = _insert_prefetches(graph, members, keys, position, prefetch_modules)
    for swap, i, placeholder, first in members:
        if first is not None:
            value = placeholder.meta["val"]
            args = (keys[swap.index], swap.carriers[i], i, value.dim(), markers.get(swap.index))
            with graph.inserting_before(first):
                reload = _call(graph, ops.RELOAD, args, f"tba_reload_{placeholder.name}", value)
            if len(swap.group.members) == 1 and placeholder.name in reusable:
                reload.meta[lowering.REUSABLE] = True
            placeholder.replace_all_uses_with(reload)
        graph.erase_node(placeholder)
    graph.lint()
    bw.recompile()


def _placeholder(graph: fx.Graph, forward_node: fx.Node) -> fx.Node:
    node = graph.placeholder(forward_node.name)
    node.meta["val"] = forward_node.meta["val"]
    return node


def _insert_prefetches(
    graph: fx.Graph,
    members: list[tuple[Swap, int, fx.Node, fx.Node | None]],
    keys: dict[int, fx.Node],
    position: dict[fx.Node, int],
    prefetch_modules: int,
) -> dict[int, fx.Node]:
    """One ``tba::prefetch`` per run of units (see the Note); returns the marker node each
    prefetched group's reloads take, by store index."""
    if prefetch_modules <= 0:
        return {}
    first_use: dict[int, fx.Node] = {}
    units: dict[int, str | None] = {}
    for swap, _, _, first in members:
        if first is None:
            continue
        current = first_use.get(swap.index)
        if current is None or position[first] < position[current]:
            first_use[swap.index] = first
        units[swap.index] = swap.group.unit
    in_order = sorted(first_use, key=lambda index: position[first_use[index]])
    run_starts: list[fx.Node] = []  # where each run of one unit begins
    run_of: dict[int, int] = {}
    previous: object = object()
    for index in in_order:
        if units[index] != previous or not run_starts:
            run_starts.append(first_use[index])
            previous = units[index]
        run_of[index] = len(run_starts) - 1
    sites: dict[fx.Node, list[int]] = {}
    for index in in_order:
        site = run_starts[max(0, run_of[index] - prefetch_modules)]
        sites.setdefault(site, []).append(index)
    markers: dict[int, fx.Node] = {}
    for site, indices in sites.items():
        group_keys = [keys[index] for index in indices]
        value = group_keys[0].meta["val"]
        fake = value.fake_mode
        with fake:
            marker_value = ops._prefetch_fake([value])
        with graph.inserting_before(site):
            marker = _call(graph, ops.PREFETCH, (group_keys,), f"tba_prefetch_{indices[0]}",
                           marker_value)
        for index in indices:
            markers[index] = marker
    return markers
