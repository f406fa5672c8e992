"""tba/settings.py is the one place of tba's tuning constants, and docs/settings.md lists them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tba.settings

ROOT = Path(__file__).resolve().parents[1]


def test_the_settings_page_lists_every_constant_with_a_value() -> None:
    page = (ROOT / "docs" / "settings.md").read_text()
    rows = dict(re.findall(r"^\| `([A-Z_]+)` \| ([^|]+) \|", page, flags=re.MULTILINE))
    assert set(rows) == set(tba.settings.__all__), (
        "docs/settings.md and tba.settings.__all__ differ: "
        f"missing on the page {sorted(set(tba.settings.__all__) - set(rows))}, "
        f"on the page but not in tba.settings {sorted(set(rows) - set(tba.settings.__all__))}")
    for name in tba.settings.__all__:
        assert isinstance(getattr(tba.settings, name), (int, float)), name


def test_no_module_defines_its_own_page_size() -> None:
    """One page-size definition: ``mmap.PAGESIZE`` and a literal 4096 constant appear only in
    tba/settings.py."""
    offenders = []
    for path in (ROOT / "tba").rglob("*.py"):
        if path.name == "settings.py" and path.parent.name == "tba":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "PAGESIZE":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} mmap.PAGESIZE")
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and node.value.value == 4096):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} = 4096")
    assert not offenders, f"use tba.settings.PAGE_BYTES / DIRECT_IO_ALIGNMENT: {offenders}"
