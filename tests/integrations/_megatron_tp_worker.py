"""Worker side of the Megatron-core tensor-parallel layer tests: 2 gloo ranks, CPU.

A small model of Megatron's own TP layers (``VocabParallelEmbedding``, then blocks of
``ColumnParallelLinear`` -> tanh -> ``RowParallelLinear`` with a residual), tensor-parallel
over both ranks, with and without sequence parallelism. Trained 3 Adam steps with and without
tba: bit-identical losses and gradients, bytes really offloaded and reloaded, and no parameter
storage ever stored.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB = 64
HIDDEN = 16
SEQ = 8
BATCH = 2
NUM_BLOCKS = 3
NUM_STEPS = 3


def setup_megatron() -> None:
    """What Megatron's sequence-parallel all-gather needs: its global memory buffer, and
    ``torch.cuda.current_device()`` (where it allocates) pointed at the CPU in this test
    process only."""
    from megatron.core import parallel_state

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    parallel_state._set_global_memory_buffer()


class Block(nn.Module):
    def __init__(self, config: Any, group: Any, init: Any) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        self.fc1 = ColumnParallelLinear(
            HIDDEN, 4 * HIDDEN, config=config, init_method=init, gather_output=False,
            tp_group=group,
        )
        self.fc2 = RowParallelLinear(
            4 * HIDDEN, HIDDEN, config=config, init_method=init, input_is_parallel=True,
            bias=True, skip_bias_add=False, tp_group=group,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(x)
        out, _ = self.fc2(torch.tanh(h))
        return x + out


class Model(nn.Module):
    def __init__(self, sequence_parallel: bool, group: Any) -> None:
        super().__init__()
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel import VocabParallelEmbedding

        config = ModelParallelConfig(
            tensor_model_parallel_size=dist.get_world_size(),
            sequence_parallel=sequence_parallel,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
        )
        init = functools.partial(torch.nn.init.normal_, std=0.3)
        torch.manual_seed(6000)  # CPU initialisation draws from torch's global generator
        self.sequence_parallel, self.group = sequence_parallel, group
        self.embed = VocabParallelEmbedding(
            VOCAB, HIDDEN, init_method=init, reduce_scatter_embeddings=sequence_parallel,
            config=config, tp_group=group,
        )
        self.blocks = nn.ModuleList(Block(config, group, init) for _ in range(NUM_BLOCKS))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        h = self.embed(ids)  # [s/tp, b, h] with sequence parallelism, [b, s, h] without
        if not self.sequence_parallel:
            h = h.transpose(0, 1).contiguous()
        for block in self.blocks:
            h = block(h)
        if self.sequence_parallel:
            h = gather_from_sequence_parallel_region(
                h, tensor_parallel_output_grad=False, group=self.group
            )
        return h  # [s, b, h] on every rank


def train(sequence_parallel: bool, with_tba: bool) -> dict[str, Any]:
    import tba
    from tests.integrations import _common

    model = Model(sequence_parallel, dist.group.WORLD)
    cache = None
    if with_tba:
        cache = tba.configure_tensor_cache(
            model, offloader="host", offload_devices="cpu", min_offload_bytes=0, adaptive=False
        )
    param_ptrs = _common.parameter_storages(model)
    stored_ptrs = _common.record_stores(cache) if cache is not None else []
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(7)  # TP ranks see the same batch
    out: dict[str, Any] = {"losses": [], "grads": [], "stats": []}
    try:
        for _ in range(NUM_STEPS):
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
            target = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
            opt.zero_grad()
            loss = F.mse_loss(model(ids), target)
            if cache is not None:
                cache.wait_for_stores(timeout_s=60)  # backward then really reloads
            loss.backward()
            out["losses"].append([loss.detach().clone()])
            out["grads"].append(
                {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            )
            if cache is not None:
                out["stats"].append(_common.stats_dict(cache))
            opt.step()
    finally:
        if cache is not None:
            cache.close()
    out["stored_params"] = sorted(param_ptrs & set(stored_ptrs))
    return out


def worker(rank: int, world: int, offloaders: list[str]) -> dict[str, tuple[bool, Any]]:
    from tests.integrations import _common
    from tests.integrations._dist import run_cases

    setup_megatron()
    baselines: dict[str, Any] = {}

    def baseline(sp: bool) -> Any:
        def case() -> None:
            baselines[f"sp={sp}"] = train(sp, with_tba=False)

        return case

    def offload(sp: bool) -> Any:
        def case() -> dict[str, Any]:
            got = train(sp, with_tba=True)
            _common.check_bit_exact(baselines[f"sp={sp}"], got)
            stats = got["stats"][-1]
            assert stats["offloaded_bytes"] > 0 and stats["reloaded_bytes"] > 0, stats
            assert got["stored_params"] == [], f"parameter storages stored: {got['stored_params']}"
            return stats

        return case

    cases: dict[str, Any] = {}
    for sp in (False, True):
        cases[f"sp={sp}/baseline"] = baseline(sp)
        cases[f"sp={sp}/host"] = offload(sp)
    return run_cases(rank, cases)
