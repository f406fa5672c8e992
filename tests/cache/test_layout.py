"""The layout of ``tba/cache/`` (tba/cache/__init__.py): folders in layers, no import circles.

Every import of every module under tba/ is read with ``ast``: module-level ones, the ones under
``if TYPE_CHECKING:`` and the ones inside functions alike (a type-only circle is still a
circle between concerns). The rules checked are the ones each folder's ``__init__`` docstring
states in its ``May import from ...`` sentences, so docs and test cannot drift apart.
"""

from __future__ import annotations

import ast
import functools
import graphlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

import tba
from tba.cache.steps import forward_state

TBA_DIR = Path(tba.__file__).resolve().parent
CACHE = "tba.cache"

#: An import found in a module: (imported module, line) in the importing module.
Edge = tuple[str, int]


@functools.cache
def module_names() -> dict[str, Path]:
    """Every module under tba/, by dotted name (a package by its ``__init__.py``)."""
    modules: dict[str, Path] = {}
    for path in sorted(TBA_DIR.rglob("*.py")):
        parts = ("tba",) + path.relative_to(TBA_DIR).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imports_in(source: str, name: str, is_package: bool, known: Iterable[str]) -> list[Edge]:
    """The tba modules that ``source`` (module ``name``) imports, anywhere in it. ``from a
    import b`` is an import of ``a.b`` when that is a module, else of ``a``."""
    known = set(known)
    package = name if is_package else name.rpartition(".")[0]
    edges: list[Edge] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            edges.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                submodule = f"{origin}.{alias.name}"
                edges.append((submodule if submodule in known else origin, node.lineno))
    return [(target, line) for target, line in edges if target == "tba" or target.startswith("tba.")]


def import_graph() -> dict[str, list[Edge]]:
    modules = module_names()
    return {
        name: [
            edge for edge in imports_in(path.read_text(), name, path.name == "__init__.py", modules)
            if edge[0] != name
        ]
        for name, path in modules.items()
    }


#: Import circles outside ``tba.cache`` that predate this test, each through a function-local
#: import (importer, imported): the test fails on any other circle, and when one of these is
#: gone (then drop it here).
KNOWN_CIRCLE_EDGES = {
    ("tba.malloc_hook._library", "tba.malloc_hook"),  # the package's __path__, found at run time
    ("tba.offloaders.ssd._engine", "tba.offloaders.ssd._posix"),  # the engine factory
    ("tba.offloaders.ssd._engine", "tba.offloaders.ssd._kvikio"),
}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (node -> nodes it imports), each node importing the next,
    or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return list(reversed(error.args[1]))  # graphlib lists each node before its importer
    return None


def folder_of(module: str) -> str | None:
    """The ``tba.cache`` folder (``tba.cache.engine``) a module belongs to, ``tba.cache`` for the
    modules at its top level, None outside ``tba.cache``."""
    if module != CACHE and not module.startswith(CACHE + "."):
        return None
    modules = module_names()
    parts = module.split(".")
    if len(parts) >= 3 and modules[".".join(parts[:3])].name == "__init__.py":
        return ".".join(parts[:3])
    return CACHE


def rules(folder: str) -> tuple[set[str], set[str]]:
    """What ``folder``'s ``__init__`` docstring says it may import: ``tba.cache`` folders, and
    modules (with their submodules) outside ``tba.cache``."""
    docstring = ast.get_docstring(ast.parse(module_names()[folder].read_text())) or ""
    found = {}
    for where in ("from ``tba.cache``", "from outside it"):
        match = re.search(rf"May import {where}:(.*?)\.(?:\s|$)", docstring, re.DOTALL)
        assert match is not None, f"{folder}'s docstring has no 'May import {where}:' sentence"
        found[where] = set(re.findall(r"``(tba(?:\.\w+)*)``", match.group(1)))
    inside = found["from ``tba.cache``"]
    assert all(name.startswith(CACHE + ".") for name in inside), inside
    return inside, found["from outside it"]


def folders() -> list[str]:
    return sorted({folder_of(m) for m in module_names() if folder_of(m) is not None})  # type: ignore[misc]


