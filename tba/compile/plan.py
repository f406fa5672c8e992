"""Which saved activations of a partitioned forward graph tba stores, and after which node.

Pure FX analysis of the forward graph AOTAutograd's partitioner produced (its outputs: the
user's outputs, then the values saved for backward). Nothing here runs a graph.

Note [What a compiled graph stores]: a saved value is stored when it is a tensor on one of the
cache's ``offload_devices``, strided, on a storage not known to be under ``min_offload_bytes``, computed from the graph's inputs (a value
computed from constants alone is folded by Inductor), not a view of a graph input (parameters,
buffers and the user's inputs are never offloaded) nor of a user-visible output (the caller
holds those anyway), and not saved by a module of ``skip_modules``. Saved values that view one
storage (a base and its views, or views of an unsaved base: the partitioner saves ``t(x)`` for
a matmul's backward) form one *group*, stored by one op: identity is the storage of the fake
tensors (Note [Storage stamps] is the eager twin), so an alias is never stored twice. A group
is stored after the last forward use of any tensor viewing its storage (an op that reads it;
making another view of it is no use: views that only backward needs, which the partitioner
puts at the end of forward, move up to the store), and belongs to the cache unit of that last
use's module (``nn_module_stack``): the module whose op saved it,
where eager mode's pack hook would have seen it (a block's output, saved by the next block's
first op, belongs to the next block as in eager mode), so ``keep_last_modules`` and
``summary()``'s block numbers mean the same blocks. Tested by tests/compile/test_plan.py.

Note [Units at run time]: module paths in a graph are relative to the module whose frame
Dynamo compiled: the model for a whole-model graph, a block when the model's own graph breaks
make Dynamo compile a block's ``forward`` as a frame of its own, and then one graph serves
every block (its parameters are inputs). So each store also takes a *marker*, a parameter of
the module its group belongs to, and its path in the frame: at run time the cache finds that
parameter's name in the model (``blocks.2.up.weight`` for ``up.weight``), hence the frame's
place in the model (``blocks.2.``) and the group's unit. Without a parameter input the path is
taken as the model's own. Tested by tests/compile/test_backend.py (graph breaks).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["StoreGroup", "Rules", "plan_stores", "storage_key", "reads", "module_path", "normalize_path"]

# Dynamo names a module by how the compiled frame reached it: L['self'].transformer.h[0],
# L['self']._modules['lm_head'], L['self'].transformer.h.0.attn.
_PRIMAL = re.compile(r"primals_(\d+)")
_ROOT = re.compile(r"^[LG]\[['\"][^'\"]+['\"]\]")
_INDEX = re.compile(r"\[(\d+)\]")
_KEY = re.compile(r"\[['\"]([^'\"]+)['\"]\]")
_CONTAINERS = re.compile(r"\._(?:modules|parameters|buffers)(?=\.)")


def normalize_path(raw: str) -> str:
    """A Dynamo module path as ``named_modules`` spells it, relative to the compiled module.

    Example:
        >>> normalize_path("L['self'].transformer.h[0]._modules['attn']")
        'transformer.h.0.attn'
    """
    path = _KEY.sub(r".\1", _INDEX.sub(r".\1", _ROOT.sub("", raw)))
    return _CONTAINERS.sub("", path).lstrip(".")


def module_path(node: fx.Node) -> str | None:
    """The innermost module the node's op ran in (None: recorded in no module)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    raw = list(stack.values())[-1]
    return normalize_path(raw[0] if isinstance(raw, tuple) else str(raw))


