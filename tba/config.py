"""`TensorCacheConfig`: every knob of the tensor cache, validated at once."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from torch import nn

if TYPE_CHECKING:
    from tba.offloaders.base import Offloader

__all__ = ["TensorCacheConfig"]

_OFFLOADER_NAMES = ("host", "ssd", "host+ssd", "none")
_SSD_ENGINES = ("auto", "kvikio", "posix")
_VERIFY_MODES = ("checksum", "none")
_IO_ERROR_MODES = ("raise", "keep")
_PIPELINES = ("auto", "torch", "megatron", "deepspeed")
_KNOWN_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "meta", "privateuseone")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorCacheConfig:
    """Options of :func:`tba.configure_tensor_cache` (pass them as keyword arguments).

    Attributes:
        offloader: where offloaded activations go: ``"host"`` (pinned host pool on CUDA,
            pageable memory on CPU), ``"ssd"``, ``"host+ssd"`` (host memory up to
            ``host_budget_bytes``, the rest to SSD), ``"none"`` (keep everything in memory and only
            account: the "keep" baseline), or an object implementing
            :class:`tba.offloaders.Offloader`.
        offload_devices: device types whose saved tensors the cache manages and offloads.
            ``("cpu",)`` makes CPU training offload real tensors (used by the CPU tests).
        min_offload_bytes: storages smaller than this stay in memory (they cost more in
            bookkeeping than they save).
        keep_last_modules: the last N blocks of forward (and everything after them) stay in
            memory: backward needs them first.
        prefetch_modules: when backward enters a module, the tensors of this many modules
            before it (in forward order) start loading.
        max_inflight_bytes: bound on the bytes of stores queued or running; a pack that would
            exceed it waits (backpressure), so a slow disk cannot pin unbounded memory.
        transfer_timeout_s: the longest tba waits for its offloader to make progress (forward
            waiting for room under ``max_inflight_bytes``, backward waiting for a load, close
            waiting for a running transfer) before raising :class:`tba.TBAError` naming what it
            waited for: a stuck disk or offloader fails the step instead of hanging it.
        num_store_threads: worker threads that run stores (FIFO).
        num_load_threads: worker threads that run loads (FIFO; loads go before stores).
        skip_modules: module types, or ``fnmatch`` patterns of qualified module names
            (``"lm_head"``, ``"*.attn"``), whose saved tensors are never offloaded.
        block_modules: the repeated blocks that are the unit of keep/prefetch decisions:
            modules, their qualified names, or module types. ``None`` finds them: the
            children of the model's largest ``nn.ModuleList``.
        adaptive: decide from a profiled step which leading blocks to offload so transfers
            hide behind compute (docs/policy.md). ``False`` offloads every block but the
            kept tail.
        profile_step: which completed step (1-based, after warm-up) is profiled when
            ``adaptive`` is on or a budget is set.
        max_step_overhead: closed loop for ``adaptive``: after the rule has decided, steps
            offloading its blocks are timed against steps keeping every block, and tba
            offloads only as many leading blocks as keep the step within this fraction of
            keep (0.05: 5% slower at most) and are worth it (docs/policy.md), settling within
            60 measured steps; the settled boundary is watched against new keep steps and
            checked again when it runs over. The keep steps hold every activation in memory
            for one step each. ``None``: the rule alone, no measured steps.
        activation_budget_bytes: budget mode: the most device memory the cache may hold for
            saved activations at the step's peak (``stats().peak_resident_bytes``). The
            profiled step measures the peak with every block offloaded, then tba offloads the
            fewest leading blocks (the cheapest: their transfers are best hidden) whose
            estimated peak fits, and offloads more if a step still peaks above it; it warns,
            with numbers, when offloading every block but the kept tail does not fit. It
            replaces ``adaptive``'s rule. ``None``: no budget.
        on_io_error: ``"raise"`` raises :class:`tba.OffloadIOError` in the training step;
            ``"keep"`` keeps the tensor in memory, warns once and carries on.
        host_budget_bytes: with ``offloader="host+ssd"`` (and only then; required there): most
            bytes of activations held in host memory at once; what does not fit goes to SSD
            (``tba.offloaders.TieredOffloader``).
        ssd_dirs: directories for ``offloader="ssd"`` or ``"host+ssd"`` (tensors are striped
            across them), as ``str`` or path-like; ``None`` uses ``TBA_SSD_DIR`` or the system temp dir.
        ssd_engine: ``"auto"``, ``"kvikio"`` (GPUDirect Storage or its compat mode) or
            ``"posix"``.
        verify: ``"checksum"``: every reload from SSD is checked against a checksum taken when
            it was stored, and a mismatch raises :class:`tba.OffloadIOError` in the training
            step (in both ``on_io_error`` modes); ``"none"``: not checked (see docs/ssd.md).
            The host offloader's bytes never leave process memory; it does not checksum.
        pipeline: which pipeline engine feeds stage hints: ``"auto"`` (whichever patched
            engine is importable), ``"torch"``, ``"megatron"``, ``"deepspeed"``, or ``None``.

    Example:
        >>> cfg = TensorCacheConfig(offloader="host", min_offload_bytes=0)
        >>> cfg.keep_last_modules
        1
    """

    offloader: Literal["host", "ssd", "host+ssd", "none"] | Offloader = "host"
    offload_devices: tuple[str, ...] = ("cuda",)
    min_offload_bytes: int = 1 << 20
    keep_last_modules: int = 1
    prefetch_modules: int = 2
    max_inflight_bytes: int = 1 << 30
    transfer_timeout_s: float = 300.0
    num_store_threads: int = 1
    num_load_threads: int = 1
    skip_modules: tuple[type[nn.Module] | str, ...] = ()
    block_modules: tuple[nn.Module | str | type[nn.Module], ...] | None = None
    adaptive: bool = True
    profile_step: int = 2
    max_step_overhead: float | None = 0.05
    activation_budget_bytes: int | None = None
    on_io_error: Literal["raise", "keep"] = "raise"
    host_budget_bytes: int | None = None
    ssd_dirs: tuple[str, ...] | None = None
    ssd_engine: Literal["auto", "kvikio", "posix"] = "auto"
    verify: Literal["checksum", "none"] = "checksum"
    pipeline: Literal["auto", "torch", "megatron", "deepspeed"] | None = None

    def __post_init__(self) -> None:
        # Accept one string or a list for the tuple fields, but store tuples so the config
        # stays hashable. A lone string is one item ("cpu" -> ("cpu",)), never its characters.
        for name in ("offload_devices", "skip_modules", "block_modules", "ssd_dirs"):
            value = getattr(self, name)
            if isinstance(value, (str, os.PathLike)):
                value = (value,)
            elif isinstance(value, Sequence) and not isinstance(value, tuple):
                value = tuple(value)
            if name == "ssd_dirs" and isinstance(value, tuple):
                value = tuple(os.fspath(d) if isinstance(d, os.PathLike) else d for d in value)
            object.__setattr__(self, name, value)
        problems = list(self._problems())
        if problems:
            raise ValueError(
                "invalid tba.TensorCacheConfig:\n" + "\n".join(f"  - {p}" for p in problems)
            )

    def _problems(self) -> list[str]:
        from tba.offloaders.base import Offloader

        out: list[str] = []
        if isinstance(self.offloader, str):
            if self.offloader not in _OFFLOADER_NAMES:
                out.append(
                    f"offloader={self.offloader!r}: expected one of {_OFFLOADER_NAMES} "
                    "or an object implementing tba.offloaders.Offloader"
                )
        elif not isinstance(self.offloader, Offloader):
            out.append(
                f"offloader={self.offloader!r}: expected one of {_OFFLOADER_NAMES} or an object "
                "with name/store/load/release/reserve/close (tba.offloaders.Offloader)"
            )
        devices = self.offload_devices
        if not isinstance(devices, tuple) or not devices or not all(
            isinstance(d, str) and d in _KNOWN_DEVICE_TYPES for d in devices
        ):
            out.append(
                f"offload_devices={devices!r}: expected a non-empty tuple of device types "
                f"from {_KNOWN_DEVICE_TYPES}, e.g. ('cuda',) or ('cpu',)"
            )
        for name, minimum in (
            ("min_offload_bytes", 0),
            ("keep_last_modules", 0),
            ("prefetch_modules", 0),
            ("max_inflight_bytes", 1),
            ("num_store_threads", 1),
            ("num_load_threads", 1),
            ("profile_step", 1),
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < minimum:
                out.append(f"{name}={value!r}: expected an integer >= {minimum}")
        timeout = self.transfer_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            out.append(
                f"transfer_timeout_s={timeout!r}: expected a number of seconds > 0 (how long a "
                "wait for the offloader may go without progress)"
            )
        overhead = self.max_step_overhead
        if overhead is not None and (
            isinstance(overhead, bool) or not isinstance(overhead, (int, float))
            or not 0 <= overhead < 10 or overhead != overhead
        ):
            out.append(
                f"max_step_overhead={overhead!r}: expected None or a fraction >= 0 and < 10 "
                "(0.05: offloading may make the step at most 5% slower than keeping everything)"
            )
        budget = self.activation_budget_bytes
        if budget is not None and (not _is_int(budget) or budget < 1):
            out.append(
                f"activation_budget_bytes={budget!r}: expected None or an integer number of "
                "bytes >= 1"
            )
        elif budget is not None and self.offloader == "none":
            out.append(
                f"activation_budget_bytes={budget!r} with offloader='none': a budget needs an "
                "offloader to send activations to (offloader='host' or 'ssd')"
            )
        for name in ("skip_modules", "block_modules"):
            value = getattr(self, name)
            if value is None and name == "block_modules":
                continue
            if not isinstance(value, tuple) or not all(_is_module_spec(v) for v in value):
                out.append(
                    f"{name}={value!r}: expected a tuple of module types, qualified-name "
                    "patterns (str)" + (" or module instances" if name == "block_modules" else "")
                )
        if not isinstance(self.adaptive, bool):
            out.append(f"adaptive={self.adaptive!r}: expected True or False")
        if self.on_io_error not in _IO_ERROR_MODES:
            out.append(f"on_io_error={self.on_io_error!r}: expected one of {_IO_ERROR_MODES}")
        budget = self.host_budget_bytes
        if budget is not None and (not _is_int(budget) or budget <= 0):
            out.append(f"host_budget_bytes={budget!r}: expected None or a positive integer (bytes)")
        if self.offloader == "host+ssd" and budget is None:
            out.append(
                "offloader='host+ssd' needs host_budget_bytes: the most bytes held in host memory "
                "before tensors spill to SSD (e.g. host_budget_bytes=16 << 30)"
            )
        elif budget is not None and self.offloader != "host+ssd":
            out.append(
                f"host_budget_bytes={budget!r} is used only by offloader='host+ssd', but offloader="
                f"{getattr(self.offloader, 'name', self.offloader)!r}: use 'host+ssd' or drop host_budget_bytes"
            )
        if self.ssd_dirs is not None and (
            not isinstance(self.ssd_dirs, tuple)
            or not self.ssd_dirs
            or not all(isinstance(d, str) and d for d in self.ssd_dirs)
        ):
            out.append(
                f"ssd_dirs={self.ssd_dirs!r}: expected None or a non-empty tuple of directory paths "
                "(str or path-like)"
            )
        if self.ssd_engine not in _SSD_ENGINES:
            out.append(f"ssd_engine={self.ssd_engine!r}: expected one of {_SSD_ENGINES}")
        if self.verify not in _VERIFY_MODES:
            out.append(f"verify={self.verify!r}: expected one of {_VERIFY_MODES}")
        if self.pipeline is not None and self.pipeline not in _PIPELINES:
            out.append(f"pipeline={self.pipeline!r}: expected None or one of {_PIPELINES}")
        return out

    def replace(self, **changes: Any) -> TensorCacheConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_module_spec(value: object) -> bool:
    return isinstance(value, (str, nn.Module)) or (
        isinstance(value, type) and issubclass(value, nn.Module)
    )
