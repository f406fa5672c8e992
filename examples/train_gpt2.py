"""Train a small GPT-2 (transformers config, no download) with and without tba.

Prints per-step loss, step time and tba's per-step stats, then checks that both runs produced
identical losses.

    python examples/train_gpt2.py                       # CPU, host offloader, 5 steps
    python examples/train_gpt2.py --offloader ssd       # SSD offloader (temp dir)
    python examples/train_gpt2.py --device cuda --layers 12 --hidden 768 --batch 8 --seq 1024
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import tba


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--offloader", default="host", choices=["host", "ssd", "none"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden,
                        n_layer=args.layers, n_head=args.heads, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(args.seed)
    return GPT2LMHeadModel(config).to(args.device)


def train(model: torch.nn.Module, args: argparse.Namespace, cache: tba.TensorCache | None) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    label = "tba " + args.offloader if cache is not None else "no tba"
    losses = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(args.seed + step)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)
        torch.manual_seed(args.seed + step)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        losses.append(loss.item())
        line = f"[{label}] step {step}: loss {loss.item():.6f}  time {elapsed * 1e3:8.1f} ms"
        if cache is not None:
            s = cache.stats()
            line += (
                f"  offloaded {s.offloaded_bytes / 2**20:7.1f} MiB  reloaded {s.reloaded_bytes / 2**20:7.1f} MiB"
                f"  kept {s.kept_bytes / 2**20:6.1f} MiB  forwarded {s.num_forwarded:4d}"
                f"  dedup {s.num_deduplicated:4d}  peak resident {s.peak_resident_bytes / 2**20:7.1f} MiB"
                f"  stall {s.stall_s * 1e3:6.1f} ms"
            )
        print(line, flush=True)
    return losses


def main() -> None:
    args = parse_args()
    print(f"torch {torch.__version__}, tba {tba.__version__}, device {args.device}")
    reference = build(args)
    model = copy.deepcopy(reference)
    baseline = train(reference, args, None)
    devices = (args.device,)
    with tba.configure_tensor_cache(model, offloader=args.offloader, offload_devices=devices) as cache:
        offloaded = train(model, args, cache)
        total = cache.stats(cumulative=True)
    print(
        f"tba totals over {total.num_steps} steps: offloaded {total.offloaded_bytes / 2**20:.1f} MiB at "
        f"{total.write_bytes_per_s / 2**30:.2f} GiB/s, reloaded {total.reloaded_bytes / 2**20:.1f} MiB at "
        f"{total.read_bytes_per_s / 2**30:.2f} GiB/s, stall {total.stall_s * 1e3:.1f} ms"
    )
    same = baseline == offloaded
    print("losses identical with and without tba:", "yes" if same else "NO")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
