"""Helpers for the SSD offloader tests: child Python processes with hard timeouts, a fake
``libcuda.so.1`` for kvikio on machines without a driver, and typed test tensors."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]

# Sizes that hit the edges: one byte, under one sector, just over one page, over a 1 MiB stripe
# and several staging chunks, with an odd tail.
EDGE_SIZES = (1, 511, 4097, 3 * (1 << 20) + 1)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.uint8)

# The kvikio pins this project tests against (a --no-deps install: no cupy, no CUDA toolkit).
KVIKIO_PIP = (
    "pip install --no-deps kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 nvidia-cufile==1.20.0.107 "
    "rapids-logger==0.3.0 cuda-pathfinder==1.9.0"
)


def typed_tensor(num_bytes: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` with about ``num_bytes`` bytes (rounded up to whole elements) of
    random bit patterns (NaN payloads included for floats; 0/1 for bool)."""
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = max(1, -(-num_bytes // itemsize))
    if dtype == torch.bool:
        t = torch.randint(0, 2, (numel,), generator=gen, dtype=torch.uint8).bool()
    else:
        t = torch.randint(0, 256, (numel * itemsize,), generator=gen, dtype=torch.uint8).view(dtype)
    return t.to(device)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D uint8 tensor (a view, no copy)."""
    return t.contiguous().view(-1).view(torch.uint8)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    env.pop("TBA_SSD_DIR", None)
    env.update(extra or {})
    return env


def start_python(
    code: str, *, cwd: Path, env: dict[str, str] | None = None, wrapper: list[str] | None = None
) -> subprocess.Popen:
    """Start ``python -c code`` in its own session (so a hang can be killed with its children).

    ``wrapper`` is a command line prefix; ``{python}`` and ``{code}`` in it are replaced.
    """
    argv = [sys.executable, "-c", textwrap.dedent(code)]
    if wrapper:
        argv = [part.replace("{python}", sys.executable).replace("{code}", textwrap.dedent(code)) for part in wrapper]
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=env or child_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_python(
    code: str,
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 60,
    check: bool = True,
    wrapper: list[str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``python -c code`` with a hard timeout; fail the test (not hang) if it runs over."""
    proc = start_python(code, cwd=cwd, env=env, wrapper=wrapper)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        stdout, stderr = proc.communicate()
        pytest.fail(f"child process ran over {timeout_s}s and was killed\nstdout:\n{stdout}\nstderr:\n{stderr}")
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if check and result.returncode != 0:
        pytest.fail(f"child process exited with {result.returncode}\nstdout:\n{stdout}\nstderr:\n{stderr}")
    return result


# --- kvikio without a GPU ---------------------------------------------------------------------

# The driver symbols libkvikio 26.x resolves with dlsym when it loads libcuda.so.1 (found by
# loading it against a library that lacked them, one at a time), plus the unversioned names
# older releases use. Every call fails with CUDA_ERROR_NOT_INITIALIZED (3) except the version
# and device-count queries, which is what kvikio's compat mode needs for host buffers.
_FAILING_SYMBOLS = """
cuInit cuMemHostAlloc cuMemFreeHost cuMemHostRegister cuMemHostRegister_v2 cuMemHostUnregister
cuMemcpyHtoD cuMemcpyHtoD_v2 cuMemcpyDtoH cuMemcpyDtoH_v2 cuMemcpyHtoDAsync cuMemcpyHtoDAsync_v2
cuMemcpyDtoHAsync cuMemcpyDtoHAsync_v2 cuMemcpyAsync cuMemcpyBatchAsync cuMemcpyBatchAsync_v2
cuPointerGetAttribute cuPointerGetAttributes cuCtxCreate cuCtxCreate_v2 cuCtxCreate_v3
cuCtxCreate_v4 cuCtxDestroy cuCtxDestroy_v2 cuCtxPushCurrent cuCtxPushCurrent_v2 cuCtxPopCurrent
cuCtxPopCurrent_v2 cuCtxGetCurrent cuCtxGetDevice cuMemGetAddressRange cuMemGetAddressRange_v2
cuDeviceGet cuDeviceGetAttribute cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRelease
cuDevicePrimaryCtxRelease_v2 cuDevicePrimaryCtxGetState cuStreamSynchronize cuStreamCreate
cuStreamDestroy cuStreamDestroy_v2 cuEventSynchronize cuEventCreate cuEventDestroy
cuEventDestroy_v2 cuEventRecord cuEventQuery cuLaunchHostFunc cuGetProcAddress cuGetProcAddress_v2
""".split()


def fake_libcuda_source() -> str:
    lines = [
        "/* Fake CUDA driver for tests on machines without a GPU: see tests/offloaders/ssd_helpers.py */",
        "typedef int CUresult;",
        "#define NOT_INITIALIZED 3",
        "CUresult cuDriverGetVersion(int *v) { if (v) *v = 13000; return 0; }",
        "CUresult cuDeviceGetCount(int *n) { if (n) *n = 0; return 0; }",
        'CUresult cuGetErrorName(CUresult e, const char **s) { (void)e; if (s) *s = "CUDA_ERROR_NOT_INITIALIZED"; return 0; }',
        'CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; if (s) *s = "initialization error (fake libcuda)"; return 0; }',
    ]
    lines += [f"CUresult {name}(void) {{ return NOT_INITIALIZED; }}" for name in _FAILING_SYMBOLS]
    return "\n".join(lines) + "\n"


def build_fake_libcuda(directory: Path) -> Path:
    """Compile the fake ``libcuda.so.1`` into ``directory`` (skips the test without a C compiler)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler (cc) to build the fake libcuda.so.1")
    source = directory / "fake_libcuda.c"
    source.write_text(fake_libcuda_source())
    library = directory / "libcuda.so.1"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(source)], check=True, timeout=60)
    return directory


def require_kvikio() -> None:
    if importlib.util.find_spec("kvikio") is None:
        pytest.skip(f"kvikio is not installed; CI installs it with: {KVIKIO_PIP}")


def kvikio_env(libcuda_dir: Path, log_dir: Path) -> dict[str, str]:
    """Environment for a kvikio child: compat mode forced on, fake driver first on the path,
    cuFile's log out of the working directory."""
    return child_env(
        {
            "KVIKIO_COMPAT_MODE": "ON",
            "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(libcuda_dir), os.environ.get("LD_LIBRARY_PATH", "")])),
            "CUFILE_LOGFILE_PATH": str(log_dir / "cufile.log"),
            "CUDA_VISIBLE_DEVICES": "",
        }
    )


def tmpfs_wrapper(mount_point: Path, options: str) -> list[str]:
    """A command prefix running the child in a private mount namespace with a tmpfs (``options``,
    e.g. ``size=2m`` or ``ro``) on ``mount_point``; skips the test where that is not allowed."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) for a private tmpfs")
    probe = subprocess.run(
        [unshare, "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {mount_point}"],
        capture_output=True, timeout=30,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace here: {probe.stderr.decode().strip()}")
    return [unshare, "-m", "sh", "-c", f'mount -t tmpfs -o {options} tmpfs "$0" && exec "$1" -c "$2"',
            str(mount_point), "{python}", "{code}"]


# --- silent corruption ------------------------------------------------------------------------

TAMPER_KINDS = ("bit_flip", "garbage", "zeroed_range", "truncated", "swapped_extents")


def tamper(kind: str, token, other=None) -> None:
    """Change the bytes of ``token``'s first extent on disk behind the offloader's back, the way
    a flaky drive or another program would. ``other`` (a token of the same size) is needed for
    ``swapped_extents``. Written with fsync, so O_DIRECT reads see it."""
    extent = token.extents[0]
    path, offset, size = extent.slab.path, extent.data_offset, extent.stop - extent.start
    with open(path, "r+b", buffering=0) as f:
        if kind == "bit_flip":
            f.seek(offset + size // 2)
            byte = f.read(1)[0]
            f.seek(offset + size // 2)
            f.write(bytes([byte ^ 0x10]))
        elif kind == "garbage":
            f.seek(offset)
            f.write(os.urandom(size))
        elif kind == "zeroed_range":
            f.seek(offset + size // 4)
            f.write(bytes(min(4096, size // 2)))
        elif kind == "truncated":
            length = os.fstat(f.fileno()).st_size
            f.truncate(0)
            f.truncate(length)
        elif kind == "swapped_extents":
            second = other.extents[0]
            assert second.stop - second.start == size, "swap needs tokens of one size"
            with open(second.slab.path, "r+b", buffering=0) as g:
                f.seek(offset)
                mine = f.read(size)
                g.seek(second.data_offset)
                theirs = g.read(size)
                assert mine != theirs
                f.seek(offset)
                f.write(theirs)
                g.seek(second.data_offset)
                g.write(mine)
                os.fsync(g.fileno())
        else:
            raise ValueError(f"unknown tamper kind {kind!r}")
        os.fsync(f.fileno())


def tamper_every_extent(offloader) -> int:
    """Flip one bit in every extent the offloader holds now; returns how many were changed.

    The bit is in the last byte of the extent's first page: a stored tensor's bytes start
    within that page (at its page offset in memory, Note [Direct windows]), so this changes
    data of every tensor of at least 4 KiB."""
    changed = 0
    for slab_dir in offloader._dirs:
        for slab in list(slab_dir._slabs):
            with open(slab.path, "r+b", buffering=0) as f:
                for offset in list(slab.owners):
                    f.seek(offset + 4095)
                    byte = f.read(1)[0]
                    f.seek(offset + 4095)
                    f.write(bytes([byte ^ 0x01]))
                    changed += 1
                os.fsync(f.fileno())
    return changed
