"""Shell commands as the README and docs/ pages write them, split into what would run.

A line of a ``bash`` block (or an inline span that starts like a command) becomes one or more
:class:`Command`: the program and its arguments, with the variables assigned before it. A
``$(...)`` substitution is a command of its own; ``[OPTIONAL]`` arguments and placeholders in
capitals (``RESULTS_DIR``, ``MODULE:FACTORY``) are kept as written; an argument with ``|``
alternatives (``--noise none|busy``) becomes one command per alternative.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import shlex

from tests.docs import markdown

_SUBSTITUTION = re.compile(r"\$\(([^()]*)\)")
# An inline span is a command when it starts like one and has arguments (``tba plan`` alone
# names the tool, it is not a command line).
_INLINE_COMMAND = re.compile(r"^([A-Z_]+=\S+ )*(bash|python|\.venv/bin/python|pytest|tba) \S+ \S")
SUBSTITUTED = "SUBSTITUTED"


@dataclasses.dataclass(frozen=True)
class Command:
    where: str
    env: tuple[str, ...]  # names of the variables assigned before the program
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return " ".join([*(f"{name}=..." for name in self.env), *self.argv])


def split(line: str, where: str) -> list[Command]:
    """The commands of one shell line (its substitutions first)."""
    found: list[Command] = []
    for inner in _SUBSTITUTION.findall(line):
        found += split(inner, where)
    line = _SUBSTITUTION.sub(SUBSTITUTED, line)
    words = shlex.split(line, comments=True)
    if words[:1] == ["env"]:
        words = [w for w in words[1:] if w != SUBSTITUTED]
    env = []
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        env.append(words.pop(0).partition("=")[0])
    if words[:1] == ["export"]:
        env += [w.partition("=")[0] for w in words[1:]]
        words = []
    words = [w for w in words if not re.fullmatch(r"\[[A-Z_]+\]", w)]
    alternatives = [w.split("|") if "|" in w and not w.startswith("-") else [w] for w in words]
    found += [Command(where, tuple(env), tuple(argv)) for argv in itertools.product(*alternatives)]
    return found


def documented() -> list[Command]:
    """Every command of every page: the lines of ``bash`` blocks, and inline spans that start
    like a command line."""
    found: list[Command] = []
    for page in markdown.pages():
        for block in markdown.blocks(page):
            if block.lang != "bash":
                continue
            for offset, line in enumerate(block.text.splitlines(), start=1):
                if line.strip() and not line.lstrip().startswith("#"):
                    found += split(line, f"{block.where}+{offset}")
        name = str(page.relative_to(markdown.ROOT))
        found += [c for span in markdown.inline_code(page) if _INLINE_COMMAND.match(span)
                  for c in split(span, f"{name} `{span}`")]
    return found
