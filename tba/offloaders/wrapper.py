"""`OffloaderWrapper`: the base of every offloader that wraps another one (``Throttled`` here;
the chaos, corruption and parity-audit offloaders of :mod:`tba.testing`)."""

from __future__ import annotations

from typing import Any, ClassVar, cast

import torch

from tba.offloaders.base import Offloader, StoresNow

__all__ = ["OffloaderWrapper"]


class OffloaderWrapper:
    """An :class:`tba.offloaders.Offloader` that passes every call to ``inner``.

    Subclasses override the calls they change. The optional parts of the protocol pass through
    too: ``store_now`` exists on the wrapper only when ``inner`` has it (the cache looks for it
    once, when it is built) and the subclass lets it (``passes_store_now``), and ``used_bytes``
    and ``take_tier_stats`` answer for ``inner``.

    Args:
        inner: the offloader wrapped.
        label: the wrapper's kind; its ``name`` is ``"label(inner's name)"``.

    Raises:
        ValueError: ``inner`` is not an :class:`tba.offloaders.Offloader`.

    Example:
        >>> from tba.offloaders import OffloaderWrapper
        >>> from tba.testing import FakeOffloader
        >>> class Counting(OffloaderWrapper):
        ...     def __init__(self, inner):
        ...         super().__init__(inner, "counting")
        ...         self.num_loads = 0
        ...     def load(self, token, dst):
        ...         self.num_loads += 1
        ...         super().load(token, dst)
        >>> Counting(FakeOffloader()).name
        'counting(fake)'
    """

    #: Whether ``inner``'s ``store_now`` (an inline store on the training thread) is passed
    #: through. A subclass whose ``store`` does more than ``inner``'s (waits, counts) sets it
    #: False unless it overrides ``_store_now`` to do the same.
    passes_store_now: ClassVar[bool] = True

    def __init__(self, inner: Offloader, label: str) -> None:
        if not isinstance(inner, Offloader):
            raise ValueError(
                f"tba: {type(self).__name__}: expected an offloader to wrap (an object with "
                f"name/store/load/release/reserve/close, tba.offloaders.Offloader), got {inner!r}"
            )
        self.inner = inner
        self.name = f"{label}({inner.name})"
        if self.passes_store_now and getattr(inner, "store_now", None) is not None:
            self.store_now = self._store_now

    def store(self, src: torch.Tensor) -> Any:
        return self.inner.store(src)

    def _store_now(self, storage: torch.UntypedStorage) -> Any:
        return cast(StoresNow, self.inner).store_now(storage)  # set only when inner has one

    def load(self, token: Any, dst: torch.Tensor) -> None:
        self.inner.load(token, dst)

    def release(self, token: Any) -> None:
        self.inner.release(token)

    def reserve(self, num_bytes: int) -> None:
        self.inner.reserve(num_bytes)

    def close(self) -> None:
        self.inner.close()

    @property
    def used_bytes(self) -> int | None:
        """Bytes ``inner`` holds, if it says (the cache checks it is 0 after a step)."""
        return getattr(self.inner, "used_bytes", None)

    def take_tier_stats(self) -> dict[str, Any]:
        """``inner``'s tier counters since the last call (empty without tiers)."""
        take = getattr(self.inner, "take_tier_stats", None)
        return take() if take is not None else {}
