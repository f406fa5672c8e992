"""CUDA memory probe of the GPU verdict: reserved, active and allocated peaks per step with and
without the host offloader (forced: ``adaptive=False``; the bytes it moved are reported and a
run that moved none fails its rows), allocation retries, pinned host bytes against the most the pool
held, and the raw pinned device-to-host copy bandwidth, all in one run.

    python benchmarks/_verdict_memory.py --out memory.json                    # what gpu_suite.sh runs
    python benchmarks/_verdict_memory.py --steps 6 --warmup 2 --width 64 --batch 64 --out m.json

Without CUDA it writes ``{"skipped": reason}``. The model is adaptive_offload.py's MLP stack.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import tba
from _environment import describe
from adaptive_offload import Model
from tba.offloaders import HostOffloader
from tba.offloaders.host_memory import HostAllocator


class PeakHost(HostOffloader):
    """The host offloader, also tracking the most bytes it held at once."""

    def __init__(self) -> None:
        super().__init__()
        self.peak_held_bytes = 0

    def store(self, src: torch.Tensor):
        token = super().store(src)
        self.peak_held_bytes = max(self.peak_held_bytes, self.used_bytes)
        return token


def run(args: argparse.Namespace, mode: str) -> dict:
    torch.manual_seed(0)
    torch.cuda.empty_cache()
    model = Model(args.blocks, args.width).cuda()
    x = torch.randn(args.batch, args.width, device="cuda")
    offloader = PeakHost() if mode == "host" else "none"
    retries_before = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    reserved, active, allocated, forward_allocated = [], [], [], []
    moved: list[tuple[int, int]] = []  # (offloaded, reloaded) bytes per step
    # adaptive=False: the host mode offloads every block but the last, whatever a policy would
    # decide (with the default policy this probe once measured keep against keep: issue 38).
    options = dict(adaptive=False) if mode == "host" else {}
    with tba.configure_tensor_cache(model, offloader=offloader, offload_devices=("cuda",), min_offload_bytes=0,
                                    max_inflight_bytes=args.max_inflight_mib << 20, **options) as cache:
        for _ in range(args.steps):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            loss = model(x)
            torch.cuda.synchronize()
            # Where the step's peak lies: in forward (the activations piling up) or in backward.
            forward_allocated.append(torch.cuda.max_memory_allocated())
            loss.backward()
            del loss
            torch.cuda.synchronize()
            stats = torch.cuda.memory_stats()
            reserved.append(stats["reserved_bytes.all.peak"])
            active.append(stats["active_bytes.all.peak"])
            allocated.append(stats["allocated_bytes.all.peak"])
            step = cache.stats()
            moved.append((step.offloaded_bytes, step.reloaded_bytes))
        write_bytes_per_s = cache.stats(cumulative=True).write_bytes_per_s
        pinned = offloader.pinned_bytes if isinstance(offloader, PeakHost) else 0
        held = offloader.peak_held_bytes if isinstance(offloader, PeakHost) else 0
    warm = slice(args.warmup, None)
    return {
        "reserved_peak_per_step": reserved,
        "reserved_peak_bytes": max(reserved[warm]),
        "active_peak_bytes": max(active[warm]),
        "allocated_peak_bytes": max(allocated[warm]),
        "forward_allocated_peak_bytes": max(forward_allocated[warm]),
        "num_alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries_before,
        "pinned_bytes": pinned,
        "peak_held_bytes": held,
        "write_bytes_per_s": write_bytes_per_s,
        "offloaded_bytes": sum(out for out, _ in moved[warm]),
        "reloaded_bytes": sum(back for _, back in moved[warm]),
        "measured_steps": len(moved[warm]),
    }


def copy_engine_d2h_bytes_per_s(num_bytes: int, runs: int = 5) -> float:
    host = HostAllocator().allocate(num_bytes, pinned=True)
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    samples = []
    for _ in range(runs + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        host.tensor.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        samples.append(num_bytes / (start.elapsed_time(end) / 1e3))
    host.release()
    return statistics.median(samples[1:])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--copy-mib", type=int, default=256)
    p.add_argument("--max-inflight-mib", type=int, default=4096,
                   help="the cache's max_inflight_bytes in MiB: bounds how far forward runs ahead of the stores")
    p.add_argument("--out", default="memory.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        result: dict = {"skipped": "no CUDA device"}
    else:
        env = describe("cuda")
        print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
        result = {"environment": env, "args": vars(args), "warmup": args.warmup,
                  "modes": {mode: run(args, mode) for mode in ("keep", "host")},
                  "copy_engine_d2h_bytes_per_s": copy_engine_d2h_bytes_per_s(args.copy_mib << 20)}
        for mode, row in result["modes"].items():
            print(f"{mode:>5}: reserved {row['reserved_peak_bytes'] / 2**20:.0f} MiB, active "
                  f"{row['active_peak_bytes'] / 2**20:.0f} MiB, allocated {row['allocated_peak_bytes'] / 2**20:.0f} MiB "
                  f"(in forward {row['forward_allocated_peak_bytes'] / 2**20:.0f} MiB), "
                  f"retries {row['num_alloc_retries']}, pinned {row['pinned_bytes'] / 2**20:.0f} MiB for "
                  f"{row['peak_held_bytes'] / 2**20:.0f} MiB held, moved {row['offloaded_bytes'] / 2**20:.0f} MiB out "
                  f"and {row['reloaded_bytes'] / 2**20:.0f} MiB back in {row['measured_steps']} steps")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
