"""Drives, host links and GPUs of :mod:`tba.plan` (private module; import from ``tba.plan``)."""

# Note [sustained vs burst drive writes]
# A consumer NVMe drive writes at its datasheet speed only until its SLC cache (a few
# percent of its capacity) fills; then it writes at its TLC/QLC speed, often a fifth of the
# datasheet figure. Activation offloading writes tens of GB every step, without pause, so the
# sustained figure is the one that decides whether transfers hide: the planner uses it unless
# told otherwise (``drive_write="burst"``). Enterprise drives and Optane state steady-state
# figures; for them the two are equal.

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Literal

from tba.plan._types import problems_error

__all__ = ["Drive", "HostLink", "DRIVES", "HOST_LINKS", "GPU_PEAK_FLOPS", "measure_host_link"]

DriveWrite = Literal["sustained", "burst"]


@dataclass(frozen=True, kw_only=True)
class Drive:
    """An SSD's endurance rating and write speed.

    Give ``pbw`` (petabytes written) or ``dwpd`` (drive writes per day over the warranty).
    ``burst_write_bytes_per_s`` is the datasheet sequential write speed (into the SLC cache on
    consumer drives); ``sustained_write_bytes_per_s`` what the drive keeps up once that cache
    is full (see Note [sustained vs burst drive writes]); default: the burst figure.
    """

    name: str
    capacity_bytes: int
    warranty_years: float
    pbw: float | None = None
    dwpd: float | None = None
    burst_write_bytes_per_s: float | None = None
    sustained_write_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        problems = []
        if (self.pbw is None) == (self.dwpd is None):
            problems.append("give exactly one of pbw and dwpd")
        if self.capacity_bytes <= 0 or self.warranty_years <= 0:
            problems.append("capacity_bytes and warranty_years must be positive")
        for name in ("burst_write_bytes_per_s", "sustained_write_bytes_per_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                problems.append(f"{name} must be positive, got {value!r}")
        if (self.sustained_write_bytes_per_s and self.burst_write_bytes_per_s
                and self.sustained_write_bytes_per_s > self.burst_write_bytes_per_s):
            problems.append("sustained_write_bytes_per_s exceeds burst_write_bytes_per_s")
        if problems:
            raise problems_error(f"Drive {self.name!r}", problems)
        if self.sustained_write_bytes_per_s is None and self.burst_write_bytes_per_s is not None:
            object.__setattr__(self, "sustained_write_bytes_per_s", self.burst_write_bytes_per_s)

    @property
    def endurance_bytes(self) -> float:
        """Rated bytes written over the drive's life."""
        if self.pbw is not None:
            return self.pbw * 1e15
        assert self.dwpd is not None  # exactly one of the two (checked when made)
        return self.dwpd * self.capacity_bytes * 365 * self.warranty_years

    def write_bytes_per_s(self, which: DriveWrite = "sustained") -> float | None:
        """The sustained or burst write speed (None: not known)."""
        if which not in ("sustained", "burst"):
            raise ValueError(f"drive write speed must be 'sustained' or 'burst', got {which!r}")
        return self.sustained_write_bytes_per_s if which == "sustained" else self.burst_write_bytes_per_s


@dataclass(frozen=True, kw_only=True)
class HostLink:
    """The GPU's link to host memory, which ``offloader="host"`` writes through.

    ``bytes_per_s`` is the device-to-host copy rate into pinned memory, one direction, one GPU.
    """

    name: str
    bytes_per_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.bytes_per_s, (int, float)) or not self.bytes_per_s > 0:
            raise problems_error(f"HostLink {self.name!r}", [f"bytes_per_s must be positive, got {self.bytes_per_s!r}"])


# Datasheet endurance and burst write speed; sustained from steady-state specs (enterprise,
# Optane) or post-SLC-cache measurements (consumer). Check your own drive's.
DRIVES: dict[str, Drive] = {
    "optane-p5800x-1.6tb": Drive(name="Intel Optane P5800X 1.6 TB", capacity_bytes=1_600_000_000_000, dwpd=100,
                                 warranty_years=5, burst_write_bytes_per_s=6.2e9, sustained_write_bytes_per_s=6.2e9),
    "samsung-990pro-2tb": Drive(name="Samsung 990 PRO 2 TB", capacity_bytes=2_000_000_000_000, pbw=1.2,
                                warranty_years=5, burst_write_bytes_per_s=6.9e9, sustained_write_bytes_per_s=1.5e9),
    "enterprise-3dwpd-3.2tb": Drive(name="generic PCIe 4 enterprise TLC 3.2 TB, 3 DWPD",
                                    capacity_bytes=3_200_000_000_000, dwpd=3, warranty_years=5,
                                    burst_write_bytes_per_s=4.0e9, sustained_write_bytes_per_s=4.0e9),
    "enterprise-1dwpd-7.68tb": Drive(name="generic PCIe 4 enterprise TLC 7.68 TB, 1 DWPD",
                                     capacity_bytes=7_680_000_000_000, dwpd=1, warranty_years=5,
                                     burst_write_bytes_per_s=4.0e9, sustained_write_bytes_per_s=4.0e9),
}

# x16 links, device-to-host into pinned memory: about 80 % of the raw rate (encoding and
# protocol overhead); measure yours with ``tba plan --measure-host-link`` on the GPU machine.
HOST_LINKS: dict[str, HostLink] = {
    "pcie3": HostLink(name="PCIe 3.0 x16", bytes_per_s=12.5e9),
    "pcie4": HostLink(name="PCIe 4.0 x16", bytes_per_s=25e9),
    "pcie5": HostLink(name="PCIe 5.0 x16", bytes_per_s=50e9),
}

# Dense fp16/bf16 tensor-core peak per GPU, FLOP/s.
GPU_PEAK_FLOPS: dict[str, float] = {"a100": 312e12, "h100": 989e12, "h200": 989e12, "b200": 2250e12}


def measure_host_link(num_bytes: int = 256 * 2**20, repeats: int = 5) -> HostLink:
    """Measure device-to-host copies into pinned memory on the current CUDA device.

    Median of ``repeats`` copies of ``num_bytes`` (after one warm-up copy).

    Raises:
        RuntimeError: no CUDA device; give a PCIe generation or a rate instead.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("measuring the host link needs a CUDA device; give the PCIe generation "
                           "(--pcie-gen / HOST_LINKS) or the rate (--host-link-gbps) instead")
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    name = torch.cuda.get_device_name()
    return HostLink(name=f"measured on {name} ({num_bytes >> 20} MiB D2H copies)",
                    bytes_per_s=num_bytes / statistics.median(times))
