#!/usr/bin/env python
"""Write/read/verify bandwidth of the SSD offloader's I/O engines against a raw O_DIRECT baseline.

Command lines (run from the repository root, venv active):

    # The numbers quoted in docs/ssd.md (256 MiB transfers, median of 7 runs, temp directory):
    python benchmarks/io_bandwidth.py --size-mib 256 --runs 7 --out out/io_bandwidth.json

    # A specific drive, posix engine only:
    python benchmarks/io_bandwidth.py --dir /mnt/nvme0 --engines posix --size-mib 1024 --runs 5

    # On a GPU machine, CUDA tensors (posix stages through pinned memory, kvikio may use GDS):
    python benchmarks/io_bandwidth.py --dir /mnt/nvme0 --device cuda --size-mib 1024

    # kvikio on a machine without a GPU needs compat mode and a libcuda.so.1 (real, or the fake
    # one the test suite builds):
    KVIKIO_COMPAT_MODE=ON LD_LIBRARY_PATH=<dir of libcuda.so.1> python benchmarks/io_bandwidth.py

    # Smoke run (what tests/benchmarks/test_io_bandwidth.py does):
    python benchmarks/io_bandwidth.py --size-mib 4 --runs 2 --engines posix --out /tmp/bw.json

Method: each run times one write and one read of --size-mib bytes for every method, methods
interleaved within a run so drift in the (noisy) disk hits them alike; the report is the median
over runs (``*_vs_raw`` divides medians; ``*_vs_raw_paired`` is the median of each run's ratio
to the raw run just before it, which drift affects less). ``raw_odirect`` is one
``os.pwrite``/``os.preadv`` call on a page-aligned, pre-faulted mmap buffer into a preallocated
file opened with O_DIRECT. An engine stores a pre-faulted CPU tensor through
``SSDOffloader.store`` and loads it back with ``load`` (slab preallocated and staging buffers
made by a warm-up round, then reused, as in training), once with ``verify="none"`` (row
``<engine>``) and once with ``verify="checksum"`` (row ``<engine>+checksum``: checksum taken at
store, checked at load). Row ``checksum`` times the checksum alone over the same bytes on
--device (its "verify GB/s"). The last lines give what verification adds to an engine's
write+read time: ``(t_write + t_read with checksum) / (without) - 1``, median of per-run ratios.
All files live in --dir.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import mmap
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tba import _env  # noqa: E402
from tba.offloaders.ssd import SSDOffloader  # noqa: E402
from tba.offloaders.ssd._checksum import digest_of  # noqa: E402
from _environment import command_line, cpu_name  # noqa: E402

_MiB = 1 << 20


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dir", default=(_env.ssd_dirs() or (tempfile.gettempdir(),))[0],
                        help="directory on the drive to measure (default: the first of TBA_SSD_DIR, "
                        "else the temp dir)")
    parser.add_argument("--size-mib", type=int, default=256, help="bytes per transfer, in MiB")
    parser.add_argument("--runs", type=int, default=7, help="timed runs per method (the median is reported)")
    parser.add_argument("--engines", default=None,
                        help="comma-separated engines to measure (default: posix, plus kvikio if importable)")
    parser.add_argument("--chunk-mib", type=int, default=8, help="posix engine chunk / staging buffer size")
    parser.add_argument("--io-threads", type=int, default=4, help="posix engine I/O threads")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the engines' tensors live (cuda: staged or GPUDirect transfers)")
    parser.add_argument("--out", default=None, help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    if args.size_mib < 1 or args.runs < 1:
        parser.error("--size-mib and --runs must be >= 1")
    return args


def _filesystem_of(path: str) -> dict[str, str]:
    """Device, type and options of the mount holding ``path`` (longest mount-point prefix)."""
    real = os.path.realpath(path)
    best = {"mount_point": "", "device": "?", "fstype": "?", "options": "?"}
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount_point, fstype, options = line.split()[:4]
                inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best["mount_point"]):
                    best = {"mount_point": mount_point, "device": device, "fstype": fstype, "options": options}
    except OSError:
        pass
    return best


def environment(args: argparse.Namespace, argv: list[str]) -> dict[str, object]:
    """What the numbers were measured on."""
    kvikio_version = None
    if importlib.util.find_spec("kvikio") is not None:
        try:
            import kvikio

            kvikio_version = kvikio.__version__
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            kvikio_version = f"import failed: {e}"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    stat = os.statvfs(args.dir)
    return {
        "device": f"{gpu or 'no GPU'}; CPU {cpu_name()} x{os.cpu_count()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "kvikio": kvikio_version,
        "kernel": platform.release(),
        "dir": os.path.realpath(args.dir),
        "filesystem": _filesystem_of(args.dir),
        "free_bytes": stat.f_bavail * stat.f_frsize,
        "tensor_device": args.device,
        # Other work on the machine slows the checksum (CPU) more than the disk: say how busy it was.
        "loadavg_1_5_15min": [round(x, 2) for x in os.getloadavg()],
        "torch_threads": torch.get_num_threads(),
        "command": command_line(argv),
    }


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _full(call: Callable[[int], int], total: int, what: str) -> None:
    done = 0
    while done < total:
        count = call(done)
        if count <= 0:
            raise OSError(f"short {what}: {done} of {total} bytes")
        done += count


class RawODirect:
    """One pwrite/preadv of an aligned, pre-faulted mmap buffer on a preallocated O_DIRECT file."""

    name = "raw_odirect"

    def __init__(self, directory: str, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        self.path = os.path.join(directory, f"tba-bw-raw-{os.getpid()}.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        os.posix_fallocate(self.fd, 0, num_bytes)
        self.buffer = mmap.mmap(-1, num_bytes)
        block = os.urandom(_MiB)
        for start in range(0, num_bytes, _MiB):  # pre-fault every page with non-zero data
            self.buffer[start : start + _MiB] = block[: min(_MiB, num_bytes - start)]
        self.view = memoryview(self.buffer)

    def write(self) -> None:
        _full(lambda done: os.pwrite(self.fd, self.view[done:], done), self.num_bytes, "write")

    def read(self) -> None:
        _full(lambda done: os.preadv(self.fd, [self.view[done:]], done), self.num_bytes, "read")

    def close(self) -> None:
        self.view.release()
        self.buffer.close()
        os.close(self.fd)
        os.unlink(self.path)


class ChecksumOnly:
    """The verification checksum alone over ``num_bytes`` on --device ("write" and "read" both
    time one checksum, so its row lines up with the others)."""

    name = "checksum"

    def __init__(self, num_bytes: int, args: argparse.Namespace) -> None:
        self.data = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8).to(args.device)
        digest_of(self.data)  # warm-up

    def write(self) -> None:
        digest_of(self.data)

    def read(self) -> None:
        digest_of(self.data)

    def close(self) -> None:
        pass


class Engine:
    """``SSDOffloader.store``/``load`` of a pre-faulted tensor, with or without verification."""

    def __init__(self, engine: str, directory: str, num_bytes: int, args: argparse.Namespace, verify: str) -> None:
        self.name = engine if verify == "none" else f"{engine}+{verify}"
        self.offloader = SSDOffloader(
            dirs=(directory,), engine=engine, slab_bytes=-(-num_bytes // 4096) * 4096,
            chunk_bytes=args.chunk_mib * _MiB, num_io_threads=args.io_threads,
            num_staging_buffers=2 * args.io_threads, verify=verify,  # type: ignore[arg-type]
        )
        self.src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8).to(args.device)
        self.dst = torch.zeros(num_bytes, dtype=torch.uint8, device=args.device)  # pre-faulted
        self.token = None
        try:
            self.write()  # warm-up: slab, staging buffers, threads
            self.read()
        except BaseException:
            self.offloader.close()
            raise

    def write(self) -> None:
        if self.token is not None:
            self.offloader.release(self.token)
        self.token = self.offloader.store(self.src)

    def read(self) -> None:
        self.offloader.load(self.token, self.dst)

    def close(self) -> None:
        try:
            if not torch.equal(self.src, self.dst):
                raise AssertionError(f"{self.name}: the bytes read back differ from the bytes written")
        finally:
            self.offloader.close()


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, object]:
    """Measure, print a table, write JSON; returns the report."""
    num_bytes = args.size_mib * _MiB
    if args.engines is None:
        engines = ["posix"] + (["kvikio"] if importlib.util.find_spec("kvikio") is not None else [])
    else:
        engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    env = environment(args, argv)
    print("# io_bandwidth environment")
    for key, value in env.items():
        print(f"#   {key}: {value}")
    methods: list[RawODirect | Engine | ChecksumOnly] = [RawODirect(args.dir, num_bytes), ChecksumOnly(num_bytes, args)]
    errors: dict[str, str] = {}
    for engine in engines:
        for verify in ("none", "checksum"):
            try:
                methods.append(Engine(engine, args.dir, num_bytes, args, verify))
            except Exception as e:  # noqa: BLE001 - an engine unusable here is reported, not fatal
                errors[engine] = f"{type(e).__name__}: {e}"
                print(f"# {engine}: skipped ({errors[engine]})")
                break
    samples = {m.name: {"write": [], "read": []} for m in methods}
    try:
        for _ in range(args.runs):
            for method in methods:
                samples[method.name]["write"].append(num_bytes / _timed(method.write))
                samples[method.name]["read"].append(num_bytes / _timed(method.read))
    finally:
        for method in methods:
            method.close()
    results: dict[str, dict[str, object]] = {}
    for name, by_op in samples.items():
        results[name] = {
            "write_bytes_per_s": statistics.median(by_op["write"]),
            "read_bytes_per_s": statistics.median(by_op["read"]),
            "write_samples": by_op["write"],
            "read_samples": by_op["read"],
        }
    base = results["raw_odirect"]
    for name, result in results.items():
        result["write_vs_raw"] = result["write_bytes_per_s"] / base["write_bytes_per_s"]
        result["read_vs_raw"] = result["read_bytes_per_s"] / base["read_bytes_per_s"]
        # Paired: the median of per-run ratios against the raw run right before (less drift).
        for op in ("write", "read"):
            ratios = [a / b for a, b in zip(samples[name][op], samples["raw_odirect"][op])]
            result[f"{op}_vs_raw_paired"] = statistics.median(ratios)
    results["checksum"]["verify_bytes_per_s"] = statistics.median(
        samples["checksum"]["write"] + samples["checksum"]["read"]
    )
    overheads: dict[str, float] = {}
    for name in list(samples):
        checked = f"{name}+checksum"
        if checked in samples:
            # Per run: (t_write + t_read) with verification over without, minus one.
            ratios = [
                (1 / cw + 1 / cr) / (1 / w + 1 / r) - 1
                for w, r, cw, cr in zip(
                    samples[name]["write"], samples[name]["read"], samples[checked]["write"], samples[checked]["read"]
                )
            ]
            overheads[name] = statistics.median(ratios)
            results[checked]["verify_overhead"] = overheads[name]
    for name, error in errors.items():
        results[name] = {"error": error}
    report = {"environment": env, "num_bytes": num_bytes, "runs": args.runs, "results": results}
    print(
        f"{'method':<16} {'write GB/s':>11} {'read GB/s':>10} {'verify GB/s':>12} {'write/raw':>10} "
        f"{'read/raw':>9} {'paired w':>9} {'paired r':>9}"
    )
    for name, result in results.items():
        if "error" in result:
            print(f"{name:<16} {'error':>11}")
            continue
        if name == "checksum":
            print(f"{name:<16} {'':>11} {'':>10} {result['verify_bytes_per_s'] / 1e9:>12.2f}")
            continue
        print(
            f"{name:<16} {result['write_bytes_per_s'] / 1e9:>11.2f} {result['read_bytes_per_s'] / 1e9:>10.2f} "
            f"{'':>12} {result['write_vs_raw']:>10.2f} {result['read_vs_raw']:>9.2f} "
            f"{result['write_vs_raw_paired']:>9.2f} {result['read_vs_raw_paired']:>9.2f}"
        )
    for name, overhead in overheads.items():
        print(f"# verify='checksum' adds {overhead * 100:+.1f}% to {name}'s write+read time (median of per-run ratios)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv) if argv is None else [sys.argv[0], *argv]
    run(_parse_args(argv[1:]), argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