def test_the_walker_sees_type_only_and_function_local_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import tba.cache.engine.core\n"
        "from tba.cache.engine import states\n"
        "from . import table\n"
        "if TYPE_CHECKING:\n"
        "    from tba.cache.steps.scopes import Scope\n"
        "def f():\n"
        "    from ..observe.stats import CacheStats\n"
    )
    edges = imports_in(source, "tba.cache.engine.entries", False, module_names())
    assert [target for target, _ in edges] == [
        "tba.cache.engine.core", "tba.cache.engine.states", "tba.cache.engine.table",
        "tba.cache.steps.scopes", "tba.cache.observe.stats",
    ]


def test_the_walker_finds_a_planted_circle() -> None:
    graph = {name: {target for target, _ in edges} for name, edges in import_graph().items()}
    assert "tba.cache.engine" in graph["tba.cache.capture.saving"]  # the walk sees real imports
    assert "tba.cache.engine.entries" in graph["tba.cache.steps.scopes"]
    graph["tba.cache.engine.entries"].add("tba.cache.steps.scopes")  # the circle issue 30 found
    assert find_cycle(graph) is not None


def test_no_import_circle_between_modules() -> None:
    graph = import_graph()
    simple = {name: {target for target, _ in edges} for name, edges in graph.items()}
    gone = {edge for edge in KNOWN_CIRCLE_EDGES if edge[1] not in simple[edge[0]]}
    assert not gone, f"these imports are gone: drop them from KNOWN_CIRCLE_EDGES: {gone}"
    for source, target in KNOWN_CIRCLE_EDGES:
        simple[source].discard(target)
    cycle = find_cycle(simple)
    if cycle is not None:
        steps = []
        for source, target in zip(cycle, cycle[1:]):
            lines = [line for t, line in graph[source] if t == target]
            steps.append(f"{source} (line {lines[0]}) -> {target}")
        pytest.fail("tba: import circle (counting imports under TYPE_CHECKING and in functions):\n"
                    + "\n".join(steps))


def test_no_import_circle_between_cache_folders() -> None:
    graph: dict[str, set[str]] = {folder: set() for folder in folders()}
    for name, edges in import_graph().items():
        source = folder_of(name)
        for target, _ in edges:
            target_folder = folder_of(target)
            if source is not None and target_folder is not None and target_folder != source:
                graph[source].add(target_folder)
    assert find_cycle(graph) is None, f"tba.cache folders import each other: {find_cycle(graph)}"


def test_each_folder_imports_only_what_its_docstring_allows() -> None:
    problems = []
    for name, edges in import_graph().items():
        folder = folder_of(name)
        if folder is None:
            continue
        inside, outside = rules(folder)
        for target, line in edges:
            target_folder = folder_of(target)
            if target_folder == folder:
                continue
            allowed = (
                target_folder in inside if target_folder is not None
                else any(target == o or target.startswith(o + ".") for o in outside)
            )
            if not allowed:
                problems.append(f"{name} line {line} imports {target}, which {folder} may not import")
    assert not problems, "tba.cache layering (see each folder's __init__ docstring):\n" + "\n".join(problems)


def test_the_rules_are_layers_and_every_concern_has_a_folder() -> None:
    """The folders' rules form an order (no folder may import one that may import it), each
    folder's rule names only folders that exist, and there are at least four of them."""
    names = folders()
    assert len([n for n in names if n != CACHE]) >= 4, names
    allowed = {folder: rules(folder)[0] for folder in names}
    for folder, inside in allowed.items():
        assert inside <= set(names), f"{folder} names unknown folders: {inside - set(names)}"
    assert find_cycle(allowed) is None
    assert CACHE not in set().union(*allowed.values()), "no folder may import tensor_cache.py's level"
    top_level = [m for m in module_names() if folder_of(m) == CACHE and m != CACHE]
    assert top_level == ["tba.cache.tensor_cache"], top_level


def test_tba_own_frames_are_found_from_the_moved_module() -> None:
    # torch_caller skips the frames of tba's own code: its directory must be tba/, wherever the
    # module sits inside it.
    assert forward_state._TBA_DIR == os.path.dirname(os.path.abspath(tba.__file__))
