"""`TieredOffloader`: a host pool bounded by a budget, with the rest spilled to SSD
(``offloader="host+ssd"``)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import torch

from tba.offloaders.base import Offloader
from tba.offloaders.host import HostOffloader
from tba.offloaders.tier_stats import TierStats

__all__ = ["TieredOffloader"]

logger = logging.getLogger(__name__)

_HOST, _SPILL = 0, 1


class _Token:
    """Where one stored tensor went: the tier, that tier's own token, and its size."""

    __slots__ = ("tier", "inner", "num_bytes", "released")

    def __init__(self, tier: int, inner: Any, num_bytes: int) -> None:  # inner: the tier's token
        self.tier = tier
        self.inner = inner
        self.num_bytes = num_bytes
        self.released = False


class _Tier:
    """One tier's counters: held bytes now, totals over the offloader's life, and the interval
    since the last ``take_tier_stats`` (all under the offloader's lock)."""

    __slots__ = ("held_bytes", "total", "interval")

    def __init__(self, budget_bytes: int | None) -> None:
        self.held_bytes = 0
        self.total = TierStats(budget_bytes=budget_bytes)
        self.interval = TierStats(budget_bytes=budget_bytes)

    def stored(self, num_bytes: int) -> None:
        for stats in (self.total, self.interval):
            stats.num_stored += 1
            stats.stored_bytes += num_bytes
            stats.peak_held_bytes = max(stats.peak_held_bytes, self.held_bytes)

    def turned_away(self, over_budget: bool) -> None:
        for stats in (self.total, self.interval):
            if over_budget:
                stats.num_over_budget += 1
            else:
                stats.num_no_room += 1

    def snapshot(self, stats: TierStats) -> TierStats:
        return dataclasses.replace(stats, held_bytes=self.held_bytes)


