"""Where Inductor's scheduler puts tba's ops: Inductor's own kernels as plain Inductor has them.

Note [Backward in plain Inductor's order]: Inductor orders a graph's kernels to lower its peak
memory (``reorder_for_peak_memory``: the best of a few topological orders by estimated peak),
and the order decides kernels too (which buffer a kernel writes in place). Plain Inductor plans
backward with every saved tensor an input, in memory from the start and freed after its last
use; in a graph tba rewrote the same tensor is the output of a ``tba::reload``, memory
allocated where the reload runs. Planned as it is, backward gets another order and other
kernels (seen on torch 2.13 CPU: a small attention model's backward, 10 of Inductor's 13
kernels missing). So the planner is shown plain Inductor's backward: a reload's output is
planned as an input of that size, freed after its last use, and the reload and prefetch nodes
as allocating nothing. After the planner picked its order, each reload goes right before the
first node that reads what it returns, and each prefetch before the first node that came after
it in the graph tba rewrote (where ``prefetch_modules`` put it).

Note [Forward in plain Inductor's order]: the same for forward. Plain Inductor makes a saved
tensor a graph output, realized (written to a buffer of its own) when the lowering reaches the
output, after every op that reads it was lowered (and could compute it inline); a store in the
middle of the graph realizes it there, and the ops lowered after it read the buffer instead
(seen on torch 2.13 CPU: GPT-2's loss kernel split in five). So under Inductor every store is
put at the graph's end (``rewrite_forward(late=True)``), what the stores take is planned as
graph outputs, and after the planner's order each store goes right after the last node that
makes or reads what it takes (the stores in their order), where the graph then lets go of the
buffers (Note [Stored buffers are not reused] in lowering.py).

Last, none of tba's ops stays inside a run of Inductor's own kernels between two extern kernels:
stores move to the run's end, reloads and prefetches to its start. Inductor's C++ backend emits
a run as one kernel (its kernel group is flushed at every extern kernel, and tba's ops are
extern kernels), so an op inside a run splits it (seen: GPT-2's backward, 5 of 9 kernels).

Nothing else moves, so the rest of the order is the one plain Inductor's planner picks, and no
data edge holds one of Inductor's kernels back (tba's ops take no anchor: the placement keeps a
reload from running early and a store from running late). With ``reorder_for_peak_memory``
off nothing is placed: the stores stay where the rewrite puts them without ``late`` (after the
last use of what they take) and Inductor keeps the graph's order. Tested by
tests/compile/test_kernel_identity.py and tests/compile/test_scheduling.py.

Installed with the lowerings (``tba.compile.lowering.install``); it changes nothing for a graph
without tba's ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tba.compile.lowering import buffers_of

__all__ = ["install", "place"]

_installed = False


def install() -> None:
    """Wrap Inductor's peak-memory planning for graphs with tba's backward ops (once)."""
    global _installed
    if _installed:
        return
    from torch._inductor import memory

    memory.prepare_planning_info = _planned_as_plain(memory.prepare_planning_info)
    memory.reorder_for_peak_memory = _placed(memory.reorder_for_peak_memory)
    _installed = True


def _planned_as_plain(prepare: Callable[..., Any]) -> Callable[..., Any]:
    def planning_info(nodes: list[Any], name_to_buf: dict[str, Any], name_to_fused_node: Any,
                      graph_inputs: Any, graph_outputs: Any) -> tuple[int, dict[str, Any]]:
        from torch._inductor import memory
        from torch._inductor.virtualized import V

        peak, freeable = prepare(nodes, name_to_buf, name_to_fused_node, graph_inputs,
                                 graph_outputs)
        record = buffers_of(V.graph)
        ours = record.reloads | record.prefetches
        if not ours:
            return peak, freeable
        for node in nodes:
            for buffer in node.get_outputs():
                if buffer.get_name() not in ours:
                    continue
                info = buffer.mpi_buffer
                node.mpi_node.size -= info.size_alloc
                if info.size_free and buffer.get_name() in record.reloads:
                    planned = memory.FreeableInputBuffer(
                        f"{buffer.get_name()}_tba_as_input", memory.MemoryPlanningInfoForBuffer(
                            size_free=info.size_free, succ_nodes=info.succ_nodes,
                            succ_nodes_for_ordering=info.succ_nodes_for_ordering))
                    freeable[planned.get_name()] = planned
                    for user in info.succ_nodes:
                        user.mpi_node.pred_buffers.add(planned)
                info.size_alloc = info.size_free = 0
        peak, _ = memory.estimate_peak_memory(nodes, freeable, graph_outputs)
        return peak, freeable

    return planning_info


def _placed(reorder: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    def reorder_for_peak_memory(nodes: list[Any], name_to_buf: dict[str, Any],
                                name_to_fused_node: Any, graph_inputs: Any, graph_outputs: Any,
                                *args: Any, **kwargs: Any) -> list[Any]:
        from torch._inductor.virtualized import V

        record = buffers_of(V.graph)
        # Forward: what the stores take is planned as plain Inductor's saved outputs are.
        outputs = graph_outputs | record.stored if record.stored else graph_outputs
        order = reorder(nodes, name_to_buf, name_to_fused_node, graph_inputs, outputs,
                        *args, **kwargs)
        if not (record.reloads or record.prefetches or record.stores):
            return order
        lowered: Any = V.graph.module  # the FX graph module Inductor lowered
        position = {node: i for i, node in enumerate(lowered.graph.nodes)}
        return place(order, record.reloads, record.prefetches, record.stores,
                     lambda node: _graph_position(node, position), record.stored)

    return reorder_for_peak_memory


def _graph_position(node: Any, position: dict[Any, int]) -> int:
    """The position in the lowered FX graph of the first op behind a scheduler node."""
    origins = (origin for part in node.get_nodes() if part.node is not None
               for origin in part.node.get_origins())
    return min((position.get(origin, -1) for origin in origins), default=-1)


def _names_read(node: Any) -> set[str]:
    return ({dep.name for dep in node.unmet_dependencies}
            | {dep.name for dep in node.read_writes.reads})


def place(order: list[Any], reloads: set[str], prefetches: set[str], stores: set[str],
          graph_position: Callable[[Any], int], stored: set[str] | None = None) -> list[Any]:
    """``order`` with the nodes that make ``reloads`` right before their first reader, those
    that make ``prefetches`` before the first other node from later in the graph
    (``graph_position``), and the stores (the nodes that make ``stores``) right after the last
    other node that makes or reads what they take (of ``stored``, when given: not the marker
    parameter every store also reads), in their order; then none of them inside a
    run of Inductor's own kernels (``_kernel_groups_kept``); everything else keeps its order.
    Nodes are Inductor's scheduler nodes (``get_outputs()``, ``unmet_dependencies``,
    ``read_writes``, ``is_extern()``, ``is_template()``)."""
    ours_names = reloads | prefetches | stores

    def makes(node: Any, names: set[str]) -> bool:
        return any(buffer.get_name() in names for buffer in node.get_outputs())

    ours = [node for node in order if makes(node, ours_names)]
    rest = [node for node in order if not makes(node, ours_names)]
    waiting = [node for node in ours if makes(node, prefetches)]
    maker = {buffer.get_name(): node for node in ours for buffer in node.get_outputs()}
    # A store runs after the last node of ``rest`` that makes or reads one of its tensors, and
    # after the store before it (the stores run in graph order).
    last_touch: dict[str, int] = {}  # buffer name -> the last node of ``rest`` making or reading it
    for i, other in enumerate(rest):
        for name in _names_read(other) | {b.get_name() for b in other.get_outputs()}:
            last_touch[name] = i
    after_node: dict[int, list[Any]] = {}
    bound = -1
    for node in ours:
        if not makes(node, stores):
            continue
        taken = {name for name in _names_read(node) if name not in maker
                 and (stored is None or name in stored)}
        if not taken:
            continue  # a key or carrier of a store (it follows its store)
        bound = max(bound, *(last_touch.get(name, -1) for name in taken))
        after_node.setdefault(bound, []).append(node)
    placed: list[Any] = []
    done: set[int] = set()

    def emit(node: Any) -> None:
        if id(node) in done:
            return
        done.add(id(node))
        for dependency in node.unmet_dependencies:
            source = maker.get(dependency.name)
            if source is not None:
                emit(source)
        placed.append(node)

    for store in after_node.get(-1, []):
        emit(store)
    waiting.sort(key=graph_position)  # in the graph's order, each waits for a later node
    for i, node in enumerate(rest):
        if waiting:
            at = graph_position(node)
            while waiting and graph_position(waiting[0]) < at:
                emit(waiting.pop(0))
        emit(node)
        for store in after_node.get(i, []):
            emit(store)
    for node in ours:
        emit(node)
    return _kernel_groups_kept(placed, lambda node: makes(node, ours_names),
                               lambda node: makes(node, stores))


def _kernel_groups_kept(order: list[Any], ours: Callable[[Any], bool],
                        late: Callable[[Any], bool]) -> list[Any]:
    """``order`` with no op of tba's inside a run of Inductor's own kernels: between two of
    Inductor's extern kernels, tba's ops that go late (stores) move to the run's end, the others
    (reloads, prefetches) to its start. A C++ backend emits a run as one kernel (it flushes
    its kernel group at every extern kernel), so an op of tba's inside a run splits it."""
    placed: list[Any] = []
    early: list[Any] = []
    middle: list[Any] = []
    ending: list[Any] = []

    def close_run() -> None:
        placed.extend(early + middle + ending)
        for run in (early, middle, ending):
            run.clear()

    for node in order:
        if ours(node):
            (ending if late(node) else early).append(node)
        elif node.is_extern() or node.is_template():
            close_run()
            placed.append(node)
        else:
            middle.append(node)
    close_run()
    return placed
