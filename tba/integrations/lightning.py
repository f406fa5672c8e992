"""tba in a Lightning ``Trainer``: one callback.

:class:`TensorCacheCallback` configures a :class:`tba.TensorCache` on the ``LightningModule``
when fitting starts, closes it when fitting is torn down, and logs the last completed step's
tba stats through ``pl_module.log_dict`` (``tba/offloaded_bytes``, ``tba/stall_s``, ...) after
every training batch.

Lightning calls ``training_step``, not ``forward``, and tba follows a module's forward. So the
cache goes on the module that ``training_step`` calls: ``module="net"`` names it (a qualified
submodule name); by default it is the LightningModule itself when its class defines
``forward`` (``training_step`` then calls ``self(...)``), else its one child that holds
parameters. If the first training batch saves nothing the cache manages, the callback warns
once and says why.

The cache is configured in ``on_fit_start``, not ``setup``: Lightning calls
``LightningModule.configure_model`` (where large models build their layers) after ``setup``,
and tba finds the model's blocks when it is configured. It is closed in ``teardown`` of the
``"fit"`` stage, or in ``on_exception`` when fitting raises.

Works with ``lightning`` (``lightning.pytorch``) or the standalone ``pytorch_lightning``: the
callback subclasses the ``Callback`` of whichever is installed, ``lightning`` first. Needs
the ``[lightning]`` extra (``pip install 'tba[lightning]'``).

Example:
    >>> from tba.integrations.lightning import TensorCacheCallback
    >>> trainer = L.Trainer(callbacks=[TensorCacheCallback(offloader="ssd")], max_epochs=1)
    >>> trainer.fit(module, loader)
    >>> trainer.callback_metrics["tba/offloaded_bytes"]
"""

from __future__ import annotations

import importlib.util
import logging
from types import ModuleType
from typing import TYPE_CHECKING, Any

from torch import nn

from tba.config import TensorCacheConfig
from tba.integrations._engine import import_extra
from tba.integrations._trainer import CacheOwner

if TYPE_CHECKING:  # checked against the standalone package; lightning.pytorch is the same API
    import pytorch_lightning as _pl

    from tba.cache.tensor_cache import TensorCache

__all__ = ["TensorCacheCallback"]

logger = logging.getLogger(__name__)


def _lightning_module() -> ModuleType:
    if importlib.util.find_spec("lightning") is not None:
        return import_extra("lightning.pytorch", "tba.integrations.lightning", "lightning")
    return import_extra("pytorch_lightning", "tba.integrations.lightning", "lightning")


if not TYPE_CHECKING:
    _pl = _lightning_module()


class TensorCacheCallback(_pl.Callback):
    """A Lightning ``Callback`` that offloads the module's activations while it fits.

    Args:
        config: a :class:`tba.TensorCacheConfig`, or
        **options: its fields, as for :func:`tba.configure_tensor_cache`. Validated here, so a
            bad option fails when the callback is made.
        module: qualified name of the submodule ``training_step`` calls (``"model"``,
            ``"net.backbone"``); ``None`` picks it as the module docstring says.
        log_stats: log the last completed step's stats after each training batch.

    Attributes:
        cache: the live cache while fitting (else ``None``).
    """

    def __init__(
        self,
        config: TensorCacheConfig | None = None,
        *,
        module: str | None = None,
        log_stats: bool = True,
        **options: Any,
    ) -> None:
        super().__init__()
        self._owner = CacheOwner(config, options)
        self.module = module
        self.log_stats = log_stats
        self._checked = False

    @property
    def cache(self) -> TensorCache | None:
        return self._owner.cache

    def on_fit_start(self, trainer: _pl.Trainer, pl_module: _pl.LightningModule) -> None:
        self._checked = False
        self._owner.open(_target(pl_module, self.module))

    def on_train_batch_end(
        self,
        trainer: _pl.Trainer,
        pl_module: _pl.LightningModule,
        outputs: object,
        batch: object,
        batch_idx: int,
    ) -> None:
        cache = self._owner.cache
        if cache is None:
            return
        if not self._checked:
            self._checked = True
            if cache.stats(cumulative=True).num_packed == 0:
                logger.warning(
                    "tba: the first training batch saved no activation that %s's cache "
                    "manages: training_step may not call it (pass module='<name of the "
                    "submodule training_step calls>' to TensorCacheCallback), or no saved "
                    "tensor is on offload_devices=%s",
                    type(cache.model).__name__,
                    cache.config.offload_devices,
                )
        if self.log_stats:
            pl_module.log_dict(self._owner.step_stats(), on_step=True, on_epoch=False)

    def teardown(self, trainer: _pl.Trainer, pl_module: _pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._owner.close()

    def on_exception(
        self, trainer: _pl.Trainer, pl_module: _pl.LightningModule, exception: BaseException
    ) -> None:
        # Lightning skips teardown hooks when fitting raises; it calls this instead.
        self._owner.close()

    def close(self) -> None:
        """Close the cache now. Idempotent."""
        self._owner.close()


def _target(pl_module: _pl.LightningModule, name: str | None) -> nn.Module:
    """The module ``training_step`` runs: ``name``, or see the module docstring."""
    if name is not None:
        try:
            return pl_module.get_submodule(name)
        except AttributeError as exc:
            raise ValueError(
                f"TensorCacheCallback(module={name!r}): {type(pl_module).__name__} has no such "
                f"submodule; its children are {[n for n, _ in pl_module.named_children()]}"
            ) from exc
    if type(pl_module).forward is not _pl.LightningModule.forward:
        return pl_module
    owners = [
        (n, m) for n, m in pl_module.named_children() if next(m.parameters(), None) is not None
    ]
    if len(owners) != 1:
        raise ValueError(
            f"TensorCacheCallback: {type(pl_module).__name__} defines no forward and has "
            f"{len(owners)} children with parameters ({[n for n, _ in owners]}); pass "
            "module='<name of the submodule training_step calls>'"
        )
    return owners[0][1]
