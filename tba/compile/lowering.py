"""How Inductor lowers tba's ops: as its own fallback kernels, with the buffers the cache holds
after the op returns kept out of Inductor's buffer reuse.

Note [Stored buffers are not reused]: Inductor recycles a buffer after its last use in the
graph, either for a later buffer of its size (``buf7 = buf3; del buf3``) or in place, by the
kernel that reads it last (``in_out_ptr``). Two kinds of buffer are read after their last use
in the graph's plan, by the tensor cache:
- what a ``tba::store`` takes: a store worker copies it after the op returned (or the cache
  keeps it for backward, when the policy keeps its group);
- what a ``tba::reload`` returns, when another reload returns a view of the same storage (the
  members of one group) or a tensor plain Inductor would not let backward reuse either.
Those buffers, and only those, go into Inductor's ``never_reuse_buffers`` (the set Inductor
keeps for buffers other code reads in ways its plan does not see), and the graph lets go of
them after their last use in the graph, as it does of its inputs (``del buf``; Inductor keeps a
buffer it may not reuse to the graph's end otherwise, which held every stored buffer through
the forward: 0.90x compiled keep's saved-activation peak on GPT-2, torch 2.13 CPU). Their
memory comes back through the allocator when the last reference goes (the graph's, the
cache's), as in eager mode, and every other buffer of the graph is reused as Inductor plans it. Nothing else of
Inductor's configuration changes. It is what plain Inductor does with the same tensors: a
saved activation is an output of the forward graph, which Inductor does not reuse; in backward
it is an input that AOTAutograd *donates* (Inductor may reuse it) when its storage is no input
or user output of forward and no output of backward (``torch._functorch.config.donated_buffer``,
on by default; AOTAutograd then refuses ``retain_graph=True``, as it does for tba's graphs, whose
keys are donated). The reload of such a tensor, alone in its group, is left to reuse
(``reusable_saved``): the cache hands a member out once per backward, and kept or reloaded, no
other reader of its storage remains (a reloaded group owns its part of a load buffer). The names are taken from the kernel Inductor built, after its layout
constraint: where a store needs exact strides Inductor may hand it a copy made for it, and
the copy is what the cache holds (seen on torch 2.13 CPU, GPT-2: the embedding sum stored by
store 0 reused for the attention mask when the source, not the copy, was protected).
Without this, a GELU kernel wrote its output into the buffer of the linear output stored just
before it (torch 2.13 CPU). Tested by tests/compile/test_buffer_lifetime.py (stores held in
flight until the graph returned; a store whose buffers are left to reuse trains wrong) and
tests/compile/test_kernel_identity.py.

Note [Stored values are realized as outputs]: a value saved for backward is an output of plain
Inductor's forward graph; under tba its user is the store instead of the output. Inductor
decides while it lowers a node whether to realize it (write it to a buffer) or to inline it
into its readers, and one of its rules looks at the users: a value read by several nodes, one
of them the graph's output, is realized where it is lowered (and a view that is an output is
realized too). Without the rule a value the store takes stayed inlined until the lowering
reached the store, at the graph's end, and was computed there by a kernel of its own: GPT-2's
label count (``convert_element_type``, saved for backward) left the loss kernel (torch 2.13
CPU). So a node a store reads gets the output rule after Inductor lowered it
(``_realize_stored_as_outputs``, a wrapper of ``GraphLowering.run_node`` that does nothing for
other nodes); the exact strides the store needs are still asked for by the store. Tested by
tests/compile/test_kernel_identity.py (GPT-2's forward).

Registered by the ``"tba"`` backend before it compiles with Inductor (never by ``import tba``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

from torch import fx

from tba.compile import ops
from tba.compile.plan import storage_key

__all__ = ["install", "reusable_saved", "REUSABLE", "Buffers", "buffers_of"]

_installed = False


@dataclasses.dataclass
class Buffers:
    """The buffers of tba's ops in one graph Inductor lowers (its ``GraphLowering``).

    Attributes:
        held: kept out of reuse and freed after their last use (Note [Stored buffers are not
            reused]).
        reloads: every buffer a ``tba::reload`` registered (the kernel and its output).
        prefetches: every buffer a ``tba::prefetch`` registered.
        stores: every buffer a ``tba::store`` registered (the kernel, its key and carriers).
        stored: the buffers the stores read.
    """

    held: set[str] = dataclasses.field(default_factory=set)
    stores: set[str] = dataclasses.field(default_factory=set)
    stored: set[str] = dataclasses.field(default_factory=set)
    reloads: set[str] = dataclasses.field(default_factory=set)
    prefetches: set[str] = dataclasses.field(default_factory=set)


_BUFFERS = "_tba_buffers"  # the attribute of Inductor's GraphLowering that holds them


def buffers_of(graph: Any) -> Buffers:
    """The :class:`Buffers` of Inductor's ``graph`` (empty for a graph without tba's ops)."""
    found = getattr(graph, _BUFFERS, None)
    if found is None:
        found = Buffers()
        setattr(graph, _BUFFERS, found)
    assert isinstance(found, Buffers)
    return found


def install() -> None:
    """Register the lowerings of tba's ops with Inductor and let its wrapper code free the
    buffers tba holds (once)."""
    global _installed
    if _installed:
        return
    from torch._inductor import lowering

    lowering.add_needs_realized_inputs([ops.STORE, ops.RELOAD, ops.PREFETCH])
    for op in (ops.STORE, ops.RELOAD, ops.PREFETCH):
        lowering.register_lowering(op, type_promotion_kind=None)(
            _recorded(lowering.fallback_handler(op), op))
    _free_held_buffers()
    _realize_stored_as_outputs()
    _installed = True


def _free_held_buffers() -> None:
    """Inductor's wrapper code frees a buffer tba keeps out of reuse after its last use, as it
    frees a graph input (a ``del``, never handed to another buffer)."""
    from torch._inductor.codegen import wrapper
    from torch._inductor.virtualized import V

    codegen_free = wrapper.PythonWrapperCodegen.codegen_free

    def free(self: Any, buffer: Any) -> None:
        if buffer.get_name() in buffers_of(V.graph).held:
            self.writeline(wrapper.FreeLine(self, buffer))
            return
        codegen_free(self, buffer)  # type: ignore[no-untyped-call]  # Inductor's, untyped

    wrapper.PythonWrapperCodegen.codegen_free = free  # type: ignore[method-assign]


def _realize_stored_as_outputs() -> None:
    """Inductor realizes a value a store takes where it would realize it as a graph output
    (Note [Stored values are realized as outputs])."""
    from torch._inductor import config, ir
    from torch._inductor.graph import GraphLowering

    run_node = GraphLowering.run_node

    def lower_node(self: Any, n: fx.Node) -> object:
        result = run_node(self, n)
        if not isinstance(result, ir.TensorBox) or not any(
                user.target is ops.STORE for user in n.users):
            return result
        if isinstance(result.data, ir.BaseView):
            result.realize()
        elif len(n.users) > 1 and isinstance(result.data, ir.StorageBox) and isinstance(
                result.data.data, (ir.Pointwise, ir.Reduction)):
            inner = result.data.data
            if not (config.delay_realize_cheap_outputs and inner.num_reads() == 0
                    and not inner.has_large_inner_fn()):
                result.realize()
        return result

    GraphLowering.run_node = lower_node  # type: ignore[method-assign]


def _recorded(fallback: Callable[..., Any], op: Any) -> Callable[..., Any]:
    """``fallback`` (Inductor's lowering of a fallback kernel for ``op``), then what it
    registered recorded in the graph's :class:`Buffers`, and the buffers the cache reads after
    the op kept out of reuse."""
    def lower(*args: Any, **kwargs: Any) -> Any:
        from torch._inductor.virtualized import V

        graph = V.graph
        operations, buffers = len(graph.operations), len(graph.buffers)
        result = fallback(*args, **kwargs)
        registered = {buffer.get_name() for buffer in graph.buffers[buffers:]}
        record = buffers_of(graph)
        if op is ops.STORE:
            held = _reads(graph.operations[operations:], record)
            record.stores.update(registered)
            record.stored.update(held)
        elif op is ops.RELOAD:
            record.reloads.update(registered)
            held = _reloaded(registered)
        else:
            record.prefetches.update(registered)
            held = set()
        graph.never_reuse_buffers.update(held)
        record.held.update(held)
        return result

    setattr(lower, "_is_fallback_handler", True)
    return lower


def _reads(operations: list[Any], record: Buffers) -> set[str]:
    """The buffers of the tensors a store kernel takes (the cache holds them after it returned):
    what it reads but graph inputs (the marker parameter) and the key of the store before it."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    names: set[str] = set()
    for operation in operations:
        if isinstance(operation, ir.FallbackKernel) and operation.op_overload is ops.STORE:
            names.update(source.get_name() for source in operation.inputs
                         if isinstance(source, ir.IRNode))
    names -= set(V.graph.graph_inputs) | record.stores
    if not names:
        raise AssertionError("tba bug: Inductor lowered tba::store without a fallback kernel")
    return names


def _reloaded(registered: set[str]) -> set[str]:
    """The buffers a reload registered (the tensor it returns), unless the rewrite marked the
    reload reusable (``REUSABLE``)."""
    from torch._inductor.virtualized import V

    node = V.graph.current_node
    if node is not None and node.meta.get(REUSABLE, False):
        return set()
    return registered


REUSABLE = "tba_reusable"  # fx meta of a reload whose output Inductor may reuse


def reusable_saved(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> frozenset[str]:
    """The names of the forward's saved values (before tba's rewrite) whose backward input
    AOTAutograd would donate, and that share their storage with no other saved value."""
    import torch
    from torch._functorch._aot_autograd import graph_compile
    from torch._functorch._aot_autograd.utils import contain_metadata_mutation_ops

    if not torch._functorch.config.donated_buffer or any(
            contain_metadata_mutation_ops(g) for g in (fw, bw)):
        return frozenset()
    outputs = list(fw.graph.find_nodes(op="output")[0].args[0])
    saved = [n for n in outputs[num_fwd_outputs:] if isinstance(n, fx.Node)]
    fw_ins = [n.meta.get("val") for n in fw.graph.find_nodes(op="placeholder")]
    user_outs = [n.meta.get("val") if isinstance(n, fx.Node) else None
                 for n in outputs[:num_fwd_outputs]]
    bw_outs = [n.meta.get("val") if isinstance(n, fx.Node) else None
               for n in bw.graph.find_nodes(op="output")[0].args[0]]
    donated = graph_compile.collect_fw_donated_buffer_idxs(
        fw_ins, user_outs, bw_outs, [n.meta.get("val") for n in saved])
    sharing = collections.Counter(storage_key(n) for n in saved)
    return frozenset(saved[i].name for i in donated if sharing[storage_key(saved[i])] == 1)
