"""Offloaders: where activations go while they wait for backward."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tba.offloaders.base import Offloader
from tba.offloaders.host import HostOffloader
from tba.offloaders.throttled import Throttled

if TYPE_CHECKING:
    from tba.config import TensorCacheConfig

__all__ = ["Offloader", "HostOffloader", "Throttled", "make_offloader"]


def make_offloader(config: TensorCacheConfig, *, rank: int | None = None) -> Offloader | None:
    """The offloader ``config.offloader`` names (None for ``"none"``: keep everything)."""
    choice = config.offloader
    if choice == "none":
        return None
    if choice == "host":
        return HostOffloader()
    if choice == "ssd":
        from tba.offloaders.ssd import SSDOffloader

        return SSDOffloader(dirs=config.ssd_dirs, engine=config.ssd_engine, rank=rank, verify=config.verify)
    assert not isinstance(choice, str), f"unvalidated offloader {choice!r}"
    return choice