def storage_key(node: fx.Node) -> StorageWeakRef | None:
    """The identity of the storage a node's fake tensor views (None: no tensor)."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    return StorageWeakRef(value.untyped_storage())


@dataclasses.dataclass
class StoreGroup:
    """The saved values viewing one storage, stored by one op.

    Attributes:
        members: the saved outputs viewing the storage, in output order.
        after: the node after which the group is stored (its storage's last forward use).
        unit: the cache unit the group belongs to (None: outside every unit).
        module: the module path that decided ``unit`` ("" for the compiled module itself).
        moved: views of the storage, defined after ``after``, that make members and move to
            ``after`` (in graph order).
        marker: a parameter input of the module at ``module`` and its path in the frame
            (Note [Units at run time]), or None.
    """

    members: list[fx.Node]
    after: fx.Node
    unit: str | None
    module: str | None
    moved: list[fx.Node] = dataclasses.field(default_factory=list)
    marker: tuple[fx.Node, str] | None = None


@dataclasses.dataclass(frozen=True)
class Rules:
    """What the cache's configuration says about a saved value.

    Attributes:
        devices: device types whose tensors are offloaded (``offload_devices``).
        unit_of: the unit a module path belongs to, or None.
        skipped: whether a module path is under a module of ``skip_modules``.
        input_paths: for each input of the compiled frame, the path of the parameter or
            buffer it is, relative to the frame's module (None: not one).
        min_bytes: storages known to be smaller (``min_offload_bytes``) are not stored.
    """

    devices: frozenset[str]
    unit_of: Callable[[str], str | None]
    skipped: Callable[[str], bool]
    input_paths: tuple[str | None, ...] = ()
    min_bytes: int = 0


def _candidate(node: fx.Node, rules: Rules) -> bool:
    value = node.meta.get("val")
    return (
        isinstance(value, torch.Tensor)
        and value.device.type in rules.devices
        and value.layout is torch.strided
        and not value.is_quantized
        and not node.meta.get("saved_tensor_with_no_vc_check", False)
        and not _statically_empty(value)
    )


def _small(node: fx.Node, min_bytes: int) -> bool:
    """Whether the node's storage is known to hold fewer than ``min_bytes`` (the cache would
    keep it in memory: a store op would only cost time)."""
    nbytes = node.meta["val"].untyped_storage().nbytes()
    return isinstance(nbytes, int) and nbytes < min_bytes


def _statically_empty(value: torch.Tensor) -> bool:
    numel = value.numel()
    return isinstance(numel, int) and numel == 0


def _from_inputs(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computed from at least one graph input."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" or any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def _keys(nodes: Iterable[object]) -> set[StorageWeakRef]:
    keys = set()
    for node in nodes:
        if isinstance(node, fx.Node):
            key = storage_key(node)
            if key is not None:
                keys.add(key)
    return keys


def _parameters(graph: fx.Graph, paths: tuple[str | None, ...]) -> list[tuple[fx.Node, str]]:
    """The forward's parameter inputs with their paths (AOTAutograd names the frame's inputs
    ``primals_1``, ``primals_2``, ... in order)."""
    found: list[tuple[fx.Node, str]] = []
    for node in graph.find_nodes(op="placeholder"):
        match = _PRIMAL.fullmatch(node.name)
        index = int(match.group(1)) - 1 if match else -1
        path = paths[index] if 0 <= index < len(paths) else None
        if path is not None:
            found.append((node, path))
    return found


def _marker(parameters: list[tuple[fx.Node, str]], path: str | None) -> tuple[fx.Node, str] | None:
    """A parameter of the module at ``path`` if it has one, else any parameter of the frame
    (it tells where the frame is in the model all the same)."""
    for node, name in parameters:
        if path and name.startswith(path + "."):
            return node, name
    return parameters[0] if parameters else None


def plan_stores(fw: fx.GraphModule, num_fwd_outputs: int, rules: Rules) -> list[StoreGroup]:
    """The groups to store in ``fw`` (Note [What a compiled graph stores]), in the order
    their stores run."""
    graph = fw.graph
    output = graph.find_nodes(op="output")[0]
    outputs = list(output.args[0])
    saved = outputs[num_fwd_outputs:]
    excluded = _keys(graph.find_nodes(op="placeholder")) | _keys(outputs[:num_fwd_outputs])
    computed = _from_inputs(graph)
    order = {node: i for i, node in enumerate(graph.nodes)}
    parameters = _parameters(graph, rules.input_paths)
    aliases: dict[StorageWeakRef, list[fx.Node]] = {}
    for node in graph.nodes:
        key = storage_key(node)
        if key is not None:
            aliases.setdefault(key, []).append(node)
    members: dict[StorageWeakRef, list[fx.Node]] = {}
    for node in dict.fromkeys(saved):  # a value saved twice is one member
        if not isinstance(node, fx.Node) or node not in computed or not _candidate(node, rules):
            continue
        key = storage_key(node)
        if key is not None and key not in excluded and not _small(node, rules.min_bytes):
            members.setdefault(key, []).append(node)
    groups = []
    for key, group in members.items():
        viewers = aliases[key]
        users = sorted(
            (user for alias in viewers for user in alias.users if reads(user, key)),
            key=order.__getitem__,
        )
        made = [alias for alias in viewers if not any(views(a, key) for a in alias.all_input_nodes)]
        after = max([*users, *made], key=order.__getitem__)
        moved: list[fx.Node] = []
        for member in group:
            chain = _late_views(member, key, order, order[after])
            if chain is None:
                after = max(after, member, key=order.__getitem__)
            else:
                moved.extend(node for node in chain if node not in moved)
        moved = sorted((n for n in moved if order[n] > order[after]), key=order.__getitem__)
        path = next((p for p in map(module_path, reversed(users)) if p is not None), None)
        if path is None:
            path = next((p for p in map(module_path, group) if p is not None), None)
        if path is not None and rules.skipped(path):
            continue
        unit = rules.unit_of(path) if path is not None else None
        groups.append(StoreGroup(group, after, unit, path, moved, _marker(parameters, path)))
    groups.sort(key=lambda g: (order[g.after], order[g.members[0]]))
    return groups


def views(node: fx.Node, key: StorageWeakRef) -> bool:
    """Whether ``node``'s value is a tensor on the storage ``key``."""
    found = storage_key(node)
    return found is not None and found == key


def reads(user: fx.Node, key: StorageWeakRef) -> bool:
    """Whether ``user`` is a use of the storage ``key`` (an op that reads it, not the output
    and not another view of it: a view of an alias reads nothing)."""
    return user.op != "output" and not views(user, key)


def _late_views(member: fx.Node, key: StorageWeakRef, order: dict[fx.Node, int],
                bound: int) -> list[fx.Node] | None:
    """The views of ``key`` that make ``member``, defined after position ``bound`` (the
    partitioner puts views that only backward needs, such as a matmul's ``t(x)``, at the end of
    forward), if all of them can move to ``bound``: nothing but views of the storage or
    values defined before ``bound`` go into them. None when they cannot."""
    chain: list[fx.Node] = []
    pending = [member]
    while pending:
        node = pending.pop()
        if order[node] <= bound or node in chain:
            continue
        if not views(node, key) or node.op != "call_function":
            return None
        chain.append(node)
        pending.extend(node.all_input_nodes)
    return chain
