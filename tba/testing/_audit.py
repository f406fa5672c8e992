"""`AuditedOffloader`: makes an offloader prove that bytes really left memory and came back.

Note [Parity needs moved bytes]: a twin comparison proves that offloading is exact only if the
bytes backward reads really went through the offloader. Two ways an offloader can pass one
without moving anything:

1. It keeps a reference to the source instead of copying it out (``store`` returns ``src``,
   ``load`` copies from it). Results are exact and the cache counts the bytes as offloaded and
   reloaded, but no memory was freed.
2. It never writes and leaves ``dst`` as it was on ``load``. A fresh reload buffer often gets
   the very block the source was freed from, with the old bytes still in it, so results can be
   exact by luck.

So the audit hands ``store`` a private copy of the source and overwrites that copy (every byte
inverted) as soon as ``store`` returns: an offloader that kept it reads the inverted bytes back.
And it fills ``dst`` with a poison byte before ``load``: a load that does not fill it leaves
the poison. Either way backward computes with wrong bytes and the twin comparison fails. On the
host the private copy starts at the source's address modulo the page, so an offloader that moves
whole pages (Note [Reload buffers at the source's page offset] in tba's cache) takes the same
path as without the audit.
"""

from __future__ import annotations

import threading
from typing import Any, cast

import torch

from tba.offloaders.base import Offloader, StoresNow
from tba.settings import DIRECT_IO_ALIGNMENT
from tba.offloaders.wrapper import OffloaderWrapper

__all__ = ["AuditedOffloader"]

_POISON = 0xA5


def _copy_at_page_offset(src: torch.Tensor) -> torch.Tensor:
    """A copy of the ``uint8`` tensor ``src``; on the host, at ``src``'s address modulo the page."""
    num_bytes = src.numel()
    if src.device.type != "cpu" or num_bytes < DIRECT_IO_ALIGNMENT:
        return src.clone()
    base = torch.empty(num_bytes + DIRECT_IO_ALIGNMENT, dtype=torch.uint8)
    shift = (src.data_ptr() - base.data_ptr()) % DIRECT_IO_ALIGNMENT
    copy = base[shift : shift + num_bytes]
    copy.copy_(src)
    return copy


class AuditedOffloader(OffloaderWrapper):
    """Wraps an offloader so that it cannot pass a parity check without moving bytes (Note
    [Parity needs moved bytes]): stores see a private copy of the source, inverted once the
    store returns; load destinations are poisoned first. Counts what went through it.

    Attributes:
        stored_bytes, loaded_bytes: bytes handed to ``inner``'s store and load calls.
    """

    def __init__(self, inner: Offloader) -> None:
        super().__init__(inner, "audited")
        self._lock = threading.Lock()
        self.stored_bytes = 0
        self.loaded_bytes = 0

    def store(self, src: torch.Tensor) -> Any:
        scratch = _copy_at_page_offset(src)
        token = self.inner.store(scratch)
        scratch.bitwise_not_()  # Note [Parity needs moved bytes]: the offloader has copied it out
        with self._lock:
            self.stored_bytes += src.numel()
        return token

    def _store_now(self, storage: torch.UntypedStorage) -> Any:
        source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        scratch = source.clone()
        token = cast(StoresNow, self.inner).store_now(scratch.untyped_storage())
        if token is not None:
            scratch.bitwise_not_()
            with self._lock:
                self.stored_bytes += scratch.numel()
        return token

    def load(self, token: Any, dst: torch.Tensor) -> None:
        dst.fill_(_POISON)
        self.inner.load(token, dst)
        with self._lock:
            self.loaded_bytes += dst.numel()
