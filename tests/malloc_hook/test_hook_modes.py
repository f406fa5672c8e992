"""Which allocations the hook registers (issue 16, finding 11): only tba's tagged ones with
``TBA_HOOK_REGISTER=tba`` (Note [Tagged allocations]), none during a CUDA graph capture (Note
[No registration while capturing]), and the Python-side shortfall check against
``torch.cuda.memory_reserved()`` (Note [Registration shortfall]).

Driven through the fake runtime and cuFile, as in test_hook.py; the fake runtime models the
capture queries (fakes/fake_cudart.c) and the fake app makes cudaMalloc calls the way
PyTorch's allocator does during a capture (fakes/fake_app.c).
"""

from __future__ import annotations

import dataclasses

import pytest

from tba import malloc_hook
from tba.malloc_hook import HookStatus, registration_shortfall
from tests.malloc_hook.test_hook import assert_fake_consistent, lifecycles

MiB = 1 << 20


def registered_ptrs(report: dict) -> set[int]:
    return {ptr for kind, ptr, _ in report["events"] if kind == "R"}


def test_tba_mode_registers_only_tagged_allocations(run_ops) -> None:
    ops = [
        ["malloc", "weights", 8 * MiB],
        ["tagged", "reload", 8 * MiB],
        ["malloc", "optimizer", 8 * MiB],
        ["tagged", "small", 1024],  # tagged but below the threshold
        ["status", "live"],
        ["free_all", None],
        ["status", "end"],
    ]
    report = run_ops(ops, TBA_HOOK_REGISTER="tba")

    assert registered_ptrs(report) == {report["ptrs"]["reload"]}
    live = report["snapshots"]["live"]
    assert live["register_mode"] == "tba"
    assert (live["num_registered"], live["num_skipped_untagged"], live["num_failed"]) == (1, 2, 0)
    assert live["registered_bytes"] == 8 * MiB
    assert lifecycles(report)[report["ptrs"]["reload"]] == [("MRDF", 8 * MiB)]
    assert report["snapshots"]["end"]["num_live_registered"] == 0
    assert_fake_consistent(report)


def test_all_mode_is_the_default_and_ignores_tags(run_ops) -> None:
    ops = [["malloc", "a", 8 * MiB], ["tagged", "b", 8 * MiB], ["status", "s"], ["free_all", None]]
    report = run_ops(ops)
    s = report["snapshots"]["s"]
    assert (s["register_mode"], s["num_registered"], s["num_skipped_untagged"]) == ("all", 2, 0)


def test_tag_is_restored_after_the_block(run_ops) -> None:
    ops = [["tagged", "in", 8 * MiB], ["malloc", "after", 8 * MiB], ["free_all", None]]
    report = run_ops(ops, TBA_HOOK_REGISTER="tba")
    assert registered_ptrs(report) == {report["ptrs"]["in"]}


def test_invalid_register_mode_keeps_all_and_says_so(run_ops) -> None:
    s = run_ops([["status", "s"]], TBA_HOOK_REGISTER="weights")["snapshots"]["s"]
    assert s["register_mode"] == "all"
    assert "TBA_HOOK_REGISTER=weights" in s["last_error"] and "tba" in s["last_error"]


@pytest.mark.parametrize("mode", ["all", "tba"])
def test_no_registration_during_capture_by_pytorchs_allocator(run_ops, mode: str) -> None:
    # PyTorch's allocator mallocs during a capture with the thread's capture mode relaxed.
    ops = [
        ["tagged", "before", 8 * MiB],
        ["malloc_capturing", "captured", 8 * MiB],
        ["tagged", "after", 8 * MiB],
        ["status", "s"],
        ["free_all", None],
        ["status", "end"],
    ]
    report = run_ops(ops, TBA_HOOK_REGISTER=mode)

    assert all(rc == 0 for rc in report["rcs"].values())  # the allocation itself succeeded
    assert registered_ptrs(report) == {report["ptrs"]["before"], report["ptrs"]["after"]}
    s = report["snapshots"]["s"]
    expected_untagged = 1 if mode == "tba" else 0  # untagged is decided before capture
    assert (s["num_skipped_capturing"], s["num_skipped_untagged"]) == (1 - expected_untagged, expected_untagged)
    assert (s["num_registered"], s["num_failed"]) == (2, 0)
    assert report["snapshots"]["end"]["num_live_registered"] == 0
    assert_fake_consistent(report)


