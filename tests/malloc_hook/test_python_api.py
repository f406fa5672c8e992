"""tba.malloc_hook's Python side in this (not preloaded) process: finding the library, the
command line, allocator-setting detection, and that nothing is ever loaded by accident."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from tba import malloc_hook
from tba.malloc_hook import __main__ as cli
from tba.malloc_hook import _library
from tba.malloc_hook._alloc_conf import allocator_problem, parse_alloc_conf
from tests.malloc_hook.hook_helpers import HookBuild, child_env, run_python


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TBA_HOOK_LIBRARY", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)


def _preloaded() -> bool:
    return hasattr(ctypes.CDLL(None), "tba_hook_get_status")


def _mapped(name: str) -> bool:
    return name in Path("/proc/self/maps").read_text()


def test_status_without_preload_loads_nothing() -> None:
    if _preloaded():
        pytest.skip("pytest itself runs with the hook preloaded")
    s = malloc_hook.status()
    assert s.preloaded is False
    assert (s.enabled, s.num_allocations, s.num_registered, s.num_failed) == (False, 0, 0, 0)
    assert (s.registered_bytes, s.last_error, s.cufile_state) == (0, None, "not_loaded")
    assert not _mapped(malloc_hook.LIBRARY_NAME)


def test_set_enabled_needs_the_preload() -> None:
    if _preloaded():
        pytest.skip("pytest itself runs with the hook preloaded")
    with pytest.raises(malloc_hook.MallocHookError, match="LD_PRELOAD"):
        malloc_hook.set_enabled(False)


def test_gds_registration_problem_names_the_preload() -> None:
    if _preloaded():
        pytest.skip("pytest itself runs with the hook preloaded")
    assert "LD_PRELOAD=$(python -m tba.malloc_hook --path)" in malloc_hook.gds_registration_problem()


def test_library_path_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    library = tmp_path / "custom.so"
    library.write_bytes(b"")
    monkeypatch.setenv("TBA_HOOK_LIBRARY", str(library))
    assert malloc_hook.library_path() == str(library.resolve())
    monkeypatch.setenv("TBA_HOOK_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(malloc_hook.MallocHookError, match="TBA_HOOK_LIBRARY=.*missing.so is not a file"):
        malloc_hook.library_path()


def test_library_path_search_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    package_dir, installed = tmp_path / "package", tmp_path / "site" / malloc_hook.LIBRARY_NAME
    package_dir.mkdir()
    monkeypatch.setattr(_library, "_package_dirs", lambda: [package_dir])
    monkeypatch.setattr(_library, "_installed_copies", lambda: [installed])
    with pytest.raises(malloc_hook.MallocHookError, match=r"pip install \.") as error:
        malloc_hook.library_path()
    assert "TBA_HOOK_LIBRARY" in str(error.value) and "cmake" in str(error.value)

    installed.parent.mkdir()
    installed.write_bytes(b"")
    assert malloc_hook.library_path() == str(installed.resolve())  # editable installs
    (package_dir / malloc_hook.LIBRARY_NAME).write_bytes(b"")
    assert malloc_hook.library_path() == str((package_dir / malloc_hook.LIBRARY_NAME).resolve())


def test_find_cufile_in_wheel_layouts(tmp_path: Path) -> None:
    assert _library.find_cufile_in([tmp_path]) is None
    for relative in ("cufile/lib", "cu9/lib", "cu13/lib", "cu12/lib"):
        (tmp_path / relative).mkdir(parents=True)
        (tmp_path / relative / "libcufile.so.0").write_bytes(b"")
    assert _library.find_cufile_in([tmp_path]) == str((tmp_path / "cu13/lib/libcufile.so.0").resolve())
    found = malloc_hook.cufile_library_path()
    assert found is None or Path(found).is_file()


def test_cli_path(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    library = tmp_path / malloc_hook.LIBRARY_NAME
    library.write_bytes(b"")
    monkeypatch.setenv("TBA_HOOK_LIBRARY", str(library))
    assert cli.main(["--path"]) == 0
    assert capsys.readouterr().out == f"{library.resolve()}\n"
    assert cli.main(["--env"]) == 0
    assert capsys.readouterr().out.startswith(f"LD_PRELOAD={library.resolve()}")


def test_cli_path_not_built(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(_library, "_package_dirs", lambda: [tmp_path])
    monkeypatch.setattr(_library, "_installed_copies", lambda: [])
    assert cli.main(["--path"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and "pip install ." in captured.err


def test_python_dash_m(hook_build: HookBuild) -> None:
    result = run_python(["-m", "tba.malloc_hook", "--path"], env=child_env(hook_build, preload=False))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(hook_build.hook.resolve())


def test_cli_status_under_preload(hook_build: HookBuild) -> None:
    result = run_python(["-m", "tba.malloc_hook", "--status"], env=child_env(hook_build))
    assert result.returncode == 0, result.stderr
    assert '"preloaded": true' in result.stdout


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", {}),
        ("expandable_segments:True", {"expandable_segments": "True"}),
        (
            " max_split_size_mb : 128 , roundup_power2_divisions:[256:1,512:2],backend:native",
            {"max_split_size_mb": "128", "roundup_power2_divisions": "[256:1,512:2]", "backend": "native"},
        ),
    ],
)
def test_parse_alloc_conf(value: str, expected: dict[str, str]) -> None:
    assert parse_alloc_conf(value) == expected


@pytest.mark.parametrize(
    ("variable", "value", "problem"),
    [
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", "expandable_segments"),
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:true,max_split_size_mb:64", "expandable_segments"),
        ("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync", "backend"),
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False", None),
        ("PYTORCH_CUDA_ALLOC_CONF", "backend:native,max_split_size_mb:128", None),
    ],
)
def test_allocator_problem(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, problem: str | None
) -> None:
    monkeypatch.setenv(variable, value)
    found = allocator_problem()
    if problem is None:
        assert found is None
    else:
        assert found is not None and variable in found and f"remove {problem}" in found
        assert malloc_hook.status().allocator_problem == found


def test_pytorch_alloc_conf_takes_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    # PyTorch reads PYTORCH_ALLOC_CONF first and then ignores PYTORCH_CUDA_ALLOC_CONF.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:128")
    assert allocator_problem() is None
