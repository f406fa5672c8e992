"""Every command the README and docs/ pages give runs as written: cheap ones run (``tba plan``,
``tba hook``, ``tba --help``), expensive ones (a benchmark, the ROK sweep, ``tba check``, a
script of .ci/) are given to the argument parser of the program they name, which must accept
them; scripts named exist, variables set before a command are ones it reads, extras and
pinned versions exist. A command no rule knows fails: add a rule for it here."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import re
import runpy
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tba import cli
from tests.docs import commands
from tests.docs.commands import SUBSTITUTED, Command
from tests.docs.markdown import ROOT

DEV_SH = ROOT / ".ci" / "dev.sh"
# Programs of the user's own that a documented command launches (the part tba gives is
# checked: the substitution or variable before it).
USER_PROGRAMS = {"torchrun", "train.py"}
# Variables read by programs other than tba's.
FOREIGN_VARIABLES = {"LD_PRELOAD", "LD_LIBRARY_PATH", "KVIKIO_COMPAT_MODE", "CUBLAS_WORKSPACE_CONFIG"}
DOCUMENTED = commands.documented()


class _Parsed(Exception):
    """The program's argument parser accepted its arguments (raised in place of running it)."""


def _dev_sh_commands() -> list[str]:
    case = re.search(r'case "\$what" in ([\w|-]+)\)', DEV_SH.read_text())
    assert case, "the command list of .ci/dev.sh (its case line) moved: update this test"
    return case.group(1).split("|")


@contextlib.contextmanager
def _parse_only(monkeypatch: pytest.MonkeyPatch):
    """``ArgumentParser.parse_args`` parses, then stops the program instead of letting it run."""
    real = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        real(self, args, namespace)
        raise _Parsed

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        yield


