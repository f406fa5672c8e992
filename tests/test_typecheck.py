"""The type checker CI runs (`bash .ci/dev.sh types`: mypy with [tool.mypy] in pyproject.toml)
covers tba/ with the strictness the configuration promises: strict in tba.cache and
tba.integrations, relaxed only in the ROK job."""

from __future__ import annotations

import pathlib

import pytest

api = pytest.importorskip("mypy.api", reason="mypy comes with the typecheck extra")

ROOT = pathlib.Path(__file__).resolve().parents[1]
UNTYPED = "\n\ndef _untyped_helper(x):\n    return x\n"
WRONG = "\n\n_wrong: int = 'not an int'\n"


def _mypy_with(path: str, extra: str, tmp_path: pathlib.Path) -> tuple[str, int]:
    """mypy (the project's configuration) on ``path`` as if ``extra`` were appended to it."""
    shadow = tmp_path / pathlib.Path(path).name
    shadow.write_text((ROOT / path).read_text() + extra)
    stdout, stderr, status = api.run([
        "--config-file", str(ROOT / "pyproject.toml"), "--no-error-summary",
        "--shadow-file", str(ROOT / path), str(shadow), str(ROOT / path),
    ])
    return stdout + stderr, status


@pytest.mark.slow
def test_the_configuration_checks_all_of_tba_strictly_where_it_promises(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # the configuration's paths and mypy's cache are the repository's
    files = ["tba/cache/observe/clock.py", "tba/integrations/registry.py", "tba/plan/_types.py"]
    for path in files:
        out, status = _mypy_with(path, UNTYPED, tmp_path)
        assert status == 1 and "no-untyped-def" in out and path in out, (path, out)
    # The ROK job is relaxed (unannotated helpers allowed), yet its bodies are checked.
    out, status = _mypy_with("tba/rok/_schedule.py", UNTYPED, tmp_path)
    assert status == 0, out
    out, status = _mypy_with("tba/rok/_schedule.py", WRONG, tmp_path)
    assert status == 1 and "[assignment]" in out, out
