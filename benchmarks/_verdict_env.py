"""Environment rows of the GPU verdict: install, versions, GPU, BAR1, PCIe link, allocator
settings, kvikio mode, the filesystem of ``TBA_SSD_DIR`` and an O_DIRECT probe.

SSD checks are refused on tmpfs / overlay / ramfs (they would measure memory, not a drive): the
reason goes to RESULTS/ssd_refused.txt, which the shell script and the performance rows read.
"""

from __future__ import annotations

import errno
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from _verdict import Row, stages

SECTION = "environment"
REFUSED_FILESYSTEMS = ("tmpfs", "overlay", "ramfs", "devtmpfs")
REFUSED_FILE = "ssd_refused.txt"
_PROBE_BYTES = 1 << 20


def _nvidia_smi(*args: str) -> str | None:
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    try:
        done = subprocess.run([tool, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def bar1_total_mib(text: str) -> int | None:
    """``Total : N MiB`` of the BAR1 block in ``nvidia-smi -q -d MEMORY`` output."""
    in_bar1 = False
    for line in text.splitlines():
        if "BAR1 Memory Usage" in line:
            in_bar1 = True
        elif in_bar1 and line.strip().startswith("Total"):
            number = line.split(":", 1)[1].split()[0]
            return int(number) if number.isdigit() else None
    return None


def filesystem_of(path: str) -> tuple[str, str]:
    """(mount point, fstype) of the mount holding ``path``, from /proc/mounts."""
    best = ("/", "unknown")
    real = os.path.realpath(path)
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best[0]):
            best = (mount, fields[2])
    return best


def probe_o_direct(directory: str, buffer: memoryview) -> str | None:
    """Write and read ``buffer`` with O_DIRECT in ``directory``; None, or the error."""
    fd, path = tempfile.mkstemp(prefix="tba-odirect-", dir=directory)
    os.close(fd)
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        try:
            os.pwrite(fd, buffer, 0)
            os.preadv(fd, [buffer], 0)
        finally:
            os.close(fd)
    except OSError as error:
        return f"{errno.errorcode.get(error.errno or 0, error.errno)}: {error.strerror}"
    finally:
        os.unlink(path)
    return None


def _install_row(results: Path) -> Row:
    info = stages(results).get("install")
    if info is None or info["status"].startswith("skipped"):
        reason = info["status"] if info else "not run"
        return Row(SECTION, "install", "SKIP", None, f"{reason}: using the python as it is")
    ok = info["status"] == "ok"
    return Row(SECTION, "install", "PASS" if ok else "FAIL", info["seconds"], f"{info['status']} (install.log)")


def _ssd_rows(results: Path, cuda: bool) -> list[Row]:
    from tba import _env

    configured = _env.ssd_dirs()
    directory = configured[0] if configured else tempfile.gettempdir()
    mount, fstype = filesystem_of(directory)
    where = f"{directory} on {mount} ({fstype})"
    rows = []
    if fstype in REFUSED_FILESYSTEMS:
        reason = f"{where} is {fstype}, not a drive: SSD checks refused; set TBA_SSD_DIR to an NVMe mount"
        (results / REFUSED_FILE).write_text(reason + "\n")
        status = "FAIL" if configured else "SKIP"  # an explicit choice of tmpfs is a mistake
        rows.append(Row(SECTION, "ssd dir filesystem", status, fstype, reason))
        return rows
    rows.append(Row(SECTION, "ssd dir filesystem", "PASS", fstype, where))
    buffer = None
    kind = "page-aligned host memory"
    if cuda:
        from tba.offloaders.host_memory import HostAllocator

        buffer = HostAllocator().allocate(_PROBE_BYTES, pinned=True)
        kind = "pinned memory" if buffer.pinned else "pageable memory (pinning failed)"
        view = memoryview(buffer.tensor.numpy())
    else:
        view = memoryview(mmap.mmap(-1, _PROBE_BYTES))
    error = probe_o_direct(directory, view)
    if buffer is not None:
        del view
        buffer.release()
    rows.append(
        Row(SECTION, "O_DIRECT probe", "PASS" if error is None else "FAIL", _PROBE_BYTES,
            f"1 MiB write+read with O_DIRECT into {kind} in {directory}"
            + (f": {error}" if error else ""))
    )
    return rows


def _kvikio_row(cuda: bool) -> Row:
    import importlib.util

    if importlib.util.find_spec("kvikio") is None:
        return Row(SECTION, "kvikio mode", "SKIP", None, "kvikio not installed: ssd-kvikio rows skip")
    if not cuda:
        setting = os.environ.get("KVIKIO_COMPAT_MODE", "AUTO")
        return Row(SECTION, "kvikio mode", "SKIP", setting, "no CUDA device: GDS cannot be probed")
    import kvikio
    import kvikio.defaults

    compat = kvikio.defaults.is_compat_mode_preferred()
    threads = kvikio.defaults.get("num_threads")
    mode = "compat (POSIX bounce through host memory)" if compat else "GDS through cuFile"
    return Row(SECTION, "kvikio mode", "PASS", "compat" if compat else "gds",
               f"kvikio {kvikio.__version__}: {mode}; thread pool {threads}")


def environment_rows(results: Path) -> list[Row]:
    import torch

    import tba
    from tba.malloc_hook._alloc_conf import allocator_problem

    cuda = torch.cuda.is_available()
    rows = [_install_row(results)]
    rows.append(Row(SECTION, "versions", "PASS", torch.__version__,
                    f"python {platform.python_version()}, torch {torch.__version__}, CUDA "
                    f"{torch.version.cuda}, tba {tba.__version__} ({Path(tba.__file__).parent})"))
    if cuda:
        rows.append(Row(SECTION, "gpu", "PASS", torch.cuda.get_device_name(0),
                        f"{torch.cuda.device_count()} device(s)"))
    else:
        rows.append(Row(SECTION, "gpu", "SKIP", None, "no CUDA device: every GPU row skips"))
    memory = _nvidia_smi("-q", "-d", "MEMORY")
    bar1 = bar1_total_mib(memory) if memory else None
    if bar1 is None:
        rows.append(Row(SECTION, "BAR1", "SKIP", None, "nvidia-smi not available"))
    else:
        rows.append(Row(SECTION, "BAR1", "PASS", bar1, "MiB of BAR1 (bounds what cuFile can register)"))
    link = _nvidia_smi("--query-gpu=pcie.link.gen.current,pcie.link.width.current", "--format=csv,noheader")
    if link is None:
        rows.append(Row(SECTION, "PCIe link", "SKIP", None, "nvidia-smi not available"))
    else:
        gen, _, width = link.strip().splitlines()[0].partition(",")
        rows.append(Row(SECTION, "PCIe link", "PASS", f"gen{gen.strip()} x{width.strip()}", "current link"))
    conf = {k: os.environ[k] for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF") if k in os.environ}
    problem = allocator_problem()
    rows.append(Row(SECTION, "allocator settings", "PASS", ",".join(f"{k}={v}" for k, v in conf.items()) or "default",
                    problem or "the malloc hook sees PyTorch's cudaMalloc"))
    rows.append(_kvikio_row(cuda))
    rows.extend(_ssd_rows(results, cuda))
    return rows