@pytest.mark.parametrize(("capture", "name"), [(1, "active"), (906, "implicit")])
def test_no_registration_while_the_legacy_stream_reports_a_capture(run_ops, capture: int, name: str) -> None:
    ops = [
        ["legacy_capture", capture],
        ["malloc", "captured", 8 * MiB],
        ["legacy_capture", 0],
        ["malloc", "after", 8 * MiB],
        ["status", "s"],
        ["free_all", None],
    ]
    report = run_ops(ops)

    assert registered_ptrs(report) == {report["ptrs"]["after"]}, name
    s = report["snapshots"]["s"]
    assert (s["num_skipped_capturing"], s["num_registered"], s["num_failed"]) == (1, 1, 0)
    # The capture query's error is not left for PyTorch's next launch check to find.
    assert report["pending_last_error"] == 0


def _status(**fields: object) -> HookStatus:
    base = dict(
        preloaded=True, enabled=True, num_allocations=10, num_registered=10, num_failed=0,
        registered_bytes=0, last_error=None, num_frees=0, num_deregistered=0,
        num_deregister_failed=0, num_live_registered=10, min_bytes=4 * MiB, max_segments=65536,
        cufile_state="ready", allocator_problem=None, register_mode="all",
    )
    base.update(fields)
    return HookStatus(**base)


def test_shortfall_logic_with_injected_numbers() -> None:
    reserved = 8 << 30
    assert registration_shortfall(_status(registered_bytes=reserved // 2), reserved) is None
    short = registration_shortfall(_status(registered_bytes=reserved // 2 - 1), reserved)
    assert short is not None and str(reserved) in short and str(reserved // 2 - 1) in short
    assert "TBA_HOOK_MIN_BYTES" in short
    # Causes the hook counted are named.
    capturing = registration_shortfall(_status(registered_bytes=0, num_skipped_capturing=3), reserved)
    assert capturing is not None and "3 allocations made during CUDA graph capture" in capturing
    failed = registration_shortfall(_status(num_failed=2, last_error="CU_FILE_NOMEM_ERROR"), reserved)
    assert failed is not None and "CU_FILE_NOMEM_ERROR" in failed
    # Not a shortfall: tba mode registers a small share on purpose; little memory; no preload.
    assert registration_shortfall(_status(register_mode="tba"), reserved) is None
    assert registration_shortfall(_status(), 255 * MiB) is None
    assert registration_shortfall(_status(preloaded=False), reserved) is None


def test_shortfall_warning_is_shown_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from tba.malloc_hook import _diagnosis

    monkeypatch.setattr(_diagnosis, "status", lambda: _status(registered_bytes=MiB))
    monkeypatch.setattr(_diagnosis, "_warned_shortfall", False)
    with pytest.warns(RuntimeWarning, match="bounce buffers") as caught:
        first = malloc_hook.warn_if_registration_short(4 << 30)
        second = malloc_hook.warn_if_registration_short(4 << 30)
    assert first is not None and first == second
    assert len([w for w in caught if "bounce buffers" in str(w.message)]) == 1
    monkeypatch.setattr(_diagnosis, "status", lambda: _status(registered_bytes=3 << 30))
    assert malloc_hook.warn_if_registration_short(4 << 30) is None


def test_status_fields_match_the_c_struct() -> None:
    # The ctypes mirror of struct tba_hook_status: 15 fields, 8 bytes each, no padding.
    from tba.malloc_hook._status import _StatusStruct

    assert [name for name, _ in _StatusStruct._fields_][-4:] == [
        "cufile_state", "register_mode", "num_skipped_capturing", "num_skipped_untagged"
    ]
    assert dataclasses.fields(HookStatus)[-3].name == "register_mode"


def test_tagged_allocations_without_preload_is_harmless() -> None:
    import ctypes

    if hasattr(ctypes.CDLL(None), "tba_hook_get_status"):
        pytest.skip("pytest itself runs with the hook preloaded")
    with malloc_hook.tagged_allocations():
        pass
