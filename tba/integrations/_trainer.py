"""`CacheOwner`: what a trainer callback (Hugging Face, Lightning) does with its cache.

A callback is made before the trainer exists and its model is known only when training starts:
the owner validates the options at once, configures the cache on the (unwrapped) model when
training starts, reports the last step's stats as flat ``tba/<field>`` numbers, and closes the
cache when training ends.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch import nn

from tba.config import TensorCacheConfig

if TYPE_CHECKING:
    from tba.cache.tensor_cache import TensorCache

__all__ = ["CacheOwner", "LOGGED_FIELDS", "unwrap"]

logger = logging.getLogger(__name__)

#: The :class:`tba.CacheStats` fields a callback logs each step, as ``tba/<field>``.
LOGGED_FIELDS = (
    "offloaded_bytes",
    "reloaded_bytes",
    "kept_bytes",
    "peak_resident_bytes",
    "stall_s",
    "store_wait_s",
    "num_sync_loads",
    "num_io_errors",
    "io_cpu_s",
)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP / DataParallel / ``torch.compile`` wrappers: tba hooks the model
    itself."""
    while True:
        compiled = getattr(model, "_orig_mod", None)
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(compiled, nn.Module):
            model = compiled
        else:
            return model


class CacheOwner:
    """Opens a cache for a model when training starts and closes it when training ends.

    Raises:
        ValueError: at construction, for invalid options (every problem listed).
    """

    def __init__(self, config: TensorCacheConfig | None, options: dict[str, Any]) -> None:
        from tba import _resolve_config

        self.config = _resolve_config(config, options)
        self.cache: TensorCache | None = None

    def open(self, model: nn.Module) -> None:
        import tba

        if self.cache is not None:
            logger.warning(
                "tba: a new training run starts while the last one's cache is still open "
                "(did it raise?); closing the old cache"
            )
            self.close()
        self.cache = tba.configure_tensor_cache(unwrap(model), config=self.config)

    def step_stats(self) -> dict[str, float]:
        """The last completed step's stats, ``{"tba/offloaded_bytes": ..., ...}``."""
        if self.cache is None:
            return {}
        stats = self.cache.stats()
        return {f"tba/{name}": getattr(stats, name) for name in LOGGED_FIELDS}

    def close(self) -> None:
        cache, self.cache = self.cache, None
        if cache is not None:
            cache.close()
