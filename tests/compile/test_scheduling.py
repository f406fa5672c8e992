"""Note [Backward in plain Inductor's order] (tba/compile/scheduling.py): the planner's order
kept for Inductor's nodes, each reload right before its first reader, each prefetch where the
rewrite put it; on scheduler-node stand-ins and on the code Inductor generates."""

from __future__ import annotations

import dataclasses
import re

from tba.compile.scheduling import place
from tests.compile.test_kernel_identity import _step_code


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

    def __init__(self, name: str, position: int, reads: tuple[str, ...] = ()) -> None:
        self.name, self.position = name, position
        self.unmet_dependencies = {_Dep(read) for read in reads}

    def get_outputs(self) -> list[_Buffer]:
        return [_Buffer(self.name)]

    def __repr__(self) -> str:
        return self.name


def _place(order: list[_Node], reloads: set[str], prefetches: set[str]) -> list[str]:
    placed = place(order, reloads, prefetches, lambda node: node.position)
    names = [node.name for node in placed]
    assert sorted(names) == sorted(node.name for node in order), "a node lost or doubled"
    for i, node in enumerate(placed):  # a topological order
        made_before = {n.name for n in placed[:i]}
        inputs = {dep.name for dep in node.unmet_dependencies} & {n.name for n in order}
        assert inputs <= made_before, f"{node.name} placed before {inputs - made_before}"
    return names


def test_the_planners_order_stays_and_reloads_go_right_before_their_first_reader() -> None:
    # Graph order: a, prefetch p, reload r1 (for c), c, d, reload r2 (for e), e. The planner
    # put both reloads first (they cost it nothing) and swapped c and d.
    a = _Node("a", 0)
    p = _Node("p", 1)
    r1 = _Node("r1", 2, ("p",))
    c = _Node("c", 3, ("a", "r1"))
    d = _Node("d", 4, ("a",))
    r2 = _Node("r2", 5, ("p",))
    e = _Node("e", 6, ("c", "r2"))
    names = _place([p, r1, r2, a, d, c, e], {"r1", "r2"}, {"p"})
    assert names == ["a", "p", "d", "r1", "c", "r2", "e"]


def test_a_prefetch_waits_for_the_first_node_from_later_in_the_graph() -> None:
    # The prefetch was placed (graph order) after b: it starts there, not at the start where the
    # planner put it, and not as late as its reload.
    a, b = _Node("a", 0), _Node("b", 1, ("a",))
    p = _Node("p", 2)
    c = _Node("c", 3, ("b",))
    r = _Node("r", 4, ("p",))
    d = _Node("d", 5, ("c", "r"))
    assert _place([p, r, a, b, c, d], {"r"}, {"p"}) == ["a", "b", "p", "c", "r", "d"]


def test_a_reload_brings_its_prefetch_when_the_planner_moved_its_reader_earlier() -> None:
    a = _Node("a", 0)
    p = _Node("p", 1)
    b = _Node("b", 2, ("a",))
    r = _Node("r", 3, ("p",))
    c = _Node("c", 4, ("r",))
    assert _place([p, r, c, a, b], {"r"}, {"p"}) == ["p", "r", "c", "a", "b"]


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
