"""``tba check MODULE:FACTORY``: the factory contract, the options, the exit status."""

from __future__ import annotations

from pathlib import Path

import pytest

from tba import cli

pytest.importorskip("transformers")

FACTORIES = "tests.testing.factories"


def test_a_passing_model_exits_0_and_prints_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", f"{FACTORIES}:tiny_gpt2", "--force"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("tba parity check: PASS (offloader 'host', 3 steps)")
    assert "GPT2LMHeadModel" in captured.err and "step 3 of 3 bit-identical" in captured.err


def test_ssd_from_the_command_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["check", f"{FACTORIES}:tiny_gpt2", "--force", "--offloader", "ssd", "--ssd-dir", str(tmp_path),
            "-o", "ssd_engine=posix", "--steps", "2", "-q"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("tba parity check: PASS (offloader 'ssd', 2 steps)")
    assert captured.err == ""


def test_a_dict_factory_with_options_and_a_file_path(capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(__file__).with_name("factories.py")
    assert cli.main(["check", f"{path}:tiny_stack_with_options", "--steps", "4", "--chaos",
                     "--chaos-max-delay-ms", "1", "-q"]) == 0
    assert "PASS (offloader 'host', 4 steps)" in capsys.readouterr().out


def test_a_failing_check_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", f"{FACTORIES}:corrupting_gpt2", "--force", "-q"]) == 1
    assert capsys.readouterr().out.startswith("tba parity check: FAIL (offloader 'corrupting(fake)'")
    # Nothing moved (a CPU model, offload_devices left at ("cuda",)): a failure too.
    with pytest.warns(UserWarning, match="offloaded nothing"):
        assert cli.main(["check", f"{FACTORIES}:tiny_gpt2", "-q"]) == 1
    assert "nothing was offloaded" in capsys.readouterr().out


def test_command_line_options_win_over_the_factorys(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.warns(UserWarning, match="offloaded nothing"):
        code = cli.main(["check", f"{FACTORIES}:tiny_stack_with_options", "-o", "offload_devices=('cuda',)", "-q"])
    assert code == 1 and "offload_devices=('cuda',)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["nocolon"], "expected MODULE:FACTORY"),
    (["tests.testing.no_such_module:f"], "cannot import 'tests.testing.no_such_module'"),
    ([f"{FACTORIES}:nothing_here"], "has no function 'nothing_here'"),
    ([f"{FACTORIES}:not_a_model"], "returned a int; expected (model, batches) or a dict"),
    (["missing/file.py:f"], "no such file: missing/file.py"),
    ([f"{FACTORIES}:tiny_gpt2", "-o", "novalue"], "expected NAME=VALUE"),
    ([f"{FACTORIES}:tiny_gpt2", "--steps", "0"], "--steps 0: expected a number of steps >= 1"),
    ([f"{FACTORIES}:tiny_gpt2", "-o", "colour=3"], "colour: unknown option"),
    ([f"{FACTORIES}:tiny_gpt2", "--force", "-o", "adaptive=True"], "adaptive=True with force=True"),
])
def test_usage_errors_exit_2_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tba check: ") and message in err
