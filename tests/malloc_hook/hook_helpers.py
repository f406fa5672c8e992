"""Building the hook from source and the fake CUDA libraries, and running processes with the
hook preloaded (the fixtures in conftest.py use these).

Tests never use an installed copy of the hook: they build ``csrc/cuda_malloc_hook`` with CMake
(same flags as the wheel, ``-Werror`` included) into a temporary directory and point tba at it
with ``TBA_HOOK_LIBRARY``, so they behave the same for source checkouts, editable and regular
installs. They never load a real cuFile either (without a driver it can spin forever): every
child gets ``TBA_HOOK_CUFILE_LIBRARY`` set to a fake or to a path that does not exist.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
HOOK_SOURCE = REPO_ROOT / "csrc" / "cuda_malloc_hook"
FAKES = Path(__file__).resolve().parent / "fakes"
CHILD = Path(__file__).resolve().parent / "hook_child.py"
CHILD_TIMEOUT_S = 60
_C_FLAGS = ["-std=c11", "-D_GNU_SOURCE", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror"]
# Variables a child must not inherit from the developer's shell.
_SCRUBBED_PREFIXES = ("TBA_HOOK_", "FAKE_CUFILE_", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


@dataclasses.dataclass(frozen=True)
class HookBuild:
    """Paths of the hook built from source and of the fake libraries."""

    hook: Path
    fake_cudart: Path  # libcudart.so.13
    fake_cufile: Path  # libcufile.so.0, soname libcufile.so.0
    fake_cufile_renamed: Path  # same code, soname libtbafakecufile.so.0, in its own directory
    fake_app: Path  # calls cudaMalloc/cudaFree through its PLT, like libc10_cuda.so


def _run(command: list[str], cwd: Path | None = None) -> None:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")


def _compile(out: Path, source: str, soname: str, link: list[str]) -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.fail("no C compiler (cc) on PATH: the malloc hook tests compile fake CUDA libraries")
    _run([compiler, *_C_FLAGS, "-o", str(out), f"-Wl,-soname,{soname}", str(FAKES / source), *link])
    return out


def build_all(root: Path) -> HookBuild:
    """Builds the hook (CMake, standalone project in csrc/cuda_malloc_hook) and the fakes (cc)
    under root."""
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.fail("cmake is not on PATH: it builds the malloc hook (pip install cmake)")
    _run([cmake, "-S", str(HOOK_SOURCE), "-B", str(root / "hook"), "-DCMAKE_BUILD_TYPE=Release"])
    _run([cmake, "--build", str(root / "hook")])
    fakes = root / "fakes"
    renamed = root / "renamed"
    fakes.mkdir()
    renamed.mkdir()
    cudart = _compile(fakes / "libcudart.so.13", "fake_cudart.c", "libcudart.so.13", ["-pthread"])
    against_cudart = [f"-L{fakes}", "-l:libcudart.so.13", f"-Wl,-rpath,{fakes}"]
    return HookBuild(
        hook=root / "hook" / "libtba_cuda_malloc_hook.so",
        fake_cudart=cudart,
        fake_cufile=_compile(fakes / "libcufile.so.0", "fake_cufile.c", "libcufile.so.0", against_cudart),
        fake_cufile_renamed=_compile(
            renamed / "libtbafakecufile.so.0", "fake_cufile.c", "libtbafakecufile.so.0", against_cudart
        ),
        fake_app=_compile(
            fakes / "libfakeapp.so", "fake_app.c", "libfakeapp.so", [*against_cudart, "-pthread"]
        ),
    )


def child_env(build: HookBuild, preload: bool = True, **extra: str) -> dict[str, str]:
    """A clean environment for a child process: hook preloaded, fake cuFile, tba importable."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(_SCRUBBED_PREFIXES)}
    env.pop("LD_PRELOAD", None)
    env["TBA_HOOK_LIBRARY"] = str(build.hook)
    env["TBA_HOOK_CUFILE_LIBRARY"] = str(build.fake_cufile)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if preload:
        env["LD_PRELOAD"] = str(build.hook)
    env.update(extra)
    return env


def run_python(
    args: list[str], env: dict[str, str], cwd: Path | None = None, timeout_s: float = CHILD_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Runs ``python ARGS`` with a hard timeout (a hung child fails the test, never the suite)."""
    try:
        return subprocess.run(
            [sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"child process timed out after {timeout_s} s: {args}\n{error.stderr}")
