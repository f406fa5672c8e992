"""Note [Backward in plain Inductor's order] (tba/compile/scheduling.py): the planner's order
kept for Inductor's nodes, each reload right before its first reader, each prefetch where the
rewrite put it; on scheduler-node stand-ins and on the code Inductor generates."""

from __future__ import annotations

import dataclasses
import re
import types

import pytest
import torch

from tba.compile.scheduling import place
from tests.compile.test_kernel_identity import _step_code
from tests.compile.training import assert_same_training, train


@dataclasses.dataclass(frozen=True)
class _Buffer:
    name: str

    def get_name(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class _Dep:
    name: str


class _Node:
    """What ``place`` reads of an Inductor scheduler node."""

    def __init__(self, name: str, position: int, reads: tuple[str, ...] = (),
                 extern: bool = False) -> None:
        self.name, self.position, self.extern = name, position, extern
        self.unmet_dependencies = {_Dep(read) for read in reads}
        self.read_writes = types.SimpleNamespace(reads=self.unmet_dependencies)

    def get_outputs(self) -> list[_Buffer]:
        return [_Buffer(self.name)]

    def is_extern(self) -> bool:
        return self.extern

    def is_template(self) -> bool:
        return False

    def __repr__(self) -> str:
        return self.name


def _place(order: list[_Node], reloads: set[str], prefetches: set[str],
           stores: frozenset[str] = frozenset()) -> list[str]:
    placed = place(order, reloads, prefetches, set(stores), lambda node: node.position)
    names = [node.name for node in placed]
    assert sorted(names) == sorted(node.name for node in order), "a node lost or doubled"
    for i, node in enumerate(placed):  # a topological order
        made_before = {n.name for n in placed[:i]}
        inputs = {dep.name for dep in node.unmet_dependencies} & {n.name for n in order}
        assert inputs <= made_before, f"{node.name} placed before {inputs - made_before}"
    return names


def test_the_planners_order_stays_and_reloads_go_right_before_their_first_reader() -> None:
    # Graph order: a, prefetch p, reload r1 (for c), c, d, reload r2 (for e), e. The planner
    # put both reloads first (they cost it nothing) and swapped c and d. Inductor's nodes are
    # extern kernels here (matrix products): no run of kernels to keep whole.
    a = _Node("a", 0, extern=True)
    p = _Node("p", 1)
    r1 = _Node("r1", 2, ("p",))
    c = _Node("c", 3, ("a", "r1"), extern=True)
    d = _Node("d", 4, ("a",), extern=True)
    r2 = _Node("r2", 5, ("p",))
    e = _Node("e", 6, ("c", "r2"), extern=True)
    names = _place([p, r1, r2, a, d, c, e], {"r1", "r2"}, {"p"})
    assert names == ["a", "p", "d", "r1", "c", "r2", "e"]


def test_a_prefetch_waits_for_the_first_node_from_later_in_the_graph() -> None:
    # The prefetch was placed (graph order) after b: it starts there, not at the start where the
    # planner put it, and not as late as its reload.
    a, b = _Node("a", 0, extern=True), _Node("b", 1, ("a",), extern=True)
    p = _Node("p", 2)
    c = _Node("c", 3, ("b",), extern=True)
    r = _Node("r", 4, ("p",))
    d = _Node("d", 5, ("c", "r"), extern=True)
    assert _place([p, r, a, b, c, d], {"r"}, {"p"}) == ["a", "b", "p", "c", "r", "d"]


def test_a_reload_brings_its_prefetch_when_the_planner_moved_its_reader_earlier() -> None:
    a = _Node("a", 0, extern=True)
    p = _Node("p", 1)
    b = _Node("b", 2, ("a",), extern=True)
    r = _Node("r", 3, ("p",))
    c = _Node("c", 4, ("r",), extern=True)
    assert _place([p, r, c, a, b], {"r"}, {"p"}) == ["p", "r", "c", "a", "b"]


def test_stores_go_after_the_last_reader_of_what_they_take_in_graph_order() -> None:
    # The lowering put the stores at the graph's end (a, b, c, then s1 of a, s2 of b).
    a = _Node("a", 0, extern=True)
    b = _Node("b", 1, ("a",), extern=True)
    c = _Node("c", 2, ("a",), extern=True)
    d = _Node("d", 3, ("c",), extern=True)
    s1 = _Node("s1", 4, ("a",))
    s2 = _Node("s2", 5, ("b", "s1"))
    names = _place([a, b, c, d, s1, s2], set(), set(), frozenset({"s1", "s2"}))
    assert names == ["a", "b", "c", "s1", "s2", "d"]  # s2 waits for s1 (the stores' order)


def test_a_store_does_not_wait_for_the_readers_of_its_marker_parameter() -> None:
    """Every store also takes a parameter of its block (its marker, a graph input): what the
    last block reads does not hold the first block's store back (nor, in order, every store
    after it)."""
    w = _Node("w", -1, extern=True)  # stands for the parameter
    a = _Node("a", 0, ("w",), extern=True)
    b = _Node("b", 1, ("a",), extern=True)
    head = _Node("head", 2, ("b", "w"), extern=True)
    s1 = _Node("s1", 3, ("a", "w"))
    s2 = _Node("s2", 4, ("b", "w", "s1"))
    placed = place([w, a, b, head, s1, s2], set(), set(), {"s1", "s2"},
                   lambda node: node.position, stored={"a", "b"})
    assert [node.name for node in placed] == ["w", "a", "b", "s1", "head", "s2"]


def test_tbas_ops_leave_a_run_of_inductors_kernels_whole() -> None:
    """Between two extern kernels (m1, m2) Inductor's C++ backend emits one kernel for p1, p2
    and p3; a reload before p2 and a store after p1 move to the run's start and end."""
    m1 = _Node("m1", 0, extern=True)
    p1 = _Node("p1", 1, ("m1",))
    p2 = _Node("p2", 3, ("p1", "r"))
    p3 = _Node("p3", 4, ("p2",))
    m2 = _Node("m2", 5, ("p3",), extern=True)
    s = _Node("s", 2, ("p1",))
    r = _Node("r", 2)
    names = _place([m1, p1, s, r, p2, p3, m2], {"r"}, set(), frozenset({"s"}))
    assert names == ["m1", "r", "p1", "p2", "p3", "s", "m2"]


def test_inductors_backward_reads_each_reload_before_any_other_kernel() -> None:
    """FusedAttention's backward under Inductor: between a reload and its first use, no kernel."""
    code = _step_code("fused_attention", "tba")[1]
    body = code[code.index("def call("):].splitlines()
    calls = [(i, line) for i, line in enumerate(body)
             if "extern_kernels." in line or "cpp_fused_" in line or "torch.ops.tba." in line]
    reloads = 0
    for k, (_, line) in enumerate(calls):
        found = re.match(r"\s*(buf\d+) = torch\.ops\.tba\.reload\.default\(", line)
        if found is None:
            continue
        reloads += 1
        alias = re.search(rf"(buf\d+) = {found.group(1)}\b", "\n".join(body))
        names = {found.group(1)} | ({alias.group(1)} if alias else set())
        following = calls[k + 1][1]
        assert any(re.search(rf"\b{name}\b", following) for name in names), (
            f"{line.strip()} is followed by {following.strip()}, which does not read it")
    assert reloads, "no reload in the backward code"


@pytest.mark.parametrize("reorder", [True, False])
def test_stores_let_go_early_with_or_without_inductors_peak_memory_pass(reorder: bool) -> None:
    """With Inductor's peak-memory pass off nothing is placed: the stores stay after the last
    use of what they take (not at the graph's end, where the lowering would put them for the
    placement), so forward lets go of stored memory as early; bit-exact either way."""
    with torch._inductor.config.patch(reorder_for_peak_memory=reorder):
        keep = train("fused_attention", "inductor", None, steps=2, measure=True)
        run = train("fused_attention", "inductor",
                    dict(offloader="host", keep_last_modules=0, max_inflight_bytes=1),
                    steps=2, measure=True)
    assert_same_training(keep, run)
    assert run.stats is not None and run.stats.offloaded_bytes > 0
    assert run.peak_bytes <= 0.6 * keep.peak_bytes, (run.peak_bytes, keep.peak_bytes)
    with torch._inductor.config.patch(reorder_for_peak_memory=reorder):
        code = _step_code.__wrapped__("fused_attention", "tba")[0]
    body = code[code.index("def call("):]
    first_store = body.index("torch.ops.tba.store.default(")
    last_matmul = body.rindex("extern_kernels.")
    assert first_store < last_matmul, "every store after the forward's last matrix product"


@pytest.mark.slow
def test_gpt2s_stores_run_in_their_blocks() -> None:
    """GPT-2 (6 blocks, the tied embedding every store's marker reads at the head): about half
    of the forward's stores run before the middle of its matrix products, not all at the end."""
    code = _step_code("gpt2", "tba")[0]
    body = code[code.index("def call("):].splitlines()
    externs = [i for i, line in enumerate(body) if "extern_kernels." in line]
    stores = [i for i, line in enumerate(body) if "torch.ops.tba.store.default(" in line]
    middle = externs[len(externs) // 2]
    early = sum(i < middle for i in stores)
    assert early >= 0.3 * len(stores), f"{early} of {len(stores)} stores before the middle"