def _accepted(call, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """``call()`` stopped by the parser (or, for ``--help``, its exit 0), never by an error."""
    try:
        call()
    except _Parsed:
        return
    except SystemExit as stop:
        err = capsys.readouterr().err
        assert stop.code == 0 and "--help" in argv, f"the parser refused {argv}: {err}"
        return
    pytest.fail(f"{argv}: ran without parsing its arguments with argparse")


def _script(path: str, argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    script = ROOT / path
    assert script.is_file(), f"{path}: no such script"
    with _parse_only(monkeypatch), monkeypatch.context() as m:
        m.setattr(sys, "argv", [str(script), *argv])
        m.setattr(sys, "path", [str(script.parent), *sys.path])
        _accepted(lambda: runpy.run_path(str(script), run_name="__main__"), argv, capsys)


def _tba(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    sub = argv[0] if argv else None
    if sub == "rok":
        from tba.rok._cli import _parse_args  # argparse and the checks after it

        def parse() -> None:
            _parse_args(argv[1:], "tba rok")
            raise _Parsed

        _accepted(parse, argv, capsys)
    elif sub == "check":
        from tba.testing._cli import _parser

        with _parse_only(monkeypatch):
            _accepted(lambda: _parser("tba check").parse_args(argv[1:]), argv, capsys)
    else:  # plan, hook, --help, --version: cheap, run them
        status = cli.main(argv)
        out, err = capsys.readouterr()
        assert status == 0, f"tba {' '.join(argv)} exited {status}: {err}"
        assert out.strip(), f"tba {' '.join(argv)} printed nothing"


def _bash(argv: list[str], env: tuple[str, ...], monkeypatch, capsys) -> None:
    script = ROOT / argv[0]
    assert script.is_file(), f"{argv[0]}: no such script"
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    for name in env:
        assert re.search(rf"\b{name}\b", script.read_text()), f"{argv[0]} does not read {name}"
    if script == DEV_SH:
        assert argv[1:2] and argv[1] in _dev_sh_commands(), f"{argv}: .ci/dev.sh has {_dev_sh_commands()}"
        if argv[1] == "main":  # the rest goes to the main job's parser
            _tba(["rok", *argv[2:]], monkeypatch, capsys)
        elif argv[1] != "types":  # test, test-slow, load: the rest goes to pytest
            _pytest(argv[2:])


def _pytest(argv: list[str]) -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    markers = {m.split(":")[0] for m in config["markers"]}
    words = iter(argv)
    for word in words:
        if word == "-m":
            named = set(re.findall(r"\w+", next(words))) - {"and", "or", "not"}
            assert named <= markers, f"{argv}: markers {named - markers} are not registered"
        elif word == "-p":
            importlib.import_module(next(words))
        elif not word.startswith("-"):
            assert (ROOT / word.split("::")[0]).exists(), f"{argv}: no {word}"


def _pip(argv: list[str]) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pinned = (ROOT / ".ci" / "install_optional.sh").read_text()
    for word in argv[2:]:
        extra = re.fullmatch(r"tba\[(\w+)\]", word)
        if extra:
            assert extra.group(1) in extras, f"{argv}: no extra {extra.group(1)} in pyproject.toml"
        elif "==" in word:
            assert word in pinned, f"{argv}: {word} is not the version .ci/install_optional.sh installs"


def _variables_read(env: tuple[str, ...]) -> None:
    sources = "".join(p.read_text() for p in [*ROOT.glob("tba/**/*.py"), *ROOT.glob("csrc/**/*.c")])
    for name in env:
        assert name in FOREIGN_VARIABLES or re.search(rf"\b{name}\b", sources), f"nothing in tba reads {name}"


@pytest.mark.parametrize("command", DOCUMENTED, ids=str)
def test_documented_command_runs_as_written(command: Command, monkeypatch, capsys) -> None:
    argv = list(command.argv)
    if not argv:  # an `export` line
        _variables_read(command.env)
        return
    if argv[:2] == ["nice", "-n"]:  # a priority, then the command
        argv = argv[3:]
    program = argv[0]
    if program == "bash":
        _bash(argv[1:], command.env, monkeypatch, capsys)
        return
    _variables_read(command.env)
    if program in ("python", ".venv/bin/python") and argv[1:3] in (["-m", "tba.plan"], ["-m", "tba.malloc_hook"]):
        argv = ["tba", "plan" if argv[2] == "tba.plan" else "hook", *argv[3:]]
        program = "tba"
    if program in ("python", ".venv/bin/python") and argv[1:3] == ["-m", "pytest"]:
        _pytest(argv[3:])
    elif program == "pytest":
        _pytest(argv[1:])
    elif program == "tba":
        _tba(argv[1:], monkeypatch, capsys)
    elif program in ("python", ".venv/bin/python"):
        _script(argv[1], argv[2:], monkeypatch, capsys)
    elif program == "pip":
        _pip(argv)
    elif program == "cmake":
        source = argv[argv.index("-S") + 1] if "-S" in argv else None
        assert source is None or (ROOT / source / "CMakeLists.txt").is_file(), f"{argv}: no {source}/CMakeLists.txt"
    elif program in USER_PROGRAMS or program == SUBSTITUTED:
        assert command.env or SUBSTITUTED in argv or len(argv) <= 2, f"{command}: only the user's program"
    else:
        pytest.fail(f"{command.where}: no rule checks `{command}`: add one to {Path(__file__).name}")


def test_the_pages_give_the_commands_of_both_jobs() -> None:
    """The README's two commands, the slow tests and the checks are among what is checked."""
    readme = {" ".join(c.argv) for c in DOCUMENTED if c.where.startswith("README.md")}
    assert {"bash .ci/dev.sh main", "bash .ci/dev.sh test", "bash .ci/dev.sh test-slow"} <= readme, readme


def test_ci_runs_every_check_the_readme_gives() -> None:
    """What the README calls CI's checks is what .ci/run runs: every .ci/dev.sh command the README
    gives but the main job, in .ci/run, and nothing of dev.sh that the README leaves out; the
    everyday tests before the slow ones."""
    run = (ROOT / ".ci" / "run").read_text()
    in_ci = re.findall(r"^(?:exec )?bash \.ci/dev\.sh ([\w-]+)", run, re.MULTILINE)
    readme = [c.argv[2] for c in DOCUMENTED
              if c.where.startswith("README.md") and c.argv[:2] == ("bash", ".ci/dev.sh")]
    assert set(readme) - {"main"} == set(in_ci), f"README gives {readme}, .ci/run runs {in_ci}"
    assert set(in_ci) | {"main"} == set(_dev_sh_commands()), f".ci/dev.sh has {_dev_sh_commands()}, .ci/run runs {in_ci}"
    assert in_ci.index("test") < in_ci.index("test-slow"), in_ci


def test_dev_sh_refuses_an_unknown_command_and_lists_its_own() -> None:
    proc = subprocess.run(["bash", str(DEV_SH), "no-such-command"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert all(name in proc.stderr for name in _dev_sh_commands()), proc.stderr
