"""tba in a Hugging Face ``transformers.Trainer``: one callback.

:class:`TensorCacheCallback` configures a :class:`tba.TensorCache` on the model when training
begins (the unwrapped model: the one the Trainer's callbacks receive, not a DDP wrapper),
closes it when training ends, and adds the last completed step's tba stats to the Trainer's
logs (``tba/offloaded_bytes``, ``tba/stall_s``, ...).

Needs the ``[hf]`` extra (``pip install 'tba[hf]'``: transformers and accelerate).

Example:
    >>> from tba.integrations.hf import TensorCacheCallback
    >>> callback = TensorCacheCallback(offloader="ssd", offload_devices="cuda")
    >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    >>> trainer.train()            # the cache lives from on_train_begin to on_train_end
    >>> trainer.state.log_history  # each logged step carries tba/offloaded_bytes, ...
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch import nn

from tba.config import TensorCacheConfig
from tba.integrations._engine import import_extra
from tba.integrations._trainer import CacheOwner

if TYPE_CHECKING:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

    from tba.cache.tensor_cache import TensorCache
else:  # the error names the extra to install
    TrainerCallback = import_extra("transformers", "tba.integrations.hf", "hf").TrainerCallback

__all__ = ["TensorCacheCallback"]

logger = logging.getLogger(__name__)


class TensorCacheCallback(TrainerCallback):
    """A ``TrainerCallback`` that offloads the model's activations for the whole ``train()``.

    Args:
        config: a :class:`tba.TensorCacheConfig`, or
        **options: its fields, as for :func:`tba.configure_tensor_cache`. Validated here, so a
            bad option fails when the callback is made, not when training starts.
        log_stats: add the last completed step's stats to every log (``tba/<field>``).

    The logs reach ``trainer.state.log_history`` and every callback after this one in the
    Trainer's list. ``report_to`` integrations (wandb, tensorboard, ...) come *before* callbacks
    passed to ``Trainer(callbacks=...)``; to have them report tba's numbers, put this callback
    first: ``trainer.callback_handler.callbacks.insert(0, callback)``.

    Attributes:
        cache: the live cache between ``on_train_begin`` and ``on_train_end`` (else ``None``).
    """

    def __init__(
        self, config: TensorCacheConfig | None = None, *, log_stats: bool = True, **options: Any
    ) -> None:
        self._owner = CacheOwner(config, options)
        self.log_stats = log_stats

    @property
    def cache(self) -> TensorCache | None:
        return self._owner.cache

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: object,
    ) -> None:
        if model is None:
            raise ValueError(
                "tba.integrations.hf.TensorCacheCallback: the Trainer passed no model to "
                "on_train_begin; configure tba yourself with tba.configure_tensor_cache(model)"
            )
        self._owner.open(model)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, object] | None = None,
        **kwargs: object,
    ) -> None:
        if not self.log_stats or logs is None or self._owner.cache is None:
            return
        stats = self._owner.step_stats()
        logs.update(stats)
        # Trainer.log appended its copy of ``logs`` to log_history just before on_log.
        history = getattr(state, "log_history", None)
        if history and history[-1].get("step") == state.global_step:
            history[-1].update(stats)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        self._owner.close()

    def close(self) -> None:
        """Close the cache now (after a ``train()`` that raised, for instance). Idempotent."""
        self._owner.close()
