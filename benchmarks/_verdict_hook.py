"""Malloc hook probe of the GPU verdict: train a few steps with the host offloader and report
the hook's status after warm-up and at the end, PyTorch's reserved bytes, the registration
shortfall check, and the median step time. Run once under the preload and once without:

    env $(python -m tba.malloc_hook --env) python benchmarks/_verdict_hook.py --out hook_on.json
    python benchmarks/_verdict_hook.py --out hook_off.json

Without CUDA it writes ``{"skipped": reason}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

import tba
from _environment import describe
from adaptive_offload import Model
from tba import malloc_hook


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="hook.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        result: dict = {"skipped": "no CUDA device"}
    else:
        env = describe("cuda")
        torch.manual_seed(0)
        model = Model(args.blocks, args.width).cuda()
        x = torch.randn(args.batch, args.width, device="cuda")
        times, after_warmup = [], None
        with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cuda",), min_offload_bytes=0):
            for step in range(args.steps):
                if step == args.warmup:
                    after_warmup = dataclasses.asdict(malloc_hook.status())
                model.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                start = time.perf_counter()
                model(x).backward()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        status = malloc_hook.status()
        reserved = int(torch.cuda.memory_reserved())
        result = {
            "environment": env, "args": vars(args), "steps": args.steps, "warmup": args.warmup,
            "median_step_s": statistics.median(times[args.warmup:]),
            "status_after_warmup": after_warmup, "status": dataclasses.asdict(status),
            "reserved_bytes": reserved,
            "shortfall": malloc_hook.registration_shortfall(status, reserved),
        }
        print(json.dumps({k: result[k] for k in ("median_step_s", "reserved_bytes", "shortfall")}))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
