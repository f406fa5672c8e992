"""Offloaders: where activations go while they wait for backward."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tba.offloaders.base import Offloader
from tba.offloaders.host import HostOffloader
from tba.offloaders.throttled import Throttled
from tba.offloaders.tier_stats import TierStats
from tba.offloaders.tiered import TieredOffloader
from tba.offloaders.wrapper import OffloaderWrapper

if TYPE_CHECKING:
    from tba.config import TensorCacheConfig

__all__ = [
    "Offloader", "HostOffloader", "OffloaderWrapper", "Throttled", "TieredOffloader", "TierStats",
    "make_offloader",
]


def make_offloader(config: TensorCacheConfig, *, rank: int | None = None) -> Offloader | None:
    """The offloader ``config.offloader`` names (None for ``"none"``: keep everything)."""
    choice = config.offloader
    if choice == "none":
        return None
    if choice == "host":
        return HostOffloader()
    if choice in ("ssd", "host+ssd"):
        from tba.offloaders.ssd import SSDOffloader

        ssd = SSDOffloader(dirs=config.ssd_dirs, engine=config.ssd_engine, rank=rank, verify=config.verify)
        if choice == "ssd":
            return ssd
        assert config.host_budget_bytes is not None, "validated by TensorCacheConfig"
        return TieredOffloader(config.host_budget_bytes, spill=ssd)
    assert not isinstance(choice, str), f"unvalidated offloader {choice!r}"
    return choice
