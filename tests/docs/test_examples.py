"""The Python the README and docs/ pages show: every block compiles, every ``tba.`` name they
use exists, and the examples a user copies first run as written (on a tiny model, on the CPU,
with the names they leave to the user, such as ``build_model`` and ``loader``, given)."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

import tba
from tests import models
from tests.docs import markdown
from tests.docs.markdown import Block

PYTHON_BLOCKS = [b for page in markdown.pages() for b in markdown.blocks(page) if b.lang == "python"]
# `tba.` followed by a name, not a file name such as tba.json.
_TBA_NAME = re.compile(r"\btba(?:\.[A-Za-z_]\w*)+(?!\w|\.\w)")
_FILE_SUFFIXES = {"json", "py", "md", "so", "whl"}


def _block(page: str, line: str) -> Block:
    """The block of ``page`` holding ``line`` (the examples this file runs)."""
    found = [b for b in PYTHON_BLOCKS if str(b.page.relative_to(markdown.ROOT)) == page and line in b.text]
    assert len(found) == 1, f"{page}: the example holding {line!r} is gone or repeated: update {Path(__file__).name}"
    return found[0]


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.where)
def test_python_block_compiles(block: Block) -> None:
    compile(block.text, block.where, "exec")


def _module_file(parts: list[str]) -> Path | None:
    base = markdown.ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _defines(file: Path, name: str) -> bool:
    """``name`` is defined, assigned or imported at the top level of ``file`` (read, not
    imported: tba.integrations.hf would import transformers' Trainer, tens of seconds)."""
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name.split(".")[0]) == name for a in node.names):
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return False


def _resolves(name: str) -> bool:
    """A module of tba, or a name in one: imported modules are asked, others read."""
    parts = name.split(".")
    cut = max(n for n in range(1, len(parts) + 1) if _module_file(parts[:n]) is not None)
    module, rest = ".".join(parts[:cut]), parts[cut:]
    if not rest:
        return True
    if module not in sys.modules and len(rest) == 1:
        return _defines(_module_file(parts[:cut]), rest[0])  # type: ignore[arg-type]
    obj = importlib.import_module(module)
    try:
        for attr in rest:
            obj = getattr(obj, attr)
    except AttributeError:
        return False
    return True


def test_every_tba_name_the_pages_use_exists() -> None:
    names = set()
    for page in markdown.pages():
        texts = [b.text for b in markdown.blocks(page) if b.lang == "python"] + markdown.inline_code(page)
        names |= {(page.name, n) for text in texts for n in _TBA_NAME.findall(text)
                  if n.rsplit(".", 1)[1] not in _FILE_SUFFIXES}
    assert len(names) > 50
    missing = sorted(f"{page}: {name}" for page, name in names if not _resolves(name))
    assert not missing, f"names the pages use that tba does not have: {missing}"


class _Output:
    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


class _TinyModel(models.Stack):
    """The README's ``build_model()``: a small stack of blocks called as ``model(**batch)``,
    whose ``.cuda()`` stays on the CPU (there is no GPU in CI)."""

    def forward(self, x: torch.Tensor) -> _Output:  # type: ignore[override]
        return _Output(super().forward(x))

    def cuda(self, device=None) -> _TinyModel:  # type: ignore[override]
        return self


def _user_names() -> dict:
    """What the examples leave to the user: a model, its batches, an optimizer."""
    torch.manual_seed(0)
    names: dict = {"loader": [{"x": models.vector_batch(seed)} for seed in range(3)]}

    def build_model() -> _TinyModel:
        model = _TinyModel(num_blocks=3, width=16)
        names["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
        return model

    names["build_model"] = build_model
    return names


def test_the_readme_usage_example_runs() -> None:
    """As written (``offload_devices`` left at ``("cuda",)``), on the CPU: every step is counted
    and tba says why it offloaded nothing, naming the option that would."""
    names = _user_names()
    with pytest.warns(UserWarning, match=r"offloaded nothing.*offload_devices=\('cpu',\)"):
        exec(compile(_block("README.md", "tba.configure_tensor_cache(model").text, "README.md", "exec"), names)
    cache = tba.get_tensor_cache(names["model"])
    assert cache is not None, "the README's one line left the model without a cache"
    assert cache.stats(cumulative=True).num_steps == len(names["loader"])
    cache.close()


def test_the_handle_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)  # it writes tba.json
    names = {**_user_names(), "tba": tba}
    names["model"] = names["build_model"]()
    exec(compile(_block("docs/usage.md", "cache.export_trace(").text, "docs/usage.md", "exec"), names)
    assert (tmp_path / "tba.json").stat().st_size > 0
    assert "step" in capsys.readouterr().out
    assert tba.get_tensor_cache(names["model"]) is None, "cache.close() left the cache on the model"


def test_the_check_parity_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/testing.md's example prints the report it shows (byte counts aside)."""
    page = markdown.ROOT / "docs" / "testing.md"
    block = _block("docs/testing.md", "report = check_parity(model, batches, offloader=\"ssd\"")
    printed = next(b for b in markdown.blocks(page) if b.lang == "text" and b.line > block.line).text
    exec(compile(block.text, block.where, "exec"), {})
    out = capsys.readouterr().out
    assert out.splitlines()[:2] == printed.splitlines()[:2]
    assert re.sub(r"[0-9.]+ MiB", "", out) == re.sub(r"[0-9.]+ MiB", "", printed)
