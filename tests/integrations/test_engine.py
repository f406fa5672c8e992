"""The skeleton every pipeline integration shares (tba/integrations/_engine.py) and the one
home of the action names (tba/cache/steps/stages.py). In-process, no engine needed."""

from __future__ import annotations

import types
import typing

import pytest

from tba.cache.steps import stages
from tba.integrations import _hints, torch_pipelining
from tba.integrations._engine import Engine, import_extra, wrapper
from tba.integrations._patching import IntegrationVersionError, VersionRange


def _demo_engine(install) -> tuple[Engine, types.SimpleNamespace]:
    target = types.SimpleNamespace(a=lambda: "a", b=lambda: "b")
    engine = Engine(
        "demo", VersionRange("0", "99"), module="json", distribution="no-such-distribution",
        check=lambda version: target, install=install,
    )
    return engine, target


def test_patch_that_fails_halfway_restores_everything():
    originals = {}

    def install(target):
        originals.update(a=target.a, b=target.b)
        engine.patches.replace_attr(target, "a", lambda: "patched")
        raise RuntimeError("second replacement failed")

    engine, target = _demo_engine(install)
    with pytest.raises(RuntimeError, match="second replacement failed"):
        engine.patch()
    assert target.a is originals["a"] and not engine.is_patched()


def test_check_failure_patches_nothing():
    def check(version):
        raise engine.mismatch(version, "demo.thing does not exist")

    engine, target = _demo_engine(lambda t: pytest.fail("install ran after a failed check"))
    engine._check = check
    with pytest.raises(IntegrationVersionError, match=r"demo.thing does not exist.*>=0,<99"):
        engine.patch()
    assert not engine.is_patched()


def test_record_runs_keeps_the_run_only_while_it_runs():
    engine, _ = _demo_engine(lambda t: None)
    seen = []

    def schedule(x):
        seen.append(engine.current_run())
        return x * 2

    wrapped = engine.record_runs(schedule, lambda x: ("run", x))
    assert wrapped(3) == 6 and seen == [("run", 3)] and engine.runs == []
    assert wrapped.__tba_original__ is schedule and wrapped.__name__ == "schedule"
    skipped = engine.record_runs(schedule, lambda x: None)  # None: not recorded
    assert skipped(1) == 2 and seen[-1] is None

    def failing(x):
        raise ValueError("boom")

    with pytest.raises(ValueError):
        engine.record_runs(failing, lambda x: ("run", x))(1)
    assert engine.runs == []  # removed even when the schedule raises


def test_wrapper_records_the_original():
    def original():
        """doc"""

    @wrapper(original)
    def replacement():
        return 1

    assert replacement.__tba_original__ is original and replacement.__doc__ == "doc"


def test_missing_extra_names_the_pip_install():
    expected = r"tba.integrations.demo needs no_such_module_x: pip install 'tba\[demo\]'"
    with pytest.raises(ImportError, match=expected):
        import_extra("no_such_module_x", "tba.integrations.demo", "demo")


def test_action_names_have_one_home():
    assert _hints.Action is stages.Action
    assert stages.ACTIONS == typing.get_args(stages.Action)
    assert set(torch_pipelining.ACTION_OF_COMPUTATION_TYPE.values()) == set(stages.ACTIONS)
    for action in stages.ACTIONS:  # every name is one set_stage accepts
        stages.StageHint(0, 0, action)
