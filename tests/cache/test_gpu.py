"""CUDA: bit-exact with widened races, and a lower memory peak than keeping everything.

Run on a GPU machine with ``TBA_REQUIRE_GPU=1 pytest -m gpu`` (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tba
from tests import models
from tests.twin import run_twins

pytestmark = pytest.mark.gpu


class SlowBlock(nn.Module):
    """Sleeps on the compute stream before and after its matmuls, so a transfer that is not
    ordered after the producing kernel (or before the consuming one) reads garbage."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = models.MLPBlock(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(200_000)
        y = self.inner(x)
        torch.cuda._sleep(200_000)
        return y


class SlowStack(models.Stack):
    def __init__(self) -> None:
        super().__init__(num_blocks=6, width=256)
        self.blocks = nn.ModuleList(SlowBlock(256) for _ in range(6))


def cuda_batch(seed: int) -> torch.Tensor:
    return models.vector_batch(seed).cuda()


@pytest.mark.parametrize("offloader", ["host", "none"])
def test_cuda_bit_exact_with_race_widening(offloader: str) -> None:
    run_twins(lambda: SlowStack().cuda(), cuda_batch, steps=3, offloader=offloader,
              min_offload_bytes=0, keep_last_modules=1)


def test_cuda_gpt2_bit_exact() -> None:
    def batch(seed: int) -> dict:
        return {k: v.cuda() for k, v in models.lm_batch(seed).items()}

    run_twins(lambda: models.gpt2().cuda(), batch, steps=3, offloader="host", min_offload_bytes=0)


def _peak_allocated(offloader: str) -> int:
    torch.manual_seed(0)
    model = models.Stack(num_blocks=8, width=1024).cuda()
    x = torch.randn(4096, 16, device="cuda")
    with tba.configure_tensor_cache(model, offloader=offloader, min_offload_bytes=0):
        model(x).backward()  # warm-up: pools and allocator caches
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(x).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base


def test_host_offload_lowers_cuda_peak() -> None:
    none, host = _peak_allocated("none"), _peak_allocated("host")
    print(f"activation peak: none={none} host={host} ratio={host / none:.2f}")
    assert host < none
