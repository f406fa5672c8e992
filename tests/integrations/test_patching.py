"""patch()/unpatch() of every engine: idempotent, exactly reversible, refusing unknown
internals with a message naming the installed version and the tested range. Plus the
module -> cache registry and the look-ahead plan. In-process, no process group."""

from __future__ import annotations

import importlib.util
import inspect
import logging
import subprocess
import sys

import pytest
import torch
from torch import nn

from tba.integrations import _patching, registry
from tba.integrations._hints import Plan, Step
from tba.integrations._patching import IntegrationVersionError
from tests.integrations._fakes import RecordingCache


def _has(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


needs_megatron = pytest.mark.skipif(
    not _has("megatron.core"),
    reason="megatron-core is not installed (pip install 'tba[integrations]')",
)
needs_deepspeed = pytest.mark.skipif(
    not _has("deepspeed"), reason="deepspeed is not installed (pip install 'tba[integrations]')"
)


def _targets_torch():
    from torch.distributed.pipelining import schedules, stage

    base = stage._PipelineStageBase
    return {
        (base, "forward_one_chunk"),
        (base, "backward_one_chunk"),
        (base, "backward_weight_one_chunk"),
        (schedules.PipelineScheduleSingle, "step"),
        (schedules.PipelineScheduleMulti, "step"),
    }


def _targets_megatron():
    from megatron.core.pipeline_parallel import schedules

    names = [
        "forward_step",
        "backward_step",
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    ]
    return {(schedules, n) for n in names}


def _snapshot(targets):
    return {(owner, name): vars(owner).get(name) for owner, name in targets}


ENGINES = [
    pytest.param("torch_pipelining", _targets_torch, id="torch"),
    pytest.param("megatron", _targets_megatron, id="megatron", marks=needs_megatron),
]


@pytest.mark.parametrize("engine, targets", ENGINES)
def test_patch_is_idempotent_and_reversible(engine, targets):
    module = importlib.import_module(f"tba.integrations.{engine}")
    before = _snapshot(targets())
    module.patch()
    try:
        patched = _snapshot(targets())
        assert all(patched[k] is not before[k] for k in before), "every target is wrapped"
        assert all(getattr(patched[k], "__tba_original__", None) is before[k] for k in before)
        module.patch()  # idempotent: no second layer
        assert _snapshot(targets()) == patched
        assert module.is_patched()
    finally:
        module.unpatch()
    after = _snapshot(targets())
    assert all(after[k] is before[k] for k in before), "unpatch restores the exact originals"
    module.unpatch()  # idempotent
    assert not module.is_patched()


@needs_deepspeed
def test_deepspeed_patch_is_idempotent_and_reversible():
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from tba.integrations import deepspeed as tds

    table_before = dict(PipelineEngine._INSTRUCTION_MAP)
    exec_before = vars(PipelineEngine)["_exec_schedule"]
    tds.patch()
    try:
        table = dict(PipelineEngine._INSTRUCTION_MAP)
        assert table.keys() == table_before.keys()
        assert all(table[k].__tba_original__ is table_before[k] for k in table)
        assert vars(PipelineEngine)["_exec_schedule"].__tba_original__ is exec_before
        tds.patch()
        assert dict(PipelineEngine._INSTRUCTION_MAP) == table
    finally:
        tds.unpatch()
    assert dict(PipelineEngine._INSTRUCTION_MAP) == table_before
    assert vars(PipelineEngine)["_exec_schedule"] is exec_before
    # DualPipeV copies the map at import: it must hold the originals, not tba's wrappers.
    from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine

    assert not any(
        hasattr(f, "__tba_original__") for f in DualPipeVEngine._INSTRUCTION_MAP.values()
    )


def test_unknown_internals_fail_with_version_and_range(monkeypatch):
    from torch.distributed.pipelining import stage

    from tba.integrations import torch_pipelining as tp

    def forward_one_chunk(self, chunk, args):  # renamed parameter: not what tba checked
        raise AssertionError

    monkeypatch.setattr(stage._PipelineStageBase, "forward_one_chunk", forward_one_chunk)
    before = _snapshot(_targets_torch())
    with pytest.raises(IntegrationVersionError) as info:
        tp.patch()
    message = str(info.value)
    assert torch.__version__ in message and str(tp.TESTED_VERSIONS) in message
    assert "fwd_chunk_id" in message
    assert not tp.is_patched() and _snapshot(_targets_torch()) == before  # nothing patched


def test_missing_attribute_fails_with_version_and_range(monkeypatch):
    from torch.distributed.pipelining import stage

    from tba.integrations import torch_pipelining as tp

    monkeypatch.delattr(stage._PipelineStageBase, "backward_weight_one_chunk")
    with pytest.raises(IntegrationVersionError, match="backward_weight_one_chunk does not exist"):
        tp.patch()
    assert not tp.is_patched()


@needs_megatron
def test_megatron_unknown_internals_fail(monkeypatch):
    from megatron.core.pipeline_parallel import schedules

    from tba.integrations import megatron as tm

    monkeypatch.setattr(schedules, "backward_step", lambda a, b, c: None)
    with pytest.raises(IntegrationVersionError, match=r"megatron.*0\.16"):
        tm.patch()
    assert not tm.is_patched()


@needs_deepspeed
def test_deepspeed_unknown_internals_fail(monkeypatch):
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from tba.integrations import deepspeed as tds

    table = dict(PipelineEngine._INSTRUCTION_MAP)
    del table[schedule.RecvGrad]
    monkeypatch.setattr(PipelineEngine, "_INSTRUCTION_MAP", table)
    with pytest.raises(IntegrationVersionError, match="_INSTRUCTION_MAP has no RecvGrad"):
        tds.patch()
    assert not tds.is_patched()


def test_untested_version_warns_once(caplog):
    caplog.set_level(logging.WARNING, logger="tba.integrations._patching")
    tested = _patching.VersionRange("1.0", "1.1")
    _patching.warn_if_untested("demo", "1.0.5", tested)
    _patching.warn_if_untested("demo", "9.0", tested)
    _patching.warn_if_untested("demo", "9.0", tested)
    assert [r.getMessage() for r in caplog.records].count(
        "tba.integrations.demo: installed version 9.0 is outside the tested range >=1.0,<1.1; "
        "the patched internals look as expected, continuing"
    ) == 1


def test_version_range():
    tested = _patching.VersionRange("2.13", "2.14")
    assert "2.13.0+cpu" in tested and "2.13.1" in tested
    assert "2.14.0" not in tested and "2.11.0" not in tested and "garbage" not in tested


def test_unpatch_refuses_to_drop_a_later_patch():
    from torch.distributed.pipelining import stage

    from tba.integrations import torch_pipelining as tp

    base = stage._PipelineStageBase
    tp.patch()
    ours = vars(base)["forward_one_chunk"]
    base.forward_one_chunk = lambda *a, **k: ours(*a, **k)  # someone patches on top
    try:
        with pytest.raises(_patching.TBAError, match="replaced again"):
            tp.unpatch()
    finally:
        base.forward_one_chunk = ours
        tp.unpatch()
    assert not tp.is_patched()


def test_import_has_no_side_effects():
    code = (
        "import sys, tba.integrations, tba.integrations.megatron, tba.integrations.deepspeed, "
        "tba.integrations.torch_pipelining\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('megatron', 'deepspeed')]\n"
        "assert not bad, bad\n"
        "from torch.distributed.pipelining import stage\n"
        "assert not hasattr(stage._PipelineStageBase.forward_one_chunk, '__tba_original__')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------------------------- registry
def test_registry_lookup_exact_wrapper_and_submodule():
    inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    wrapper = nn.Sequential(inner)
    cache = RecordingCache()
    registry.register(cache, inner)
    try:
        assert registry.lookup(inner) is cache
        assert registry.lookup(wrapper) is cache  # DDP-like wrapper around the registered one
        assert registry.lookup(inner[1]) is cache  # a submodule of the registered one
        assert registry.lookup(nn.Linear(2, 2)) is None
        with pytest.raises(ValueError, match="already has a tensor cache"):
            registry.register(RecordingCache(), inner)
    finally:
        registry.unregister(cache)
    assert registry.lookup(inner) is None and registry.lookup(wrapper) is None


def test_registry_holds_modules_weakly():
    import gc

    module = nn.Linear(2, 2)
    cache = RecordingCache()
    registry.register(cache, module)
    count = len(registry.registered())
    del module
    gc.collect()
    assert len(registry.registered()) == count - 1


def test_registry_holds_caches_weakly():
    """A cache holds its module: a strong value would keep the weak key alive forever, and a
    cache dropped without close() would never be collected."""
    import gc
    import weakref

    module = nn.Linear(2, 2)
    cache = RecordingCache()
    registry.register(cache, module)
    assert registry.lookup(module) is cache
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None
    assert registry.lookup(module) is None


# ------------------------------------------------------------------------------ look-ahead
def test_plan_gives_each_cache_its_own_next_step():
    """Note [one cache per stage module]: stage 0's cache is told its next step even when
    stage 2's steps run in between."""
    a, b = RecordingCache(), RecordingCache()
    steps = [Step(0, 3, "forward"), Step(2, 1, "backward"), Step(0, 2, "backward")]
    plan = Plan(steps, {0: a, 2: b}.get)
    for step in steps:
        plan.announce(step)
    assert a.lookahead_log() == [(0, 2, "backward"), (None, None, None)]
    assert b.lookahead_log() == [(None, None, None)]
    shared = RecordingCache()
    plan = Plan(steps, lambda stage: shared)
    for step in steps:
        plan.announce(step)
    assert shared.lookahead_log() == [(2, 1, "backward"), (0, 2, "backward"), (None, None, None)]


def test_plan_survives_an_unplanned_step():
    cache = RecordingCache()
    plan = Plan([Step(0, 0, "forward"), Step(0, 0, "backward")], lambda s: cache)
    plan.announce(Step(0, 7, "forward"))  # not in the plan: announced without look-ahead
    plan.announce(Step(0, 0, "forward"))
    assert plan.num_unplanned == 1
    assert cache.stage_log == [(0, 7, "forward"), (0, 0, "forward")]
    assert cache.lookahead_log() == [(None, None, None), (0, 0, "backward")]


def test_single_stage_plans_mirror_the_loops():
    """GPipe/1F1B plans are built from their loops (torch 2.13's Schedule1F1B.pipeline_order is
    wrong on the last stage); checked here without a process group."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from tba.integrations.torch_pipelining import plan_for

    class FakeStage:
        def __init__(self, index, num_stages):
            self.stage_index, self.num_stages, self.group_rank = index, num_stages, index

    def schedule(cls, index, n=4, stages=2):
        obj = cls.__new__(cls)
        obj._stage, obj._n_microbatches, obj._num_stages = FakeStage(index, stages), n, stages
        obj._has_backward = True
        return obj

    def fmt(steps):
        return " ".join(f"{s.action[0].upper()}{s.microbatch}" for s in steps)

    assert fmt(plan_for(schedule(Schedule1F1B, 1))) == "F0 B0 F1 B1 F2 B2 F3 B3"
    assert fmt(plan_for(schedule(Schedule1F1B, 0))) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert fmt(plan_for(schedule(ScheduleGPipe, 0))) == "F0 F1 F2 F3 B0 B1 B2 B3"
    assert inspect.isfunction(plan_for)
