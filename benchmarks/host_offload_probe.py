"""Where the host offloader's time goes on a GPU: the main job's GPT-2 trained with everything
kept, with the host offloader offloading every block but the last (``adaptive=False``), and with
the default adaptive policy, in one process; per mode the median step time after warm-up, the
cache's counters (bytes moved, store time, measured write bandwidth, stall), the time spent
growing the host pool, and a torch.profiler table of one step's copies (device-to-pinned or
device-to-pageable, and their time).

    python benchmarks/host_offload_probe.py --device cuda --out probe.json          # GPU run
    python benchmarks/host_offload_probe.py --quick --out probe.json                # CPU smoke test

A diagnostic, not a verdict: it prints what a GPU run needs to tell a slow copy from a slow
measurement, and writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import tba
from _environment import describe
from tba.offloaders.host_memory import HostAllocator
from tba.rok._worker import build_model

GPU_MODEL = dict(layers=12, hidden=2048, heads=16, seq_len=1024, vocab=32768, attn_implementation="sdpa")
QUICK_MODEL = dict(layers=2, hidden=64, heads=2, seq_len=32, vocab=128)


class PoolGrowth:
    """Seconds spent allocating (and pinning) host-pool slabs, counted around HostAllocator.allocate."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.num_slabs = 0
        self._original = HostAllocator.allocate
        probe = self

        def allocate(allocator: HostAllocator, num_bytes: int, *, pinned: bool) -> Any:
            start = time.perf_counter()
            try:
                return probe._original(allocator, num_bytes, pinned=pinned)
            finally:
                probe.seconds += time.perf_counter() - start
                probe.num_slabs += 1

        HostAllocator.allocate = allocate  # type: ignore[method-assign]

    def close(self) -> None:
        HostAllocator.allocate = self._original  # type: ignore[method-assign]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_mode(args: argparse.Namespace, mode: str, growth: PoolGrowth) -> dict[str, Any]:
    spec = QUICK_MODEL if args.quick else GPU_MODEL
    model = build_model(spec, args.device, "bfloat16" if args.device == "cuda" else "float32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, spec["vocab"], (args.batch, spec["seq_len"]), device=args.device)
    cache = None
    if mode != "keep":
        options: dict[str, Any] = dict(offloader="host", offload_devices=(args.device,))
        if mode == "host-fixed":
            options["adaptive"] = False
        if args.quick:
            options["min_offload_bytes"] = 0  # the tiny model's storages are all small
        cache = tba.configure_tensor_cache(model, **options)

    def step() -> float:
        sync(args.device)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(args.device)
        return time.perf_counter() - start

    out: dict[str, Any] = {"mode": mode}
    growth.seconds, growth.num_slabs = 0.0, 0
    out["warmup_step_s"] = [step() for _ in range(args.warmup)]
    out["warmup_pool_growth_s"], out["warmup_num_slabs"] = growth.seconds, growth.num_slabs
    growth.seconds, growth.num_slabs = 0.0, 0
    before = cache.stats(cumulative=True) if cache is not None else None
    times = [step() for _ in range(args.steps)]
    out["step_s"] = times
    out["median_step_s"] = statistics.median(times)
    out["pool_growth_s"], out["num_slabs"] = growth.seconds, growth.num_slabs
    if cache is not None:
        after = cache.stats(cumulative=True)
        assert before is not None
        moved = after.offloaded_bytes - before.offloaded_bytes
        out.update(offloaded_bytes=moved, reloaded_bytes=after.reloaded_bytes - before.reloaded_bytes,
                   write_s=after.write_s - before.write_s, stall_s=after.stall_s - before.stall_s,
                   store_wait_s=after.store_wait_s - before.store_wait_s,
                   measured_write_bytes_per_s=after.write_bytes_per_s,
                   num_cancelled=after.num_cancelled - before.num_cancelled,
                   decision=str(getattr(cache, "adaptive_decision", None)))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
    rows = []
    for event in prof.key_averages():
        if "memcpy" in event.key.lower() or "copy_" in event.key.lower():
            device_us = getattr(event, "device_time_total", 0.0)
            rows.append({"name": event.key, "count": event.count, "device_time_us": device_us,
                         "cpu_time_us": event.cpu_time_total})
    out["copies"] = sorted(rows, key=lambda r: -r["device_time_us"])[:12]
    if cache is not None:
        out["summary"] = cache.summary()
        cache.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--modes", default="keep,host-fixed,host-adaptive")
    p.add_argument("--quick", action="store_true", help="tiny model (smoke test)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    env = describe(args)
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    growth = PoolGrowth()
    results = []
    try:
        for mode in args.modes.split(","):
            r = run_mode(args, mode, growth)
            results.append(r)
            extra = ""
            if "offloaded_bytes" in r:
                bw = r["offloaded_bytes"] / r["write_s"] / 1e9 if r["write_s"] else float("nan")
                extra = (f"  offloaded {r['offloaded_bytes'] / 2**20:.0f} MiB in {args.steps} steps, store time "
                         f"{r['write_s']:.3f} s ({bw:.2f} GB/s), measured {r['measured_write_bytes_per_s'] / 1e9:.2f} GB/s, "
                         f"stall {r['stall_s']:.3f} s, cancelled {r['num_cancelled']}")
            print(f"{mode:>14}: median step {r['median_step_s'] * 1e3:.1f} ms (warm-up "
                  f"{', '.join(f'{t * 1e3:.0f}' for t in r['warmup_step_s'])} ms; pool growth "
                  f"{r['warmup_pool_growth_s']:.2f} s in {r['warmup_num_slabs']} slabs then "
                  f"{r['pool_growth_s']:.2f} s){extra}", flush=True)
            for row in r["copies"]:
                print(f"{'':>16}{row['name'][:60]:<60} x{row['count']:<5} device {row['device_time_us'] / 1e3:8.2f} ms"
                      f"  cpu {row['cpu_time_us'] / 1e3:8.2f} ms")
            if "summary" in r:
                print("\n".join(" " * 16 + line for line in r["summary"].splitlines()[:14]))
    finally:
        growth.close()
    with open(args.out, "w") as f:
        json.dump({"environment": env, "args": vars(args), "modes": results}, f, indent=1)


if __name__ == "__main__":
    main()
