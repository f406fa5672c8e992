"""The README is short and every docs/ page is one click from it; what the pages name exists:
links and their anchors, files of the repository, tests (``path::test_name``), and every fenced
block says its language (the command and example checks key on it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs import markdown
from tests.docs.markdown import DOCS, README, ROOT

MAX_README_LINES = 200
# Where a path named in a page must be a file or folder of the repository.
REPO_DIRS = ("tba/", "tests/", "benchmarks/", "docs/", ".ci/", "csrc/", "examples/")
LANGS = {"bash", "python", "text", "json"}


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


PAGES = pytest.mark.parametrize("page", markdown.pages(), ids=_page_id)


def test_readme_is_at_most_200_lines() -> None:
    num_lines = len(README.read_text().splitlines())
    assert num_lines <= MAX_README_LINES, (
        f"README.md has {num_lines} lines (at most {MAX_README_LINES}): move details to a docs/ page "
        "and link it from the README's table of pages")


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {target.split("#")[0] for target in markdown.links(README)}
    missing = [f"docs/{p.name}" for p in sorted(DOCS.glob("*.md")) if f"docs/{p.name}" not in linked]
    assert not missing, f"pages the README does not link (add them to its table of pages): {missing}"


@PAGES
def test_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for target in markdown.links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in markdown.anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {_page_id(file)}")
    assert not broken, f"{_page_id(page)}: {broken}"


def _named_paths(page: Path) -> list[str]:
    """Repository paths named in inline code or in a ``python``/``bash`` block (a ``*`` or a
    placeholder in capitals makes a pattern, not a path)."""
    words = [w for span in markdown.inline_code(page) for w in span.split()]
    for block in markdown.blocks(page):
        if block.lang in ("bash", "python"):
            words += re.findall(r"[\w./:-]+", block.text)
    found = []
    for word in words:
        word = word.strip("`'\",;()")
        path = word.split("::")[0].rstrip(".,:")
        looks_like_path = path.endswith("/") or re.search(r"\.\w+$", path.rsplit("/", 1)[-1])
        if (path.startswith(REPO_DIRS) and looks_like_path and "*" not in path
                and not re.search(r"[A-Z]{3,}|<", path)):
            found.append(word)
    return found


@PAGES
def test_named_files_and_tests_exist(page: Path) -> None:
    missing = []
    for word in _named_paths(page):
        path, _, test = word.partition("::")
        path = path.rstrip(".,:")
        if not (ROOT / path).exists():
            missing.append(f"{word}: no such file or folder")
        elif test and not re.search(rf"^\s*(async )?def {re.escape(test.split('[')[0])}\(", (ROOT / path).read_text(), re.M):
            missing.append(f"{word}: no test {test} in {path}")
    assert not missing, f"{_page_id(page)} names what does not exist: {missing}"


def test_the_works_with_table_names_a_test_in_every_row() -> None:
    """Each row of the README's "Works with" table: a test that exists (``file::test`` or a test
    file; ``::test`` continues the file named before it in the row), or no test and a reason."""
    text = README.read_text()
    table = text[text.index("## Works with"):].split("\n## ")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| with |")]
    assert len(rows) > 20
    problems = []
    for row in rows[1:]:  # after the header's rule
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        if len(cells) != 3:
            problems.append(f"{cells[0]}: {len(cells)} cells, expected 3 (with | status | proved by)")
            continue
        file = None
        for ref in re.findall(r"`([^`]+)`", cells[2]):
            if "/" not in ref and not ref.startswith("::"):  # a parameter id of the test before it
                if file is None or f'"{ref}"' not in (ROOT / file).read_text():
                    problems.append(f"{cells[0]}: no case {ref!r} in {file}")
                continue
            path, sep, test = ref.partition("::")
            file = path or file
            if file is None or not (ROOT / file).is_file():
                problems.append(f"{cells[0]}: {ref}: no test file")
            elif test and f"def {test}(" not in (ROOT / file).read_text():
                problems.append(f"{cells[0]}: {ref}: no test {test} in {file}")
    assert not problems, problems


@PAGES
def test_every_fenced_block_names_its_language(page: Path) -> None:
    untagged = [b.where for b in markdown.blocks(page) if b.lang not in LANGS]
    assert not untagged, f"fenced blocks without one of {sorted(LANGS)} after the fence: {untagged}"
