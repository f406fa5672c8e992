"""Step time and activation peak: keep everything vs offload with adaptive off and on.

With a throttled offloader (``--write-mib-s``) writes cannot keep up with forward; the adaptive
boundary keeps the later blocks in memory so the step stays fast.

    python benchmarks/adaptive_offload.py                            # CPU, 400 MiB/s writes
    python benchmarks/adaptive_offload.py --write-mib-s 0            # unthrottled host pool
    python benchmarks/adaptive_offload.py --write-mib-s 0 --offloader ssd --batch 2048 \
        --steps 12 --warmup 4                          # I/O CPU per GB moved (issue 14 item 0)
    python benchmarks/adaptive_offload.py --device cuda --width 2048 --batch 8192 --write-mib-s 0 \
        --max-inflight-mib 4096                                      # what gpu_suite.sh runs
    python benchmarks/adaptive_offload.py --table --out benchmarks/results/cpu/adaptive_table.json
        # GPT-2 12 x 256, batch 16, seq 128 at 1 and 2 torch threads: keep vs adaptive (closed
        # loop) vs fixed host and ssd, interleaved (benchmarks/_adaptive_table.py)
    flock -x /work/.cpu.lock python benchmarks/adaptive_offload.py --long --threads 1,2 \
        --noise none --prefix benchmarks/results/cpu/adaptive_long_quiet --out /tmp/long.json
    flock -x /work/.cpu.lock python benchmarks/adaptive_offload.py --long --threads 1,2 \
        --noise busy --prefix benchmarks/results/cpu/adaptive_long_busy --out /tmp/long_busy.json
        # the closed loop over a long run: plain and tba twins (defaults, offloader ssd) stepped
        # alternately, 100 steps, with and without injected noise (benchmarks/_adaptive_long.py)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

import tba
from tba.offloaders import Throttled
from _environment import describe
from _thread_cpu import tba_threads_cpu_s


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def run(args: argparse.Namespace, mode: str) -> dict:
    torch.manual_seed(0)
    model = Model(args.blocks, args.width).to(args.device)
    x = torch.randn(args.batch, args.width, device=args.device)
    if mode == "keep":
        offloader, adaptive = "none", False
    else:
        offloader = args.offloader
        if args.write_mib_s:
            offloader = Throttled(args.offloader, write_bytes_per_s=args.write_mib_s * 2**20,
                                  read_bytes_per_s=args.read_mib_s * 2**20)
        adaptive = mode == "adaptive"
    times, peaks = [], []
    # I/O CPU over the measured steps: tba's threads' CPU clocks, and (where this tba has it)
    # the cache's own io_cpu_s, per GB moved (offloaded + reloaded).
    cpu_before, total_before = {}, None
    with tba.configure_tensor_cache(model, offloader=offloader, offload_devices=(args.device,),
                                    min_offload_bytes=0, adaptive=adaptive, verify=args.verify,
                                    max_inflight_bytes=int(args.max_inflight_mib * 2**20)) as cache:
        for step in range(args.steps):
            if step == args.warmup:
                cpu_before, total_before = tba_threads_cpu_s(), cache.stats(cumulative=True)
            if args.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            model(x).backward()
            if args.device == "cuda":
                torch.cuda.synchronize()
                peaks.append(torch.cuda.max_memory_allocated() - base)
            times.append(time.perf_counter() - start)
        stats = cache.stats()
        tail = cache.boundary.tail_start
        cpu_after, total_after = tba_threads_cpu_s(), cache.stats(cumulative=True)
    moved = (total_after.offloaded_bytes + total_after.reloaded_bytes) - (
        total_before.offloaded_bytes + total_before.reloaded_bytes if total_before else 0)
    threads_cpu = sum(v - cpu_before.get(k, 0.0) for k, v in cpu_after.items())
    io_cpu = getattr(total_after, "io_cpu_s", None)
    if io_cpu is not None and total_before is not None:
        io_cpu -= total_before.io_cpu_s
    warm = times[args.warmup:]
    return {
        "mode": mode,
        "median_step_s": statistics.median(warm),
        "peak_resident_bytes": stats.peak_resident_bytes,
        "cuda_peak_bytes": statistics.median(peaks[args.warmup:]) if peaks else None,
        "kept_bytes": stats.kept_bytes,
        "offloaded_bytes": stats.offloaded_bytes,
        "stall_s": stats.stall_s,
        "offloaded_blocks": 0 if mode == "keep" else tail,
        "moved_bytes": moved,
        "threads_cpu_s_per_gb": threads_cpu / (moved / 1e9) if moved else None,
        "io_cpu_s_per_gb": io_cpu / (moved / 1e9) if moved and io_cpu is not None else None,
    }


def _per_gb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--offloader", default="host", choices=["host", "ssd"])
    p.add_argument("--verify", default="checksum", choices=["checksum", "none"], help="ssd: verified reloads")
    p.add_argument("--write-mib-s", type=float, default=400.0, help="0: unthrottled")
    p.add_argument("--max-inflight-mib", type=float, default=8.0,
                   help="max_inflight_bytes: how far stores may fall behind before forward waits")
    p.add_argument("--read-mib-s", type=float, default=2000.0)
    p.add_argument("--out", default="adaptive_offload.json")
    p.add_argument("--table", action="store_true",
                   help="run the GPT-2 table workload instead (options below)")
    import _adaptive_long
    import _adaptive_table

    _adaptive_table.add_arguments(p)
    _adaptive_long.add_arguments(p)
    args = p.parse_args(argv)
    if args.table and args.long:
        p.error("--table and --long are two different runs: choose one")
    if args.table:
        return _adaptive_table.main(args)
    if args.long:
        return _adaptive_long.main(args)
    env = describe(args.device)
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    rows = [run(args, mode) for mode in ("keep", "fixed", "adaptive")]
    keep = rows[0]
    for row in rows:
        print(f"{row['mode']:>8}: step {row['median_step_s'] * 1e3:8.1f} ms "
              f"({row['median_step_s'] / keep['median_step_s']:.2f}x keep)  peak resident "
              f"{row['peak_resident_bytes'] / 2**20:7.1f} MiB "
              f"({row['peak_resident_bytes'] / max(keep['peak_resident_bytes'], 1):.2f}x keep)  "
              f"offloaded blocks {row['offloaded_blocks']}/{args.blocks}  stall {row['stall_s'] * 1e3:.1f} ms"
              + (f"  I/O CPU {_per_gb(row['io_cpu_s_per_gb'])} (tba threads "
                 f"{_per_gb(row['threads_cpu_s_per_gb'])}) per GB moved" if row["moved_bytes"] else "")
              + (f"  cuda peak {row['cuda_peak_bytes'] / 2**20:.0f} MiB "
                 f"({row['cuda_peak_bytes'] / max(keep['cuda_peak_bytes'], 1):.2f}x keep)"
                 if row["cuda_peak_bytes"] is not None else ""))
    result = {"environment": env, "args": vars(args), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
