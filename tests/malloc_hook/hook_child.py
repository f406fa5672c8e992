"""Child process of the malloc hook tests: runs under LD_PRELOAD, prints one JSON report.

Usage: python hook_child.py '{"ops": [...], "app_mode": "local" | "global" | "none"}'

The fake app (FAKE_APP) calls cudaMalloc/cudaFree through its PLT, as PyTorch does; it is
loaded RTLD_LOCAL (the CUDA runtime then sits outside the global scope, as when torch loads it)
or RTLD_GLOBAL, or not at all. Operations:

    ["malloc", name, size]             cudaMalloc through the app; rc and pointer kept by name
    ["malloc_many", prefix, n, size]   n of them, named prefix0 ... prefix{n-1}
    ["free", name]                     cudaFree through the app
    ["free_all", seed]                 free every live pointer, shuffled with seed (null: in order)
    ["raw_malloc", name, size]         call the process's global cudaMalloc (the hook) directly
    ["raw_free", name]                 same for cudaFree
    ["enable", bool]                   tba.malloc_hook.set_enabled; the previous value is kept
    ["status", label]                  tba.malloc_hook.status() snapshot
    ["problem", label]                 tba.malloc_hook.gds_registration_problem()
    ["stress", threads, iterations, small_bytes, large_bytes]
    ["malloc_capturing", name, size]   cudaMalloc as PyTorch makes it during a graph capture
    ["legacy_capture", status]         fake runtime: legacy stream capture status (0, 1, 906)
    ["tagged", name, size]             malloc inside tba.malloc_hook.tagged_allocations()
    ["shortfall", label, reserved]     tba.malloc_hook.registration_shortfall(status, reserved)
    ["load", path]                     dlopen a library, as kvikio loads cuFile
    ["fake_torch", reserved_bytes, backend]   a stub ``torch`` module with CUDA "initialised"
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import json
import os
import random
import sys
import types


def _import_malloc_hook() -> types.ModuleType:
    """Imports tba.malloc_hook without running tba/__init__.py, which imports torch (seconds
    per child); the malloc hook package itself needs only tba._env and tba.errors."""
    spec = importlib.util.find_spec("tba")
    package = types.ModuleType("tba")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["tba"] = package
    import tba.malloc_hook

    return tba.malloc_hook


malloc_hook = _import_malloc_hook()


class _FakeStats(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "num_mallocs",
            "num_frees",
            "num_registers",
            "num_deregisters",
            "num_live_registered",
            "num_freed_while_registered",
            "num_double_registers",
            "num_unknown_deregisters",
            "num_events_dropped",
        )
    ]


class _FakeEvent(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_uint64), ("ptr", ctypes.c_uint64), ("size", ctypes.c_uint64)]


def _fake_torch(reserved_bytes: int, backend: str) -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(
        is_initialized=lambda: True,
        get_allocator_backend=lambda: backend,
        memory_reserved=lambda: reserved_bytes,
    )
    return torch


def main() -> None:
    spec = json.loads(sys.argv[1])
    mode = spec.get("app_mode", "local")
    app = None
    if mode != "none":
        scope = ctypes.RTLD_GLOBAL if mode == "global" else ctypes.RTLD_LOCAL
        app = ctypes.CDLL(os.environ["FAKE_APP"], mode=scope)
        app.app_malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        app.app_free.argtypes = [ctypes.c_void_p]
        app.app_stress.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t]
        app.app_malloc_capturing.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    cudart = ctypes.CDLL(os.environ["FAKE_CUDART"]) if app is not None else None
    process = ctypes.CDLL(None)
    report: dict = {"ptrs": {}, "sizes": {}, "rcs": {}, "snapshots": {}, "problems": {}, "enable_prev": []}
    live: dict[str, int] = {}

    def malloc(name: str, size: int, function) -> None:
        ptr = ctypes.c_void_p()
        report["rcs"][name] = function(ctypes.byref(ptr), ctypes.c_size_t(size))
        report["ptrs"][name] = ptr.value or 0
        report["sizes"][name] = size
        if ptr.value:
            live[name] = ptr.value

    def free(name: str, function) -> None:
        report["rcs"][f"free:{name}"] = function(ctypes.c_void_p(live.pop(name)))

    for op, *args in spec["ops"]:
        if op == "malloc":
            malloc(args[0], args[1], app.app_malloc)
        elif op == "malloc_many":
            for i in range(args[1]):
                malloc(f"{args[0]}{i}", args[2], app.app_malloc)
        elif op == "free":
            free(args[0], app.app_free)
        elif op == "free_all":
            names = list(live)
            if args[0] is not None:
                random.Random(args[0]).shuffle(names)
            for name in names:
                free(name, app.app_free)
        elif op == "raw_malloc":
            process.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
            malloc(args[0], args[1], process.cudaMalloc)
        elif op == "raw_free":
            process.cudaFree.argtypes = [ctypes.c_void_p]
            report["rcs"][f"free:{args[0]}"] = process.cudaFree(ctypes.c_void_p(live.get(args[0], 1)))
        elif op == "enable":
            report["enable_prev"].append(malloc_hook.set_enabled(args[0]))
        elif op == "status":
            report["snapshots"][args[0]] = dataclasses.asdict(malloc_hook.status())
        elif op == "problem":
            report["problems"][args[0]] = malloc_hook.gds_registration_problem()
        elif op == "stress":
            report["stress_errors"] = app.app_stress(*args)
        elif op == "malloc_capturing":
            malloc(args[0], args[1], app.app_malloc_capturing)
        elif op == "legacy_capture":
            cudart.fake_set_legacy_capture(args[0])
        elif op == "tagged":
            with malloc_hook.tagged_allocations():
                malloc(args[0], args[1], app.app_malloc)
        elif op == "shortfall":
            report["problems"][args[0]] = malloc_hook.registration_shortfall(malloc_hook.status(), args[1])
        elif op == "load":
            ctypes.CDLL(args[0])
        elif op == "fake_torch":
            sys.modules["torch"] = _fake_torch(args[0], args[1])
        else:
            raise ValueError(f"unknown op {op!r}")

    if cudart is not None:
        report["pending_last_error"] = cudart.fake_peek_last_error()
        stats = _FakeStats()
        cudart.fake_get_stats(ctypes.byref(stats))
        report["fake"] = {name: int(getattr(stats, name)) for name, _ in _FakeStats._fields_}
        events = (_FakeEvent * 65536)()
        cudart.fake_get_events.restype = ctypes.c_size_t
        n = cudart.fake_get_events(events, ctypes.c_size_t(len(events)))
        report["events"] = [[chr(e.kind), e.ptr, e.size] for e in events[:n]]
    cufile_path = os.environ.get("TBA_HOOK_CUFILE_LIBRARY", "")
    try:
        cufile = ctypes.CDLL(cufile_path, mode=os.RTLD_NOLOAD) if cufile_path else None
    except OSError:
        cufile = None
    counter = getattr(cufile, "fake_cufile_num_driver_opens", None) if cufile is not None else None
    report["driver_opens"] = counter() if counter is not None else None
    print(json.dumps(report))


if __name__ == "__main__":
    main()
