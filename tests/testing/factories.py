"""Models and batches for tba.testing's tests, and factories for ``tba check`` (importable as
``tests.testing.factories:NAME``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests import models


def gpt2() -> nn.Module:
    """A 3-layer GPT-2 from a config (no download), with dropout on, seeded."""
    torch.manual_seed(0)
    return models.gpt2()


def lm_batches(num_steps: int = 3) -> list[dict[str, torch.Tensor]]:
    return [models.lm_batch(step) for step in range(num_steps)]


def stack() -> nn.Module:
    """Residual MLP blocks whose forward returns a scalar loss; dropout on."""
    torch.manual_seed(0)
    return models.Stack(num_blocks=3)


def vector_batches(num_steps: int = 3) -> list[tuple[torch.Tensor]]:
    return [(models.vector_batch(step),) for step in range(num_steps)]


class NormNet(nn.Module):
    """A model with buffers (BatchNorm running statistics) and a loss from a separate target."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 16)) for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


# ---------------------------------------------------------------- factories for `tba check`
def tiny_gpt2() -> tuple[nn.Module, list[dict[str, torch.Tensor]]]:
    return gpt2(), lm_batches()


def tiny_stack_with_options() -> dict[str, Any]:
    return {"model": stack(), "batches": iter(vector_batches(5)),
            "options": {"offloader": "host", "offload_devices": ("cpu",), "min_offload_bytes": 0,
                        "adaptive": False, "keep_last_modules": 0}}


def corrupting_gpt2() -> dict[str, Any]:
    from tba.testing import CorruptingOffloader

    return {"model": gpt2(), "batches": lm_batches(), "options": {"offloader": CorruptingOffloader()}}


def not_a_model() -> int:
    return 3
