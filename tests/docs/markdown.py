"""The README and docs/ pages as data: fenced code blocks, inline code, links and heading anchors.

Only what the tests of the pages need; a fenced block is three backticks and a language tag at
the start of a line, closed by three backticks at the start of a line.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^```([\w+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_INLINE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


@dataclasses.dataclass(frozen=True)
class Block:
    """A fenced code block: the page, the line its fence opens on, the language tag, the text."""

    page: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [Block(page, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)) for m in _FENCE.finditer(text)]


def prose(page: Path) -> str:
    """The page without its fenced blocks (each replaced by an empty line)."""
    return _FENCE.sub("\n", page.read_text())


def inline_code(page: Path) -> list[str]:
    """Inline code spans of the prose; a span may wrap over a line break."""
    return [span.strip() for span in _INLINE.findall(re.sub(r"\s*\n\s*", " ", prose(page)))]


def links(page: Path) -> list[str]:
    """Targets of the page's markdown links and images."""
    return _LINK.findall(prose(page))


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation other than ``-``
    and ``_`` dropped, spaces turned into ``-``, repeats numbered."""
    seen: dict[str, int] = {}
    result = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", prose(page), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        result.add(slug if n == 0 else f"{slug}-{n}")
    return result
