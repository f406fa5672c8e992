"""The hook library under LD_PRELOAD, driven through fake CUDA runtime and cuFile libraries.

The fake runtime is the ground truth: it sees every real cudaMalloc/cudaFree, every
(de)registration the fake cuFile accepts, in order, and counts a pointer freed while registered.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import defaultdict

import pytest

from tests.malloc_hook.hook_helpers import HookBuild

DEFAULT_MIN_BYTES = 4 << 20


def lifecycles(report: dict) -> dict[int, list[tuple[str, int]]]:
    """Per pointer, its cycles in event order: (kinds, size), e.g. ("MRDF", 4096)."""
    cycles: dict[int, list[list]] = defaultdict(list)
    for kind, ptr, size in report["events"]:
        if kind == "M":
            cycles[ptr].append([kind, size])
        else:
            assert cycles[ptr], f"{kind} on {ptr:#x} before any malloc"
            cycles[ptr][-1][0] += kind
    return {ptr: [(kinds, size) for kinds, size in ptr_cycles] for ptr, ptr_cycles in cycles.items()}


def assert_each_registered_once(report: dict, min_bytes: int) -> None:
    """Every cycle at or above min_bytes is exactly malloc, register, deregister, free; every
    other one is malloc, free. So: one deregistration per registration, before the free."""
    assert not report["fake"]["num_events_dropped"]
    for ptr, cycles in lifecycles(report).items():
        for kinds, size in cycles:
            expected = "MRDF" if size >= min_bytes else "MF"
            assert kinds == expected, f"{ptr:#x} ({size} bytes): {kinds}, expected {expected}"


def assert_fake_consistent(report: dict) -> None:
    fake = report["fake"]
    assert fake["num_freed_while_registered"] == 0
    assert fake["num_double_registers"] == 0
    assert fake["num_unknown_deregisters"] == 0


@pytest.mark.parametrize("app_mode", ["local", "global"])
def test_registers_only_at_or_above_threshold(run_ops, app_mode: str) -> None:
    # app_mode covers both ways of finding the real runtime: RTLD_NEXT (global) and the
    # loaded-library search (local); see Note [Finding the real runtime].
    sizes = {"one": 1, "below": 999, "at": 1000, "above": 1001, "odd": 4097, "mib": 1 << 20}
    ops = [["malloc", name, size] for name, size in sizes.items()]
    ops += [["status", "live"], ["free_all", None], ["status", "end"]]
    report = run_ops(ops, app_mode=app_mode, TBA_HOOK_MIN_BYTES="1000")

    assert all(rc == 0 for rc in report["rcs"].values())
    registered = {ptr for kind, ptr, _ in report["events"] if kind == "R"}
    assert registered == {report["ptrs"][n] for n, size in sizes.items() if size >= 1000}
    live = report["snapshots"]["live"]
    assert (live["num_allocations"], live["num_registered"], live["num_live_registered"]) == (6, 4, 4)
    assert live["registered_bytes"] == 1000 + 1001 + 4097 + (1 << 20)
    assert (live["num_failed"], live["last_error"], live["cufile_state"]) == (0, None, "ready")
    end = report["snapshots"]["end"]
    assert (end["num_frees"], end["num_deregistered"], end["num_live_registered"]) == (6, 4, 0)
    assert end["registered_bytes"] == 0
    assert_each_registered_once(report, 1000)
    assert_fake_consistent(report)
    assert report["driver_opens"] == 1


def test_default_threshold_is_4_mib(run_ops) -> None:
    report = run_ops(
        [["malloc", "below", DEFAULT_MIN_BYTES - 1], ["malloc", "at", DEFAULT_MIN_BYTES], ["free_all", None]]
    )
    assert [kind for kind, _, _ in report["events"]].count("R") == 1
    assert_each_registered_once(report, DEFAULT_MIN_BYTES)


def test_nothing_registered_when_disabled(run_ops) -> None:
    ops = [["malloc_many", "p", 5, 8192], ["status", "live"], ["free_all", None], ["status", "end"]]
    report = run_ops(ops, TBA_HOOK_ENABLED="0", TBA_HOOK_MIN_BYTES="4096")

    assert {kind for kind, _, _ in report["events"]} == {"M", "F"}
    for snapshot in report["snapshots"].values():
        assert snapshot["enabled"] is False
        assert (snapshot["num_registered"], snapshot["num_failed"]) == (0, 0)
    assert report["snapshots"]["end"]["num_allocations"] == 5
    assert report["driver_opens"] is None  # cuFile never even loaded


def test_run_time_disable_still_deregisters_earlier_registrations(run_ops) -> None:
    ops = [
        ["malloc", "a", 8192],
        ["enable", False],
        ["malloc", "b", 8192],
        ["free", "a"],
        ["enable", True],
        ["malloc", "c", 8192],
        ["free", "b"],
        ["free", "c"],
        ["status", "end"],
    ]
    report = run_ops(ops, TBA_HOOK_MIN_BYTES="4096")

    assert report["enable_prev"] == [True, False]
    by_ptr = lifecycles(report)
    assert by_ptr[report["ptrs"]["a"]][0][0] == "MRDF"
    assert by_ptr[report["ptrs"]["b"]][0][0] == "MF"
    assert by_ptr[report["ptrs"]["c"]][-1][0] == "MRDF"
    end = report["snapshots"]["end"]
    assert (end["num_registered"], end["num_deregistered"], end["num_live_registered"]) == (2, 2, 0)
    assert_fake_consistent(report)


def test_counters_exact_with_8_threads(run_ops) -> None:
    threads, iterations = 8, 10_000
    report = run_ops(
        [["stress", threads, iterations, 64, 65536], ["status", "end"]], TBA_HOOK_MIN_BYTES="4096"
    )

    assert report["stress_errors"] == 0
    pairs = threads * iterations
    end = report["snapshots"]["end"]
    assert (end["num_allocations"], end["num_frees"]) == (pairs, pairs)
    assert (end["num_registered"], end["num_deregistered"]) == (pairs // 2, pairs // 2)
    assert (end["num_live_registered"], end["registered_bytes"], end["num_failed"]) == (0, 0, 0)
    fake = report["fake"]
    assert (fake["num_registers"], fake["num_deregisters"]) == (pairs // 2, pairs // 2)
    assert_fake_consistent(report)


def test_many_live_registrations_freed_in_random_order(run_ops) -> None:
    # Small heap blocks sit close together, so their keys collide in the table: this exercises
    # probing and backward-shift deletion.
    ops = [["malloc_many", "p", 3000, 64], ["status", "live"], ["free_all", 1234], ["status", "end"]]
    report = run_ops(ops, TBA_HOOK_MIN_BYTES="64", TBA_HOOK_MAX_SEGMENTS="3000")

    assert report["snapshots"]["live"]["num_live_registered"] == 3000
    assert report["snapshots"]["live"]["registered_bytes"] == 3000 * 64
    end = report["snapshots"]["end"]
    assert (end["num_deregistered"], end["num_live_registered"], end["num_failed"]) == (3000, 0, 0)
    assert_each_registered_once(report, 64)
    assert_fake_consistent(report)


def test_full_registry_fails_cleanly_and_recovers(run_ops) -> None:
    ops = [
        ["malloc_many", "p", 6, 4096],
        ["status", "full"],
        ["free_all", None],
        ["malloc", "again", 4096],
        ["free", "again"],
        ["status", "end"],
    ]
    report = run_ops(ops, TBA_HOOK_MIN_BYTES="4096", TBA_HOOK_MAX_SEGMENTS="4")

    assert all(rc == 0 for rc in report["rcs"].values())
    full = report["snapshots"]["full"]
    assert (full["num_registered"], full["num_failed"], full["num_live_registered"]) == (4, 2, 4)
    assert "TBA_HOOK_MAX_SEGMENTS" in full["last_error"]
    end = report["snapshots"]["end"]
    assert (end["num_registered"], end["num_deregistered"], end["num_live_registered"]) == (5, 5, 0)
    assert_fake_consistent(report)


def test_missing_cufile_allocations_still_succeed(run_ops, tmp_path) -> None:
    missing = tmp_path / "no_such_libcufile.so.0"
    ops = [["malloc", "a", 8192], ["malloc", "b", 8192], ["malloc", "small", 16], ["status", "live"]]
    ops += [["free_all", None], ["status", "end"]]
    report = run_ops(ops, TBA_HOOK_MIN_BYTES="4096", TBA_HOOK_CUFILE_LIBRARY=str(missing))

    assert all(rc == 0 for rc in report["rcs"].values())
    assert all(report["ptrs"][name] for name in ("a", "b", "small"))
    live = report["snapshots"]["live"]
    assert (live["num_allocations"], live["num_registered"], live["num_failed"]) == (3, 0, 2)
    assert live["cufile_state"] == "missing"
    assert str(missing) in live["last_error"]
    assert report["fake"]["num_frees"] == 3
    assert report["fake"]["num_registers"] == 0


def test_cufile_loaded_later_is_picked_up(run_ops, hook_build: HookBuild) -> None:
    # The soname is on no search path: found only once something (kvikio) has loaded it.
    ops = [
        ["malloc", "before", 8192],
        ["load", str(hook_build.fake_cufile_renamed)],
        ["malloc", "after", 8192],
        ["status", "live"],
        ["free_all", None],
    ]
    report = run_ops(ops, TBA_HOOK_MIN_BYTES="4096", TBA_HOOK_CUFILE_LIBRARY="libtbafakecufile.so.0")

    live = report["snapshots"]["live"]
    assert (live["num_registered"], live["num_failed"], live["cufile_state"]) == (1, 1, "ready")
    registered = {ptr for kind, ptr, _ in report["events"] if kind == "R"}
    assert registered == {report["ptrs"]["after"]}
    assert_fake_consistent(report)


def test_default_soname_finds_an_already_loaded_cufile(run_ops, hook_build: HookBuild) -> None:
    # Loaded first, so the hook's dlopen("libcufile.so.0") never searches the disk (where a
    # real cuFile could be).
    ops = [["load", str(hook_build.fake_cufile)], ["malloc", "a", 8192], ["free", "a"], ["status", "end"]]
    report = run_ops(ops, TBA_HOOK_MIN_BYTES="4096", TBA_HOOK_CUFILE_LIBRARY=None)

    end = report["snapshots"]["end"]
    assert (end["num_registered"], end["num_deregistered"], end["cufile_state"]) == (1, 1, "ready")


def test_registration_failure_is_counted(run_ops) -> None:
    ops = [["malloc", "a", 8192], ["malloc", "b", 8192], ["status", "live"], ["free_all", None]]
    report = run_ops(ops, TBA_HOOK_MIN_BYTES="4096", FAKE_CUFILE_REGISTER_ERROR="5045")

    assert all(rc == 0 for rc in report["rcs"].values())
    live = report["snapshots"]["live"]
    assert (live["num_registered"], live["num_failed"], live["num_live_registered"]) == (0, 2, 0)
    assert "CU_FILE_INTERNAL_BUF_REGISTER_ERROR" in live["last_error"]
    assert report["fake"]["num_deregisters"] == 0  # nothing to deregister at free
    assert report["fake"]["num_frees"] == 2


@pytest.mark.parametrize(
    ("open_error", "registered"), [("5001", False), ("5026", True)], ids=["fails", "already-open"]
)
def test_driver_open(run_ops, open_error: str, registered: bool) -> None:
    ops = [["malloc_many", "p", 3, 8192], ["status", "live"], ["free_all", None]]
    report = run_ops(ops, TBA_HOOK_MIN_BYTES="4096", FAKE_CUFILE_OPEN_ERROR=open_error)

    live = report["snapshots"]["live"]
    assert report["driver_opens"] == 1  # opened once, a failure is not retried
    if registered:
        assert (live["num_registered"], live["num_failed"], live["cufile_state"]) == (3, 0, "ready")
    else:
        assert (live["num_registered"], live["num_failed"], live["cufile_state"]) == (0, 3, "broken")
        assert "cuFileDriverOpen" in live["last_error"]
        assert "CU_FILE_DRIVER_NOT_INITIALIZED" in live["last_error"]


def test_library_without_cufile_symbols_is_broken(run_ops, hook_build: HookBuild) -> None:
    ops = [["malloc", "a", 8192], ["malloc", "b", 8192], ["status", "live"], ["free_all", None]]
    report = run_ops(ops, TBA_HOOK_MIN_BYTES="4096", TBA_HOOK_CUFILE_LIBRARY=str(hook_build.fake_cudart))

    live = report["snapshots"]["live"]
    assert (live["num_failed"], live["cufile_state"]) == (2, "broken")
    assert "lacks cuFileBufRegister" in live["last_error"]


def test_deregistration_failure_still_frees(run_ops) -> None:
    ops = [["malloc", "a", 8192], ["free", "a"], ["status", "end"]]
    report = run_ops(ops, TBA_HOOK_MIN_BYTES="4096", FAKE_CUFILE_DEREGISTER_ERROR="5024")

    assert report["rcs"]["free:a"] == 0
    assert report["fake"]["num_frees"] == 1
    end = report["snapshots"]["end"]
    assert (end["num_deregistered"], end["num_deregister_failed"], end["num_live_registered"]) == (1, 1, 0)
    assert "cuFileBufDeregister" in end["last_error"]
    assert "CU_FILE_MEMORY_NOT_REGISTERED" in end["last_error"]


def test_cufile_calling_cuda_malloc_passes_through(run_ops) -> None:
    # Note [Registration order]: without the re-entrancy guard this recurses until the stack
    # overflows.
    ops = [["malloc", "a", 8192], ["status", "live"], ["free", "a"], ["status", "end"]]
    report = run_ops(ops, TBA_HOOK_MIN_BYTES="4096", FAKE_CUFILE_REENTER="1")

    live = report["snapshots"]["live"]
    assert (live["num_allocations"], live["num_frees"], live["num_registered"]) == (2, 1, 1)
    assert report["fake"]["num_registers"] == 1
    assert report["snapshots"]["end"]["num_deregistered"] == 1
    assert_fake_consistent(report)


def test_without_cuda_runtime_calls_fail_cleanly(run_ops) -> None:
    ops = [["raw_malloc", "a", 8192], ["raw_free", "a"], ["status", "end"]]
    report = run_ops(ops, app_mode="none")

    assert report["rcs"] == {"a": 3, "free:a": 3}  # cudaErrorInitializationError
    end = report["snapshots"]["end"]
    assert end["num_allocations"] == 0
    assert "no CUDA runtime" in end["last_error"]


def test_settings_from_environment(run_ops) -> None:
    report = run_ops(
        [["status", "s"]], TBA_HOOK_MIN_BYTES="123", TBA_HOOK_MAX_SEGMENTS="77", TBA_HOOK_ENABLED="off"
    )
    s = report["snapshots"]["s"]
    assert (s["min_bytes"], s["max_segments"], s["enabled"], s["last_error"]) == (123, 77, False, None)


@pytest.mark.parametrize(
    ("name", "value", "field", "default"),
    [
        ("TBA_HOOK_MIN_BYTES", "4MiB", "min_bytes", DEFAULT_MIN_BYTES),
        ("TBA_HOOK_MIN_BYTES", "-1", "min_bytes", DEFAULT_MIN_BYTES),
        ("TBA_HOOK_MAX_SEGMENTS", "0", "max_segments", 65536),
        ("TBA_HOOK_ENABLED", "maybe", "enabled", True),
    ],
)
def test_invalid_settings_keep_defaults_and_say_so(run_ops, name, value, field, default) -> None:
    s = run_ops([["status", "s"]], **{name: value})["snapshots"]["s"]
    assert s[field] == default
    assert f"{name}={value}" in s["last_error"]


def test_gds_registration_problem_in_a_preloaded_process(run_ops) -> None:
    ops = [
        ["problem", "fresh"],
        ["malloc", "a", 8192],
        ["problem", "registered"],
        ["enable", False],
        ["problem", "disabled"],
        ["enable", True],
        ["fake_torch", 1 << 20, "native"],
        ["problem", "torch_ok"],
        ["fake_torch", 1 << 30, "native"],
        ["problem", "torch_short"],
        ["fake_torch", 1 << 30, "cudaMallocAsync"],
        ["problem", "torch_async"],
        ["free", "a"],
    ]
    problems = run_ops(ops, TBA_HOOK_MIN_BYTES="4096")["problems"]

    assert problems["fresh"] is None
    assert problems["registered"] is None
    assert "disabled" in problems["disabled"]
    assert problems["torch_ok"] is None  # the hook saw PyTorch's cudaMalloc
    # Note [Registration shortfall]: 8192 bytes registered of 1 GiB reserved.
    assert "8192 bytes registered" in problems["torch_short"] and str(1 << 30) in problems["torch_short"]
    assert "cudaMallocAsync" in problems["torch_async"]


def test_gds_registration_problem_when_hook_sees_no_malloc(run_ops) -> None:
    ops = [["fake_torch", 1 << 30, "native"], ["problem", "p"]]
    problem = run_ops(ops, app_mode="none")["problems"]["p"]
    assert "saw no cudaMalloc" in problem


def test_gds_registration_problem_after_failures(run_ops) -> None:
    ops = [["malloc", "a", 8192], ["problem", "p"], ["free", "a"]]
    problem = run_ops(ops, TBA_HOOK_MIN_BYTES="4096", FAKE_CUFILE_REGISTER_ERROR="5036")["problems"]["p"]
    assert "1 CUDA allocations" in problem
    assert "CU_FILE_GPU_MEMORY_PINNING_FAILED" in problem


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        ("PYTORCH_ALLOC_CONF", "max_split_size_mb:128,backend:cudaMallocAsync"),
    ],
)
def test_unhookable_allocator_is_reported(run_ops, variable: str, value: str) -> None:
    report = run_ops([["status", "s"], ["problem", "p"]], **{variable: value})
    assert variable in report["snapshots"]["s"]["allocator_problem"]
    assert report["problems"]["p"] == report["snapshots"]["s"]["allocator_problem"]


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} (binutils) is needed to inspect the built hook")
    return path


def test_exports_only_the_hook_interface(hook_build: HookBuild) -> None:
    command = [_tool("nm"), "-D", "--defined-only", str(hook_build.hook)]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in output.splitlines() if re.search(r" [TDBRV] ", line)}
    hook_api = {"tba_hook_get_status", "tba_hook_set_enabled", "tba_hook_last_error", "tba_hook_set_thread_tagged"}
    assert exported == {"cudaMalloc", "cudaFree", *hook_api}


def test_links_no_cuda(hook_build: HookBuild) -> None:
    output = subprocess.run(
        [_tool("readelf"), "-d", str(hook_build.hook)], capture_output=True, text=True, check=True
    ).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+)\]", output)
    assert needed, output
    assert not [lib for lib in needed if "cuda" in lib or "cufile" in lib], needed
