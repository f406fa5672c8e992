"""Seeding every random generator a training step may draw from, and giving them back."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["seed_all", "rng_restored"]


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)  # the CPU generator and every CUDA one
    random.seed(seed)
    np.random.seed(seed % 2**32)


@contextlib.contextmanager
def rng_restored() -> Iterator[None]:
    """Give the caller's random generators back as they were: the check reseeds them."""
    cuda = torch.cuda.is_initialized()
    states = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None,
              random.getstate(), np.random.get_state())
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        if states[1] is not None:
            torch.cuda.set_rng_state_all(states[1])
        random.setstate(states[2])
        np.random.set_state(states[3])
