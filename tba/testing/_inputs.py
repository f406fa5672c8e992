"""What :func:`tba.testing.check_parity` is given: batches, the loss, the optimizer."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

__all__ = ["LossFn", "OptimizerFactory", "optimizer_factory", "default_loss", "checked_loss", "clone_tensors"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def optimizer_factory(optimizer: Any) -> OptimizerFactory:
    if optimizer is None:
        return lambda params: torch.optim.AdamW(params)
    if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        raise ValueError(
            f"tba.testing.check_parity: optimizer={optimizer!r}: expected a factory called with "
            "each model's parameters (one optimizer per model), e.g. "
            "optimizer=lambda params: torch.optim.SGD(params, lr=0.1)"
        )

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        made = optimizer(params)
        if not isinstance(made, torch.optim.Optimizer):
            raise ValueError(
                f"tba.testing.check_parity: the optimizer factory returned {made!r}, expected a "
                "torch.optim.Optimizer"
            )
        return made

    return make


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    if isinstance(batch, Mapping):
        output = model(**batch)
    elif isinstance(batch, (tuple, list)):
        output = model(*batch)
    elif isinstance(batch, torch.Tensor):
        output = model(batch)
    else:
        raise ValueError(
            f"tba.testing.check_parity: a batch is a {type(batch).__name__}; expected a tuple of "
            "positional arguments, a dict of keyword arguments or a tensor (or pass loss_fn)"
        )
    if isinstance(output, torch.Tensor):
        return output
    loss: torch.Tensor | None = (
        output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None))
    if loss is None:
        raise ValueError(
            f"tba.testing.check_parity: the model returned a {type(output).__name__} with no loss "
            "(a Hugging Face model needs labels in the batch); pass "
            "loss_fn=lambda model, batch: ... returning the loss"
        )
    return loss


def checked_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"tba.testing.check_parity: the loss is {what}; expected a one-element tensor (pass "
            "loss_fn=lambda model, batch: ... returning a scalar loss)"
        )
    if not loss.requires_grad:
        raise ValueError("tba.testing.check_parity: the loss does not require grad: nothing to "
                         "train (are all parameters frozen, or is the forward under no_grad?)")
    return loss


def clone_tensors(batch: Any) -> Any:
    """``batch`` with every tensor in it (in tuples, lists and dicts) cloned, so that a model
    changing its inputs in place cannot make the two runs see different batches."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, (tuple, list)):
        items = [clone_tensors(x) for x in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    if isinstance(batch, MutableMapping):
        out = copy.copy(batch)
        for key, value in batch.items():
            out[key] = clone_tensors(value)
        return out
    return batch
