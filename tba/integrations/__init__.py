"""Integrations: pipeline schedulers that feed ``TensorCache.set_stage`` hints, and trainer
callbacks.

Each pipeline engine module has ``patch()`` / ``unpatch()`` / ``is_patched()`` (idempotent,
reversible, per process; one shared skeleton, :mod:`tba.integrations._engine`):

- :mod:`tba.integrations.torch_pipelining`: ``torch.distributed.pipelining`` schedules.
- :mod:`tba.integrations.megatron`: Megatron-core's ``forward_backward_*`` schedules.
- :mod:`tba.integrations.deepspeed`: DeepSpeed's ``PipelineEngine``.

Trainer callbacks, which configure a cache when training starts and close it when it ends:

- :mod:`tba.integrations.hf`: ``TensorCacheCallback`` for ``transformers.Trainer`` (``[hf]``).
- :mod:`tba.integrations.lightning`: ``TensorCacheCallback`` for Lightning (``[lightning]``).

:mod:`tba.integrations.registry` maps each module to its cache; ``configure_tensor_cache``
registers there, so a patched scheduler finds the cache of the stage it runs.

Importing this package imports none of the engines.

Example:
    >>> import tba.integrations
    >>> tba.integrations.patch("torch")   # or tba.integrations.torch_pipelining.patch()
    >>> ...                               # train
    >>> tba.integrations.unpatch("torch")
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Literal

__all__ = ["ENGINES", "patch", "unpatch", "engine_module"]

#: Engine names accepted by :func:`patch` (and ``TensorCacheConfig.pipeline``) -> module.
ENGINES: dict[str, str] = {
    "torch": "tba.integrations.torch_pipelining",
    "megatron": "tba.integrations.megatron",
    "deepspeed": "tba.integrations.deepspeed",
}
_DISTRIBUTIONS = {"torch": "torch", "megatron": "megatron.core", "deepspeed": "deepspeed"}

Engine = Literal["torch", "megatron", "deepspeed", "auto"]


def engine_module(engine: str) -> ModuleType:
    """The integration module of ``engine`` ("torch", "megatron" or "deepspeed")."""
    if engine not in ENGINES:
        raise ValueError(f"unknown pipeline engine {engine!r}: expected one of {sorted(ENGINES)}")
    return importlib.import_module(ENGINES[engine])


def _installed(engine: str) -> bool:
    try:
        return importlib.util.find_spec(_DISTRIBUTIONS[engine]) is not None
    except ModuleNotFoundError:  # parent package missing
        return False


def patch(engine: Engine = "auto") -> list[str]:
    """Patch one engine, or with ``"auto"`` every engine that is installed; returns the names
    patched. Idempotent.

    Raises:
        ValueError: unknown engine name.
        IntegrationVersionError: the engine's internals differ from the tested ones.
    """
    names: list[str] = [e for e in ENGINES if _installed(e)] if engine == "auto" else [engine]
    for name in names:
        engine_module(name).patch()
    return names


def unpatch(engine: Engine = "auto") -> None:
    """Undo :func:`patch` for one engine, or every patched engine with ``"auto"``."""
    names = list(ENGINES) if engine == "auto" else [engine]
    for name in names:
        module = sys.modules.get(ENGINES[name]) if engine == "auto" else engine_module(name)
        if module is not None:
            module.unpatch()
