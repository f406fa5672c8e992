"""Where the hook library and cuFile are on disk. Finding them never loads either."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Iterable
from pathlib import Path

from tba import _env
from tba.malloc_hook._errors import MallocHookError

__all__ = ["LIBRARY_NAME", "library_path", "cufile_library_path"]

LIBRARY_NAME = "libtba_cuda_malloc_hook.so"

_NOT_BUILT = (
    f"{LIBRARY_NAME} was not found next to the tba.malloc_hook package or among the installed "
    "files of the tba distribution. Build it by installing tba from source (`pip install .` "
    "or `pip install -e .`, which run CMake), or build it yourself with "
    "`cmake -S csrc/cuda_malloc_hook -B build/hook && cmake --build build/hook` and set "
    f"TBA_HOOK_LIBRARY=build/hook/{LIBRARY_NAME}."
)


def _package_dirs() -> list[Path]:
    from tba import malloc_hook

    return [Path(entry) for entry in malloc_hook.__path__]


def _installed_copies() -> list[Path]:
    """The library as recorded in the installed distribution's file list: this is where it is
    for editable installs, whose package directory is the source tree."""
    try:
        files = importlib.metadata.distribution("tba").files or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [Path(str(entry.locate())) for entry in files if entry.name == LIBRARY_NAME]


def library_path() -> str:
    """Absolute path of the hook library, for ``LD_PRELOAD``.

    Looks at ``TBA_HOOK_LIBRARY`` first, then next to this package, then in the installed
    distribution's files.

    Returns:
        The path of ``libtba_cuda_malloc_hook.so``.

    Raises:
        MallocHookError: ``TBA_HOOK_LIBRARY`` names no file, or the library is not built; the
            message says how to build it.

    Example:
        >>> import os, subprocess, tba.malloc_hook
        >>> env = {**os.environ, "LD_PRELOAD": tba.malloc_hook.library_path()}
        >>> subprocess.run(["torchrun", "train.py"], env=env)  # doctest: +SKIP
    """
    override = _env.hook_library()
    if override is not None:
        path = Path(override).expanduser()
        if not path.is_file():
            raise MallocHookError(
                f"TBA_HOOK_LIBRARY={override} is not a file: point it at a built {LIBRARY_NAME}, "
                "or unset it to use the library installed with tba"
            )
        return str(path.resolve())
    for candidate in [directory / LIBRARY_NAME for directory in _package_dirs()] + _installed_copies():
        if candidate.is_file():
            return str(candidate.resolve())
    raise MallocHookError(_NOT_BUILT)


def find_cufile_in(roots: Iterable[str | Path]) -> str | None:
    """``libcufile.so.0`` under the given ``nvidia`` package directories, newest CUDA first."""
    for root in roots:
        # nvidia-cufile for CUDA 13 ships nvidia/cu13/lib, the CUDA 12 wheel nvidia/cufile/lib.
        versioned = {}
        for path in Path(root).glob("cu*/lib/libcufile.so.0"):
            if path.parts[-3][2:].isdigit():
                versioned[int(path.parts[-3][2:])] = path
        matches = [versioned[version] for version in sorted(versioned, reverse=True)]
        matches += sorted(Path(root).glob("cufile/lib/libcufile.so.0"))
        if matches:
            return str(matches[0].resolve())
    return None


def cufile_library_path() -> str | None:
    """Path of ``libcufile.so.0`` from an installed ``nvidia-cufile`` wheel, or None.

    The hook loads cuFile by its soname unless ``TBA_HOOK_CUFILE_LIBRARY`` says otherwise; the
    wheel's copy is not on the loader's search path, so pass this path to the hook.

    Example:
        >>> tba.malloc_hook.cufile_library_path()  # doctest: +SKIP
        '/venv/lib/python3.11/site-packages/nvidia/cu13/lib/libcufile.so.0'
    """
    spec = importlib.util.find_spec("nvidia")
    if spec is None or spec.submodule_search_locations is None:
        return None
    return find_cufile_in(spec.submodule_search_locations)
