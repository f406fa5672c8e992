"""CPU time tba adds per saved tensor (pack + unpack + bookkeeping), offloader "none".

A model of many tiny ops saves thousands of small tensors; the step is timed with and without
the cache and the difference is divided by the number of tensors packed.

    python benchmarks/hook_overhead.py                      # defaults, prints and writes JSON
    python benchmarks/hook_overhead.py --ops 400 --repeats 15 --out results/hook_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

import tba
from _environment import describe


class TinyOps(nn.Module):
    """Each block runs ``ops`` elementwise ops whose inputs autograd saves."""

    def __init__(self, ops: int) -> None:
        super().__init__()
        self.ops = ops
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.ops):
            x = torch.sin(x) * self.scale
        return x


class Model(nn.Module):
    def __init__(self, blocks: int, ops: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TinyOps(ops) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


def time_steps(model: nn.Module, x: torch.Tensor, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(x).backward()
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--ops", type=int, default=250)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", default="hook_overhead.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    env = describe("cpu")
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    model = Model(args.blocks, args.ops)
    x = torch.randn(8)
    time_steps(model, x, 2)
    base = time_steps(model, x, args.repeats)
    with tba.configure_tensor_cache(model, offloader="none", offload_devices=("cpu",),
                                    min_offload_bytes=0) as cache:
        time_steps(model, x, 2)
        with_cache = time_steps(model, x, args.repeats)
        packed = cache.stats().num_packed
    base_s, cache_s = statistics.median(base), statistics.median(with_cache)
    per_tensor_us = (cache_s - base_s) / packed * 1e6
    result = {
        "environment": env,
        "num_packed_per_step": packed,
        "step_s_without": base_s,
        "step_s_with": cache_s,
        "overhead_us_per_tensor": per_tensor_us,
        "target_us_per_tensor": 30.0,
    }
    print(f"saved tensors per step: {packed}; step {base_s * 1e3:.1f} ms without, "
          f"{cache_s * 1e3:.1f} ms with tba; overhead {per_tensor_us:.1f} us per tensor (target <= 30)")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
