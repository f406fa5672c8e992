"""The ``tba`` command, and an install from the built wheel into a fresh virtual environment."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

import tba
from tba import cli

REPO = Path(__file__).resolve().parents[1]


def test_help_lists_the_commands(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name}" in out for name in ("plan", "rok", "check", "hook"))
    assert cli.main([]) == 2 and "usage: tba COMMAND" in capsys.readouterr().err
    assert cli.main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"tba {tba.__version__}"


def test_unknown_command_names_the_choices(capsys):
    assert cli.main(["plot"]) == 2
    assert "unknown command 'plot'; choose from plan, rok, check, hook" in capsys.readouterr().err


def test_subcommands_forward_their_arguments(capsys):
    assert cli.main(["plan", "--model", "llama3-8b", "--brief"]) == 0
    assert "llama: 32 layers" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    assert capsys.readouterr().out.startswith("usage: tba plan")
    with pytest.raises(SystemExit):
        cli.main(["hook", "--help"])
    assert capsys.readouterr().out.startswith("usage: tba hook")
    with pytest.raises(SystemExit):
        cli.main(["rok", "--strategies", "nope"])
    assert "unknown strategies ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["check", "--help"])
    assert capsys.readouterr().out.startswith("usage: tba check")


@pytest.mark.parametrize("package", ["plan", "rok", "testing"])
def test_tool_packages_have_no_import_cycle(package):
    # A package's modules import their siblings (``from tba.plan._types import ...`` or
    # ``from tba.plan import _report``), never a name defined by the package's __init__.
    root = REPO / "tba" / package
    modules = {p.stem for p in root.glob("*.py")}
    for path in root.glob("_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == f"tba.{package}":
                assert {a.name for a in node.names} <= modules, f"{path.name} imports tba.{package}'s __init__"
            elif isinstance(node, ast.ImportFrom) and node.module == "tba":
                assert package not in {a.name for a in node.names}, f"{path.name} imports tba.{package}"


def test_test_helpers_are_not_shipped():
    assert not list((REPO / "tba").glob("_plan*.py")) and not (REPO / "tba" / "plan.py").exists()
    assert all("measure" not in p.name for p in (REPO / "tba" / "plan").iterdir())


def test_docstring_examples_run():
    import doctest

    import tba.plan
    import tba.plan._estimate

    for module in (tba.plan, tba.plan._estimate):
        result = doctest.testmod(module, raise_on_error=False, verbose=False)
        assert result.attempted > 0 and result.failed == 0, module.__name__


@pytest.mark.skipif(not shutil.which("objdump"), reason="needs objdump (binutils) to read the ELF header")
def test_hook_library_links_only_what_manylinux_allows():
    # manylinux wheels may link glibc's libraries only; the hook links no CUDA, cuFile or libstdc++.
    from tba import malloc_hook

    try:
        path = malloc_hook.library_path()
    except malloc_hook.MallocHookError as e:
        pytest.fail(f"the hook library is not built: {e}")
    dynamic = subprocess.run(["objdump", "-p", str(path)], capture_output=True, text=True, timeout=60, check=True)
    needed = {line.split()[1] for line in dynamic.stdout.splitlines() if line.strip().startswith("NEEDED")}
    assert needed and needed <= {"libc.so.6", "libdl.so.2", "libpthread.so.0", "ld-linux-x86-64.so.2",
                                 "ld-linux-aarch64.so.1"}, needed


def test_rok_names_the_missing_extra(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli.main(["rok", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "tba rok: needs matplotlib" in err and "pip install 'tba[test,bench]'" in err


def _run(args: list[str], timeout_s: float, **kw) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, **kw)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(map(str, args))} took more than {timeout_s} s: {e.stderr}")
    assert proc.returncode == 0, f"{' '.join(map(str, args))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv(tmp_path):
    # Build the wheel (isolated build, as pip install . does), install it into a new venv that
    # sees this environment's torch/transformers/matplotlib through a .pth line (never
    # reinstalled: torch is pinned), then run the commands from outside the checkout.
    dist, venv, work = tmp_path / "dist", tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "wheel", "--no-deps", "-q", "-w", str(dist), str(REPO)], 300)
    (wheel,) = dist.glob("tba-*.whl")
    platform_tag = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert wheel.name == f"tba-{tba.__version__}-py3-none-{platform_tag}.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(f"tba-{tba.__version__}.dist-info/METADATA").decode()
        entry_points = z.read(f"tba-{tba.__version__}.dist-info/entry_points.txt").decode()
        license_text = z.read(f"tba-{tba.__version__}.dist-info/licenses/LICENSE").decode()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "License-Expression: Apache-2.0" in metadata and "Classifier: Typing :: Typed" in metadata
    assert "Project-URL:" in metadata
    assert "tba = tba.cli:main" in entry_points
    assert {"tba/malloc_hook/libtba_cuda_malloc_hook.so", "tba/plan/__main__.py", "tba/rok/_worker.py",
            "tba/cli.py"} <= names
    assert not any("measure" in n or n.startswith("tests/") for n in names)
    if sys.platform == "linux" and importlib.util.find_spec("auditwheel") is not None:
        # What PyPI takes: the release script's auditwheel repair gives a manylinux tag (the
        # library links libc only), and that wheel is the one installed below.
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        _run([sys.executable, "-m", "auditwheel", "repair", "-w", str(tmp_path / "repaired"), str(wheel)],
             120, env=env)
        (wheel,) = (tmp_path / "repaired").glob("tba-*.whl")
        assert re.fullmatch(rf"tba-{re.escape(tba.__version__)}-py3-none-manylinux_2_\d+_\w+\.whl", wheel.name), wheel.name

    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], 120)
    site = Path(_run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     60).stdout.strip())
    (site / "_outer_site.pth").write_text(str(Path(torch.__file__).resolve().parents[1]) + "\n")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch==2.13.0\n")
    _run([*pip, "--python", str(venv / "bin" / "python"), "install", "-q", "-c", str(constraints), str(wheel)], 300)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TBA_HOOK_LIBRARY"))}
    tba_exe = str(venv / "bin" / "tba")
    where = _run([str(venv / "bin" / "python"), "-c", "import tba, torch; print(tba.__file__, torch.__version__)"],
                 60, cwd=work, env=env).stdout.split()
    assert where[0].startswith(str(site)) and where[1].split("+")[0] == "2.13.0"  # the wheel's tba, torch untouched
    assert "commands:" in _run([tba_exe, "--help"], 60, cwd=work, env=env).stdout
    out = _run([tba_exe, "plan", "--model", "llama3-8b"], 60, cwd=work, env=env).stdout
    assert "layer.mlp.silu_output" in out and "[--drive samsung-990pro-2tb (default)]" in out
    hook = Path(_run([tba_exe, "hook", "--path"], 60, cwd=work, env=env).stdout.strip())
    assert hook.is_file() and hook.is_relative_to(site)
    _run([tba_exe, "rok", "--quick", "--out", str(work / "rok")], 240, cwd=work, env=env)
    report = json.loads((work / "rok" / "rok_curve.json").read_text())
    assert report["environment"]["command"].startswith("tba rok --quick")
    assert {r["strategy"] for r in report["rows"] if r["status"] == "ok"} >= {"keep", "recompute"}
    assert (work / "rok" / "rok_curve.png").stat().st_size > 10_000
