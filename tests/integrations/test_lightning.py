"""``tba.integrations.lightning.TensorCacheCallback`` in a real Lightning ``Trainer`` (CPU):
bit-identical to the same fit without tba, bytes really offloaded and reloaded, stats logged
through ``log_dict``, the cache closed at teardown."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests import models

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None
    and importlib.util.find_spec("pytorch_lightning") is None,
    reason="Lightning is not installed (pip install 'tba[lightning]')",
)

NUM_STEPS = 3
OPTIONS = dict(offload_devices="cpu", min_offload_bytes=0, adaptive=False)


def _pl():
    from tba.integrations.lightning import _pl

    return _pl


def _module_class(with_forward: bool = False, num_nets: int = 1):
    pl = _pl()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = models.Stack(num_blocks=4)
            if num_nets == 2:
                self.other = torch.nn.Linear(2, 2)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0])  # not self(...): Lightning never calls forward itself

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    if with_forward:
        Module.forward = lambda self, x: self.net(x)
    return Module


def _fit(callbacks: list, module_class=None) -> tuple[torch.nn.Module, list, dict]:
    """Three Adam steps of a residual MLP stack with dropout; the module, every step's
    gradients (read before the optimizer step) and the trainer's callback metrics."""
    pl = _pl()
    Module = module_class or _module_class()

    grads: list[dict[str, torch.Tensor]] = []

    class RecordGrads(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters()})

    pl.seed_everything(0, verbose=False)
    module = Module()
    data = torch.utils.data.TensorDataset(
        torch.cat([models.vector_batch(i) for i in range(NUM_STEPS)])
    )
    loader = torch.utils.data.DataLoader(data, batch_size=2 * models.BATCH, shuffle=False)
    trainer = pl.Trainer(
        max_steps=NUM_STEPS, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[*callbacks, RecordGrads()],
    )
    trainer.fit(module, loader)
    return module, grads, dict(trainer.callback_metrics)


def test_lightning_callback_is_bit_exact_and_logs_stats():
    from tba.integrations.lightning import TensorCacheCallback

    pl = _pl()
    callback = TensorCacheCallback(**OPTIONS)
    caches = []

    class WaitForStores(pl.Callback):
        """After the cache is configured: complete every store when forward ends (before
        backward), so backward really reloads; remember the cache."""

        def on_fit_start(self, trainer, pl_module):
            caches.append(callback.cache)
            callback.cache.model.register_forward_hook(
                lambda m, a, o: callback.cache.wait_for_stores(timeout_s=60)
            )

    reference, ref_grads, _ = _fit([])
    module, grads, metrics = _fit([callback, WaitForStores()])

    assert len(grads) == len(ref_grads) == NUM_STEPS
    for step, (want, have) in enumerate(zip(ref_grads, grads)):
        for name in want:
            assert torch.equal(want[name], have[name]), f"step {step}: grad of {name} differs"
    for (name, a), b in zip(reference.named_parameters(), module.parameters()):
        assert torch.equal(a, b), f"parameter {name} differs after fit"

    assert metrics["tba/offloaded_bytes"] > 0 and metrics["tba/reloaded_bytes"] > 0, metrics
    assert metrics["tba/num_io_errors"] == 0
    # No forward of its own: the cache went on the one child training_step calls.
    assert caches[0] is not None and caches[0].model is module.net
    assert callback.cache is None and caches[0]._closed  # closed at teardown


def test_module_whose_forward_training_step_skips_gets_a_warning(caplog):
    """A LightningModule with a forward that training_step does not call: the cache on it
    sees nothing, and the callback says so after the first batch, naming ``module=``."""
    import logging

    from tba.integrations.lightning import TensorCacheCallback

    caplog.set_level(logging.WARNING, logger="tba.integrations.lightning")
    _, _, metrics = _fit([TensorCacheCallback(**OPTIONS)], _module_class(with_forward=True))
    assert metrics["tba/offloaded_bytes"] == 0 and metrics["tba/kept_bytes"] == 0
    assert [r.getMessage() for r in caplog.records if "module='<name" in r.getMessage()], caplog.text
    caplog.clear()
    _, _, metrics = _fit(
        [TensorCacheCallback(module="net", **OPTIONS)], _module_class(with_forward=True)
    )
    # The cache now sees the forward (the last block is kept in memory at least).
    assert metrics["tba/kept_bytes"] > 0 and not caplog.records


def test_ambiguous_or_unknown_module_is_refused():
    from tba.integrations.lightning import TensorCacheCallback, _target

    module = _module_class(num_nets=2)()
    with pytest.raises(ValueError, match=r"2 children with parameters \(\['net', 'other'\]\)"):
        _target(module, None)
    with pytest.raises(ValueError, match="has no such submodule"):
        _target(module, "nope")
    assert _target(module, "net.blocks") is module.net.blocks
    assert TensorCacheCallback(module="net").module == "net"


def test_cache_is_closed_when_fit_raises():
    from tba.integrations.lightning import TensorCacheCallback

    pl = _pl()
    callback = TensorCacheCallback(**OPTIONS)
    caches = []

    class Boom(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            caches.append(callback.cache)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _fit([callback, Boom()])
    assert caches[0] is not None and caches[0]._closed and callback.cache is None
