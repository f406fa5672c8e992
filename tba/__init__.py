"""tba: offload PyTorch training activations to NVMe SSD or host memory.

Example:
    >>> import tba
    >>> tba.configure_tensor_cache(model, offloader="host")  # doctest: +SKIP
    >>> loss = model(batch).loss; loss.backward()  # doctest: +SKIP
    >>> print(tba.get_tensor_cache(model).stats())  # doctest: +SKIP

Importing tba initialises no CUDA, loads no native library and installs no hook.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from typing import Any

from torch import nn

from tba.cache.observe.stats import CacheStats
from tba.cache.tensor_cache import TensorCache
from tba.config import TensorCacheConfig
from tba.errors import OffloadIOError, TBAError

__all__ = [
    "configure_tensor_cache",
    "get_tensor_cache",
    "TensorCache",
    "TensorCacheConfig",
    "CacheStats",
    "TBAError",
    "OffloadIOError",
]

__version__ = "0.1.0"

logger = logging.getLogger(__name__)


def configure_tensor_cache(
    model: nn.Module, config: TensorCacheConfig | None = None, **options: Any
) -> TensorCache:
    """Offload the activations ``model`` saves for backward; returns the cache.

    The cache hooks ``model`` (forward hooks, and ``saved_tensors_hooks`` around each of its
    forwards): nothing else in the training script changes. Results are bit-identical to
    training without it. The model owns its cache: the call works the same whether or not
    its result is kept (:func:`get_tensor_cache` finds the cache again), and the cache ends
    with ``close()``, when the model is configured again (the new configuration replaces it),
    or when the model is collected.

    Args:
        model: the module whose forward saves the activations (the whole model, or one
            pipeline stage).
        config: a :class:`TensorCacheConfig` holding every option. Keywords may be given
            beside it only when they agree with it; to change a config, pass
            ``config.replace(...)``.
        **options: fields of :class:`TensorCacheConfig` (instead of ``config``).

    Returns:
        The :class:`TensorCache`; ``close()`` it (or use it as a context manager) to remove
        every hook.

    Raises:
        ValueError: an unknown or invalid option (every problem is listed), or keywords that
            disagree with ``config``.

    Example:
        >>> tba.configure_tensor_cache(model, offloader="host", offload_devices=("cuda",))
        >>> for batch in loader:
        ...     model(**batch).loss.backward(); optimizer.step(); optimizer.zero_grad()
        >>> print(tba.get_tensor_cache(model).stats())
        >>> cfg = tba.TensorCacheConfig(offloader="ssd", offload_devices="cuda")
        >>> cache = tba.configure_tensor_cache(model, config=cfg)  # replaces the first one
    """
    from tba.integrations import registry
    from tba.offloaders import make_offloader

    if not isinstance(model, nn.Module):
        raise TypeError(f"configure_tensor_cache expects a torch.nn.Module, got {type(model).__name__}")
    config = _resolve_config(config, options)
    previous = registry.get(model)
    if previous is not None:
        logger.info("tba: %s is configured again: its previous cache is closed", type(model).__name__)
        previous.close()
    if config.pipeline is not None:
        # Process-wide and idempotent; a patched scheduler runs unchanged for modules without
        # a cache, so the patch outlives this cache (tba.integrations.unpatch() removes it).
        from tba import integrations

        integrations.patch(config.pipeline)
    offloader = make_offloader(config, rank=_rank())
    try:
        cache = TensorCache(model, config, offloader)
    except BaseException:
        # A configuration TensorCache refuses (bad block_modules, ...) leaves nothing behind:
        # no offloader directory, no SIGINT handler kept for an engine nobody will close.
        if offloader is not None:
            offloader.close()
        raise
    registry.register(cache, model)
    # Weakly: the cache must not hold its model (Note [The model owns its cache]).
    cache.add_close_callback(functools.partial(_unregister, weakref.ref(model)))
    return cache


def _unregister(model_ref: weakref.ref[nn.Module]) -> None:
    from tba.integrations import registry

    model = model_ref()
    if model is not None:
        registry.unregister(model)


def get_tensor_cache(model: nn.Module) -> TensorCache | None:
    """The tensor cache configured on ``model`` (or on the module ``model`` wraps, such as
    DDP's ``module``), or None.

    Example:
        >>> tba.configure_tensor_cache(model, offloader="host")  # doctest: +SKIP
        >>> print(tba.get_tensor_cache(model).summary())  # doctest: +SKIP
    """
    from tba.integrations import registry

    if not isinstance(model, nn.Module):
        raise TypeError(f"get_tensor_cache expects a torch.nn.Module, got {type(model).__name__}")
    found = registry.get(model)
    if found is None:
        inner = getattr(model, "module", None)  # DDP, FSDP1, DeepSpeed engines
        if isinstance(inner, nn.Module):
            found = registry.get(inner)
    # Only configure_tensor_cache registers here outside tests (whose fakes are no TensorCache).
    return found if isinstance(found, TensorCache) else None


def _resolve_config(config: TensorCacheConfig | None, options: dict[str, Any]) -> TensorCacheConfig:
    """The config that ``configure_tensor_cache(model, config, **options)`` means.

    Raises:
        ValueError: every problem at once: unknown or invalid options, ``config`` not a
            :class:`TensorCacheConfig`, or keywords that disagree with ``config``.
    """
    if config is not None and not isinstance(config, TensorCacheConfig):
        raise ValueError(
            f"invalid tba.configure_tensor_cache options:\n  - config={config!r}: expected a "
            "tba.TensorCacheConfig (or pass the options as keywords instead)"
        )
    fields = {f.name for f in dataclasses.fields(TensorCacheConfig)}
    unknown = sorted(set(options) - fields)
    problems = [
        f"{name}: unknown option; accepted options are {', '.join(sorted(fields))}" for name in unknown
    ]
    known = {k: v for k, v in options.items() if k in fields}
    resolved = config
    try:
        if config is None:
            resolved = TensorCacheConfig(**known)
        elif known:
            resolved = config.replace(**known)
    except ValueError as exc:
        problems.extend(line.strip()[2:] for line in str(exc).splitlines()[1:])
    if config is not None and resolved is not config:
        problems.extend(
            f"{name}={getattr(resolved, name)!r} as a keyword, but config has "
            f"{name}={getattr(config, name)!r}: pass config=config.replace({name}=...) instead"
            for name in sorted(known)
            if getattr(resolved, name) != getattr(config, name)
        )
    if problems or resolved is None:
        raise ValueError(
            "invalid tba.configure_tensor_cache options:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return resolved


def _rank() -> int | None:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None
