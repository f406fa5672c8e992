"""Deliberately broken offloaders: what :func:`tba.testing.check_parity` must catch, and what an
extender's own check can be tried against."""

from __future__ import annotations

import itertools
import threading
from typing import Any, Literal

import torch

from tba.offloaders.base import Offloader
from tba.testing._fakes import FakeOffloader
from tba.offloaders.wrapper import OffloaderWrapper

__all__ = ["CorruptingOffloader", "ForgetfulOffloader"]

_FORGETFUL_MODES = ("zeros", "untouched", "alias")


class CorruptingOffloader(OffloaderWrapper):
    """Wraps an offloader and flips one bit of one byte on one load (a torn read, a race on a
    reload buffer): every other byte is right.

    By default the lowest bit of the odd byte at or after the middle of the load: a bool flips
    (True and False are the bytes 1 and 0), a float32 changes by 256 units in its last place, a
    16-bit float in its exponent or high mantissa, an integer by 256. A corrupted value that no
    result depends on (a masked position, say) cannot be seen by any comparison of results.

    Args:
        inner: the offloader that really moves the bytes (default: a :class:`FakeOffloader`).
        nth_load: corrupt the load with this index (0-based), counting only loads of at least
            ``min_bytes``.
        min_bytes: smaller loads are left alone and not counted (small storages are often
            integer indices, whose corruption raises instead of changing a gradient).
        byte_index: which byte of that load (default: the odd byte at or after the middle).
        xor_mask: the bits flipped in it.

    Attributes:
        corrupted: ``(load index, byte index)`` once the corruption happened, else None.

    Example:
        >>> from tba.testing import CorruptingOffloader, check_parity
        >>> report = check_parity(model, batches, offloader=CorruptingOffloader(), force=True)  # doctest: +SKIP
        >>> report.ok  # doctest: +SKIP
        False
    """

    def __init__(
        self,
        inner: Offloader | None = None,
        *,
        nth_load: int = 0,
        min_bytes: int = 4096,
        byte_index: int | None = None,
        xor_mask: int = 0x01,
    ) -> None:
        problems = [
            f"{name}={value!r}: expected an integer >= 0"
            for name, value in (("nth_load", nth_load), ("min_bytes", min_bytes))
            if isinstance(value, bool) or not isinstance(value, int) or value < 0
        ]
        if byte_index is not None and (isinstance(byte_index, bool) or not isinstance(byte_index, int) or byte_index < 0):
            problems.append(f"byte_index={byte_index!r}: expected None or an integer >= 0")
        if isinstance(xor_mask, bool) or not isinstance(xor_mask, int) or not 1 <= xor_mask <= 0xFF:
            problems.append(f"xor_mask={xor_mask!r}: expected an integer from 1 to 255 (the bits to flip)")
        if problems:
            raise ValueError("invalid tba.testing.CorruptingOffloader:\n" + "\n".join(f"  - {p}" for p in problems))
        super().__init__(inner if inner is not None else FakeOffloader(), "corrupting")
        self.nth_load = nth_load
        self.min_bytes = min_bytes
        self.byte_index = byte_index
        self.xor_mask = xor_mask
        self.corrupted: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._num_counted = 0

    def load(self, token: Any, dst: torch.Tensor) -> None:
        self.inner.load(token, dst)
        num_bytes = dst.numel()
        if num_bytes < max(self.min_bytes, 1):
            return
        with self._lock:
            index = self._num_counted
            self._num_counted += 1
        if index != self.nth_load:
            return
        byte = min(self.byte_index if self.byte_index is not None else num_bytes // 2 | 1, num_bytes - 1)
        dst[byte : byte + 1].bitwise_xor_(self.xor_mask)
        self.corrupted = (index, byte)


class ForgetfulOffloader:
    """An offloader that hands out tokens and stores nothing (the "offload path that silently
    did nothing" of several shipped systems).

    Args:
        mode: what ``load`` does: ``"zeros"`` fills the destination with zeros;
            ``"untouched"`` leaves it as it is (whatever the fresh buffer held);
            ``"alias"``: ``store`` keeps a reference to the source instead of copying it, and
            ``load`` copies from that reference (results are exact, nothing left memory).

    Example:
        >>> from tba.testing import ForgetfulOffloader, check_parity
        >>> check_parity(model, batches, offloader=ForgetfulOffloader("alias"), force=True).ok  # doctest: +SKIP
        False
    """

    def __init__(self, mode: Literal["zeros", "untouched", "alias"] = "zeros") -> None:
        if mode not in _FORGETFUL_MODES:
            raise ValueError(f"invalid tba.testing.ForgetfulOffloader:\n  - mode={mode!r}: expected one of {_FORGETFUL_MODES}")
        self.mode = mode
        self.name = f"forgetful-{mode}"
        self._ids = itertools.count()
        self._kept: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.num_stores = 0
        self.num_loads = 0

    def store(self, src: torch.Tensor) -> int:
        with self._lock:
            token = next(self._ids)
            self.num_stores += 1
            if self.mode == "alias":
                self._kept[token] = src
        return token

    def load(self, token: int, dst: torch.Tensor) -> None:
        with self._lock:
            self.num_loads += 1
            kept = self._kept.get(token)
        if self.mode == "zeros":
            dst.zero_()
        elif kept is not None:
            dst.copy_(kept)

    def release(self, token: int) -> None:
        with self._lock:
            self._kept.pop(token, None)

    def reserve(self, num_bytes: int) -> None:
        pass

    def close(self) -> None:
        with self._lock:
            self._kept.clear()
