"""Worker side of the FSDP2 (``fully_shard``) tests: 2 gloo ranks, CPU.

Per ``reshard_after_forward`` (True and False): the model sharded per block and at the root,
trained 3 Adam steps with and without tba, bit for bit; and the bytes tba offloads each step
equal those it offloads for the same model *without* FSDP on the same batch. FSDP2 all-gathers
each block's parameters into fresh storages in its forward (and, resharding, frees them after
it), so any parameter bytes in the offloaded set would show up as a difference.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

D = 32
BATCH = 8
NUM_BLOCKS = 3
NUM_STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, 4 * D)
        self.w2 = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.tanh(self.w1(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5000)
        self.blocks = nn.ModuleList(Block() for _ in range(NUM_BLOCKS))
        self.head = nn.Linear(D, D)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    to_local = getattr(t, "to_local", None)
    return (to_local() if to_local is not None else t).detach().clone()


def train(rank: int, fsdp: bool, reshard: bool, with_tba: bool) -> dict[str, Any]:
    """3 Adam steps on this rank's data; losses, local gradients and per-step tba stats."""
    import tba
    from tests.integrations import _common

    model = Model()
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
    cache = None
    if with_tba:
        cache = tba.configure_tensor_cache(
            model, offloader="host", offload_devices="cpu", min_offload_bytes=0, adaptive=False
        )
    param_ptrs = _common.parameter_storages(model)
    stored_ptrs = _common.record_stores(cache) if cache is not None else []
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(300 + rank)
    out: dict[str, Any] = {"losses": [], "grads": [], "stats": []}
    try:
        for _ in range(NUM_STEPS):
            x = torch.randn(BATCH, D, generator=gen)
            target = torch.randn(BATCH, D, generator=gen)
            opt.zero_grad()
            loss = F.mse_loss(model(x), target)
            if cache is not None:
                # Every store completes before backward, so backward really reloads.
                cache.wait_for_stores(timeout_s=60)
            loss.backward()
            out["losses"].append([loss.detach().clone()])
            out["grads"].append({n: _local(p.grad) for n, p in model.named_parameters()})
            if cache is not None:
                stats = cache.stats()
                out["stats"].append(
                    {k: getattr(stats, k) for k in ("offloaded_bytes", "reloaded_bytes", "num_packed")}
                )
            opt.step()
    finally:
        if cache is not None:
            cache.close()
    # Sharded parameters live all along: none of their storages may have been written out.
    out["stored_params"] = sorted(param_ptrs & set(stored_ptrs))
    return out


def worker(rank: int, world: int, offloaders: list[str]) -> dict[str, tuple[bool, Any]]:
    from tests.integrations import _common
    from tests.integrations._dist import run_cases

    results: dict[str, Any] = {}

    def run(name: str, **kwargs: Any) -> Any:
        def case() -> None:
            results[name] = train(rank, **kwargs)

        return case

    def check(reshard: bool) -> Any:
        def case() -> list[dict[str, int]]:
            plain = results["plain/tba"]
            baseline, got = results[f"fsdp/{reshard}/baseline"], results[f"fsdp/{reshard}/tba"]
            _common.check_bit_exact(baseline, got)
            for step, (want, have) in enumerate(zip(plain["stats"], got["stats"], strict=True)):
                assert have["offloaded_bytes"] > 0 and have["reloaded_bytes"] > 0, (step, have)
                assert have["offloaded_bytes"] == want["offloaded_bytes"], (
                    f"step {step}: FSDP2 (reshard_after_forward={reshard}) offloaded "
                    f"{have['offloaded_bytes']} bytes, the same model without FSDP "
                    f"{want['offloaded_bytes']}: parameter bytes were offloaded"
                )
            assert got["stored_params"] == [], f"sharded parameters stored: {got['stored_params']}"
            return got["stats"]

        return case

    cases: dict[str, Any] = {"plain/tba": run("plain/tba", fsdp=False, reshard=False, with_tba=True)}
    for reshard in (True, False):
        cases[f"fsdp/{reshard}/baseline"] = run(
            f"fsdp/{reshard}/baseline", fsdp=True, reshard=reshard, with_tba=False
        )
        cases[f"fsdp/{reshard}/tba"] = run(
            f"fsdp/{reshard}/tba", fsdp=True, reshard=reshard, with_tba=True
        )
        cases[f"fsdp/{reshard}/check"] = check(reshard)
    return run_cases(rank, cases)