class TieredOffloader:
    """Keeps up to ``host_budget_bytes`` of activations in a host pool (pinned on CUDA) and
    sends the rest to a second tier, an :class:`~tba.offloaders.ssd.SSDOffloader` by default.

    Note [Host budget placement]: each tensor is placed when it is stored. It goes to the host
    pool if the bytes the host tier holds now (stored and not yet released, plus stores into it
    still copying) and its own bytes together stay within ``host_budget_bytes``; else it goes
    to the spill tier. Released host tensors give their bytes back at once, so a later tensor
    takes their place in host memory before anything spills. The host pool itself is capped at
    the budget (rounded up to 512 bytes, ``HostOffloader(max_pool_bytes=...)``): a tensor
    within the budget that finds no contiguous room in the pool (fragmentation, rounding of
    small tensors) spills too, and is counted apart. A token remembers its tier; ``load`` and
    ``release`` go to that tier. Placement is decided under one lock that is never held while
    bytes move, so several store and load workers may call in at once.

    Per-tier counters (tensors and bytes stored, held now, peak held, tensors turned away by
    the host tier and why) come from :meth:`tier_stats` (over the offloader's life) and
    :meth:`take_tier_stats` (since the last call: the cache calls it once per step and shows it
    in ``stats().tiers`` and ``summary()``).

    Args:
        host_budget_bytes: most bytes of activations held in host memory at once.
        spill: where the rest goes; the tiered offloader owns it (closes it). Default:
            ``SSDOffloader()`` (``TBA_SSD_DIR`` or the system temp dir).

    Raises:
        ValueError: ``host_budget_bytes`` is not a positive integer, or ``spill`` is not an
            offloader (or is named ``"host"``).

    Example:
        >>> from tba.offloaders.ssd import SSDOffloader
        >>> off = TieredOffloader(4 << 30, spill=SSDOffloader(dirs="/mnt/nvme0"))  # doctest: +SKIP
        >>> cache = tba.configure_tensor_cache(model, offloader=off)  # doctest: +SKIP
        >>> # the same from options: offloader="host+ssd", host_budget_bytes=4 << 30, ssd_dirs=...
    """

    def __init__(self, host_budget_bytes: int, spill: Offloader | None = None) -> None:
        problems = []
        if not isinstance(host_budget_bytes, int) or isinstance(host_budget_bytes, bool) or host_budget_bytes <= 0:
            problems.append(f"host_budget_bytes={host_budget_bytes!r}: expected a positive number of bytes")
        if spill is not None and not isinstance(spill, Offloader):
            problems.append(f"spill={spill!r}: expected an offloader (name/store/load/release/reserve/close)")
        elif spill is not None and spill.name == "host":
            problems.append("spill is a host offloader: the spill tier must be another kind (e.g. SSDOffloader)")
        if problems:
            raise ValueError("invalid tba.offloaders.TieredOffloader:\n" + "\n".join(f"  - {p}" for p in problems))
        if spill is None:
            from tba.offloaders.ssd import SSDOffloader

            spill = SSDOffloader()
        self.host_budget_bytes = host_budget_bytes
        self.host = HostOffloader(max_pool_bytes=host_budget_bytes)
        self.spill: Offloader = spill
        self.name = f"host+{spill.name}"
        self._lock = threading.Lock()
        self._tiers = (_Tier(host_budget_bytes), _Tier(None))
        self._spill_logged = False
        self._closed = False

    @property
    def tier_names(self) -> tuple[str, str]:
        return "host", self.spill.name

    @property
    def used_bytes(self) -> int:
        """Bytes of pool and file space held by stored, unreleased tensors (both tiers)."""
        spill_used = getattr(self.spill, "used_bytes", 0)
        return self.host.used_bytes + (spill_used if isinstance(spill_used, int) else 0)

    def tier_stats(self) -> dict[str, TierStats]:
        """Counters of each tier over the offloader's life (``held_bytes``: now)."""
        with self._lock:
            return {name: tier.snapshot(tier.total) for name, tier in zip(self.tier_names, self._tiers)}

    def take_tier_stats(self) -> dict[str, TierStats]:
        """Counters of each tier since the previous call, and start a new interval."""
        with self._lock:
            out = {}
            for name, tier in zip(self.tier_names, self._tiers):
                out[name] = tier.snapshot(tier.interval)
                tier.interval = TierStats(
                    held_bytes=tier.held_bytes, peak_held_bytes=tier.held_bytes, budget_bytes=tier.total.budget_bytes
                )
            return out

    # --- the Offloader protocol ------------------------------------------------------------
    def store(self, src: torch.Tensor) -> _Token:
        """Copy ``src`` to the host pool if it fits the budget, else to the spill tier.

        Raises:
            tba.OffloadIOError: the spill tier's write failed.
        """
        num_bytes = src.numel()
        host = self._tiers[_HOST]
        with self._lock:
            self._check_open()
            fits = host.held_bytes + num_bytes <= self.host_budget_bytes
            if fits:
                host.held_bytes += num_bytes  # claimed now: concurrent stores see it
            else:
                host.turned_away(over_budget=True)
        if fits:
            try:
                inner = self.host.try_store(src)
            except BaseException:
                with self._lock:
                    host.held_bytes -= num_bytes
                raise
            with self._lock:
                if inner is not None:
                    host.stored(num_bytes)
                    return _Token(_HOST, inner, num_bytes)
                host.held_bytes -= num_bytes
                host.turned_away(over_budget=False)
        return self._spill(src, num_bytes)

    def _spill(self, src: torch.Tensor, num_bytes: int) -> _Token:
        with self._lock:
            first, self._spill_logged = not self._spill_logged, True
        if first:
            logger.info(
                "tba %s: the host tier is full (budget %d bytes); spilling the rest to %s",
                self.name, self.host_budget_bytes, self.spill.name,
            )
        inner = self.spill.store(src)
        tier = self._tiers[_SPILL]
        with self._lock:
            tier.held_bytes += num_bytes
            tier.stored(num_bytes)
        return _Token(_SPILL, inner, num_bytes)

    def load(self, token: _Token, dst: torch.Tensor) -> None:
        """Fill ``dst`` from the tier that holds ``token``."""
        if not isinstance(token, _Token):
            raise ValueError(f"load() expects a token returned by TieredOffloader.store, got {type(token).__name__}")
        if token.released:
            raise ValueError("load() of a released token: its space may hold another tensor now")
        self._offloader(token.tier).load(token.inner, dst)

    def release(self, token: _Token) -> None:
        """Give the token's space back to its tier. Idempotent; a no-op after close."""
        with self._lock:
            if token.released:
                return
            token.released = True
            self._tiers[token.tier].held_bytes -= token.num_bytes
            if self._closed:
                return
        self._offloader(token.tier).release(token.inner)

    def reserve(self, num_bytes: int) -> None:
        """Size the host pool for up to the budget and the spill tier for the rest (``0``: both
        give back what they hold for idle transfers)."""
        if num_bytes <= 0:
            self.host.reserve(0)
            self.spill.reserve(0)
            return
        self.host.reserve(min(num_bytes, self.host_budget_bytes))
        if num_bytes > self.host_budget_bytes:
            self.spill.reserve(num_bytes - self.host_budget_bytes)

    def close(self) -> None:
        """Close both tiers (host memory given back, spill files deleted). Idempotent."""
        with self._lock:
            self._closed = True
        try:
            self.host.close()
        finally:
            self.spill.close()

    def __repr__(self) -> str:
        return f"TieredOffloader(host_budget_bytes={self.host_budget_bytes}, spill={self.spill!r})"

    # --- internals -------------------------------------------------------------------------
    def _offloader(self, tier: int) -> Offloader:
        return self.host if tier == _HOST else self.spill

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} offloader is closed; build a new one to offload again")
