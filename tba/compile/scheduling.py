"""Where Inductor's scheduler puts tba's backward ops: in plain Inductor's order.

Note [Backward in plain Inductor's order]: Inductor orders a graph's kernels to lower its peak
memory (``reorder_for_peak_memory``: the best of a few topological orders by estimated peak),
and the order decides kernels too (which buffer a kernel writes in place, what the C++ backend
emits as one kernel). Plain Inductor plans backward with every saved tensor an input, in memory
from the start and freed after its last use; in a graph tba rewrote the same tensor is the
output of a ``tba::reload``, memory allocated where the reload runs. Planned as it is, backward
gets another order and other kernels (seen on torch 2.13 CPU: a small attention model's
backward, 10 of Inductor's 13 kernels missing). So the planner is shown plain Inductor's
backward:
- a reload's output is planned as an input of that size, freed after its last use, and the
  reload and prefetch nodes as allocating nothing;
- after the planner picked its order, each reload goes right before the first node that reads
  what it returns, and each prefetch before the first node that came after it in the graph tba
  rewrote (where ``prefetch_modules`` put it), so loads start and memory comes back where the
  rewrite put them, whatever order the planner liked for nodes that cost nothing.
Nothing else moves, so the rest of the order is the one plain Inductor's planner picks for the
same backward, with no data edge from tba's ops to hold a kernel back (the ops take no anchor:
the placement above is what keeps a reload from running early). With
``reorder_for_peak_memory`` off Inductor keeps the graph's order, where the rewrite placed the
ops. Tested by tests/compile/test_kernel_identity.py (a small attention model's backward has
Inductor's kernels) and tests/compile/test_scheduling.py (the placement, on every tba graph).

Installed with the lowerings (``tba.compile.lowering.install``), it changes nothing for a graph
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
                                *args: Any, **kwargs: Any) -> list[Any]:
        from torch._inductor.virtualized import V

        order = reorder(nodes, name_to_buf, *args, **kwargs)
        record = buffers_of(V.graph)
        if not (record.reloads or record.prefetches):
            return order
        lowered: Any = V.graph.module  # the FX graph module Inductor lowered
        position = {node: i for i, node in enumerate(lowered.graph.nodes)}
        return place(order, record.reloads, record.prefetches,
                     lambda node: _graph_position(node, position))

    return reorder_for_peak_memory


def _graph_position(node: Any, position: dict[Any, int]) -> int:
    """The position in the lowered FX graph of the first op behind a scheduler node."""
    origins = (origin for part in node.get_nodes() if part.node is not None
               for origin in part.node.get_origins())
    return min((position.get(origin, -1) for origin in origins), default=-1)


def place(order: list[Any], reloads: set[str], prefetches: set[str],
          graph_position: Callable[[Any], int]) -> list[Any]:
    """``order`` with the nodes that make ``reloads`` right before their first reader and those
    that make ``prefetches`` before the first other node from later in the graph
    (``graph_position``); everything else keeps its order. Nodes are Inductor's scheduler nodes
    (``get_outputs()``, ``unmet_dependencies``)."""
    def makes(node: Any, names: set[str]) -> bool:
        return any(buffer.get_name() in names for buffer in node.get_outputs())

    ours = [node for node in order if makes(node, reloads | prefetches)]
    waiting = [node for node in ours if makes(node, prefetches)]
    maker = {buffer.get_name(): node for node in ours for buffer in node.get_outputs()}
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

    for node in order:
        if makes(node, reloads | prefetches):
            continue
        at = graph_position(node)
        for prefetch in [p for p in waiting if graph_position(p) < at]:
            waiting.remove(prefetch)
            emit(prefetch)
        emit(node)
    for node in ours:
        emit(node)
    return placed
