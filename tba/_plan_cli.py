"""Command line and table rendering of :mod:`tba.plan` (private helper)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections import defaultdict

from tba import plan as P

_DTYPES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def _size(num_bytes: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s"


def format_report(r: P.PlanReport, *, show_terms: bool = True) -> str:
    s, acc = r.shape, r.accounting
    lines = []
    desc = (f"{s.arch}: {s.num_layers} layers" + (f" + {s.num_decoder_layers} decoder layers (seq {s.decoder_seq_len})"
                                                   if s.arch == "t5" else "")
            + f", hidden {s.hidden_size}, {s.num_heads} heads x {s.head_dim}, ffn {s.ffn_size}, seq {s.seq_len}, "
            f"vocab {s.vocab_size}, {s.activation}, ~{s.num_parameters / 1e6:,.0f}M params")
    lines.append(f"Model      {desc}")
    lines.append(f"Batch      micro-batch {r.batch_size} ({r.batch_size * s.seq_len:,} tokens)")
    lines.append(f"Counting   activations {acc.dtype_bytes} B/elem, dropout {'on' if acc.dropout else 'off'}"
                 + (f" (masks {acc.dropout_mask_bytes} B/elem)" if acc.dropout else "")
                 + f", {acc.attention} attention, norm stats {'yes' if acc.norm_stats else 'no'}, "
                 f"embeddings/head/loss {'yes' if acc.include_head else 'no'}; distinct storages, no parameters")
    if show_terms:
        lines.append("")
        lines.append(f"  {'saved tensor':<38} {'formula':<16} {'each':>12} {'x':>4} {'total':>12} {'share':>6}")
        for t in r.terms:
            lines.append(f"  {t.name:<38} {t.formula:<16} {_size(t.bytes_each):>12} {t.count:>4} "
                         f"{_size(t.total_bytes):>12} {100 * t.total_bytes / r.activation_bytes:>5.1f}%")
        by_scope: dict[str, int] = defaultdict(int)
        for t in r.terms:
            by_scope[t.name.split(".")[0]] += t.total_bytes
        lines.append("  " + ", ".join(f"{k}: {_size(v)}" for k, v in by_scope.items()))
    lines.append("")
    lines.append(f"Activations per step      {_size(r.activation_bytes)} ({r.activation_bytes:,} B)")
    if r.korthikanti_bytes is not None:
        lines.append(f"  Korthikanti 34sbh+5as^2b  {_size(r.korthikanti_bytes)} (fp16, layers only, for comparison)")
    lines.append(f"Model FLOPs per step      {r.model_flops:.3e} (3 x forward matmuls, recompute excluded)")
    lines.append(f"Step time                 {r.step_time_s:.3f} s ({r.step_time_source})")
    lines.append(f"Written per step          {_size(r.write_bytes_per_step)} (offload fraction {r.offload_fraction:g})")
    lines.append(f"Required write bandwidth  {_rate(r.required_write_bytes_per_s)} "
                 f"(written bytes / ({r.write_window_fraction:g} x step time))")
    if r.available_write_bytes_per_s is not None:
        verdict = "enough" if r.bandwidth_ok else "NOT enough: transfers would stall the step"
        lines.append(f"Drive write bandwidth     {_rate(r.available_write_bytes_per_s)} "
                     f"({r.num_drives} drive(s)): {verdict}")
    if r.drive is not None:
        years = r.lifetime_years
        if math.isinf(years):
            life = "unbounded"
        elif years >= 0.1:
            life = f"{years:.2f} years"
        elif years * 365 >= 1:
            life = f"{years * 365:.1f} days"
        else:
            life = f"{years * 365 * 24:.1f} hours"

        lines.append(f"SSD lifetime              {life} on {r.num_drives} x {r.drive.name} "
                     f"({r.drive.endurance_bytes / 1e15:g} PBW each), write amplification {r.write_amplification:g}, "
                     f"duty cycle {r.duty_cycle:g}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tba.plan",
        description="Activation bytes, write bandwidth and SSD lifetime of activation offloading for a "
                    "GPT/BERT/T5 configuration.",
        epilog="Example: python -m tba.plan --model gpt3-13b --batch-size 4 --gpu h100 --drive "
               "optane-p5800x-1.6tb --num-ssds 4")
    p.add_argument("--model", default="gpt3-13b", choices=sorted(P.PRESETS), help="shape preset (default gpt3-13b)")
    p.add_argument("--list-presets", action="store_true", help="print model, drive and GPU presets and exit")
    g = p.add_argument_group("shape overrides")
    g.add_argument("--arch", choices=["gpt", "bert", "t5"])
    for flag, dest in (("--layers", "num_layers"), ("--hidden", "hidden_size"), ("--heads", "num_heads"),
                       ("--head-dim", "head_dim"), ("--ffn", "ffn_size"), ("--seq-len", "seq_len"),
                       ("--vocab", "vocab_size"), ("--decoder-layers", "num_decoder_layers"),
                       ("--decoder-seq-len", "decoder_seq_len")):
        g.add_argument(flag, dest=dest, type=int)
    g.add_argument("--activation", choices=["gelu", "gelu_unfused", "relu"])
    p.add_argument("-b", "--batch-size", type=int, default=1, help="micro-batch size (default 1)")
    a = p.add_argument_group("what is counted")
    a.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="activation dtype (default bf16)")
    a.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=True)
    a.add_argument("--mask-bytes", type=int, default=None,
                   help="bytes per dropout-mask element (default 1, i.e. CUDA's bool mask; CPU: the dtype's)")
    a.add_argument("--softmax-bytes", type=int, default=None, help="bytes per saved softmax element (default dtype)")
    a.add_argument("--attention", choices=["eager", "flash"], default="eager")
    a.add_argument("--no-head", action="store_true", help="count transformer layers only")
    a.add_argument("--korthikanti", action="store_true",
                   help="count exactly as Korthikanti et al. (fp16, 1-byte masks, no stats, layers only)")
    t = p.add_argument_group("step time (give one)")
    t.add_argument("--step-time-s", type=float, help="measured step time")
    t.add_argument("--gpu", choices=sorted(P.GPU_PEAK_FLOPS), default="h100", help="peak FLOP/s preset (default h100)")
    t.add_argument("--peak-tflops", type=float, help="peak dense TFLOP/s, overrides --gpu")
    t.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation (default 0.4)")
    d = p.add_argument_group("SSD")
    d.add_argument("--drive", choices=sorted(P.DRIVES), default="samsung-990pro-2tb")
    d.add_argument("--pbw", type=float, help="custom drive: petabytes written rating")
    d.add_argument("--dwpd", type=float, help="custom drive: drive writes per day")
    d.add_argument("--capacity-tb", type=float, help="custom drive: capacity in TB (1e12 B)")
    d.add_argument("--warranty-years", type=float, default=5.0, help="custom drive: warranty (default 5)")
    d.add_argument("--drive-write-gbps", type=float, help="sequential write GB/s per drive")
    d.add_argument("--num-ssds", type=int, default=1, help="drives striped together (default 1)")
    d.add_argument("--waf", type=float, default=1.0, help="write amplification factor (default 1)")
    d.add_argument("--duty-cycle", type=float, default=1.0, help="fraction of time training (default 1)")
    d.add_argument("--offload-fraction", type=float, default=1.0, help="share of activations written (default 1)")
    d.add_argument("--write-window", type=float, default=0.5, help="share of the step writes may take (default 0.5)")
    p.add_argument("--brief", action="store_true", help="totals only, no per-tensor table")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _build(args: argparse.Namespace) -> P.PlanReport:
    base = P.PRESETS[args.model]
    overrides = {k: getattr(args, k) for k in ("arch", "num_layers", "hidden_size", "num_heads", "head_dim",
                                               "ffn_size", "seq_len", "vocab_size", "num_decoder_layers",
                                               "decoder_seq_len", "activation") if getattr(args, k) is not None}
    if "hidden_size" in overrides or "num_heads" in overrides:
        overrides.setdefault("head_dim", None)
        overrides.setdefault("ffn_size", None)
    if overrides.get("arch", base.arch) != "t5":
        overrides.update(num_decoder_layers=None, decoder_seq_len=None)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields.update(overrides)
    if fields["arch"] != base.arch and "activation" not in overrides:
        fields["activation"] = None
    shape = P.ModelShape(**fields)
    if args.korthikanti:
        acc = P.Accounting.korthikanti()
    else:
        dtype_bytes = _DTYPES[args.dtype]
        acc = P.Accounting(dtype_bytes=dtype_bytes, dropout=args.dropout,
                           dropout_mask_bytes=1 if args.mask_bytes is None else args.mask_bytes,
                           softmax_bytes=args.softmax_bytes, attention=args.attention, include_head=not args.no_head)
    if args.pbw or args.dwpd:
        if not args.capacity_tb and args.dwpd:
            raise ValueError("--dwpd needs --capacity-tb")
        drive = P.Drive(name="custom drive", capacity_bytes=int((args.capacity_tb or 1) * 1e12), pbw=args.pbw,
                        dwpd=None if args.pbw else args.dwpd, warranty_years=args.warranty_years)
    else:
        drive = P.DRIVES[args.drive]
    peak = args.peak_tflops * 1e12 if args.peak_tflops else P.GPU_PEAK_FLOPS[args.gpu]
    return P.plan(shape, args.batch_size, accounting=acc, step_time_s=args.step_time_s, peak_flops=peak, mfu=args.mfu,
                  drive=drive, num_drives=args.num_ssds, write_amplification=args.waf, duty_cycle=args.duty_cycle,
                  offload_fraction=args.offload_fraction, write_window_fraction=args.write_window,
                  drive_write_bytes_per_s=args.drive_write_gbps * 1e9 if args.drive_write_gbps else None)


def _to_json(r: P.PlanReport) -> dict:
    out = dataclasses.asdict(r)
    out["terms"] = [dict(dataclasses.asdict(t), total_bytes=t.total_bytes) for t in r.terms]
    out["bandwidth_ok"] = r.bandwidth_ok
    if r.drive is not None:
        out["drive"]["endurance_bytes"] = r.drive.endurance_bytes
    if r.lifetime_years is not None and math.isinf(r.lifetime_years):
        out["lifetime_years"] = None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list_presets:
        for name, shape in P.PRESETS.items():
            print(f"model {name:<14} {shape}")
        for name, drive in P.DRIVES.items():
            print(f"drive {name:<24} {drive.name}: {drive.endurance_bytes / 1e15:g} PBW")
        for name, flops in P.GPU_PEAK_FLOPS.items():
            print(f"gpu   {name:<6} {flops / 1e12:g} TFLOP/s dense fp16/bf16")
        return 0
    try:
        report = _build(args)
    except ValueError as e:
        parser.error(str(e))
    if args.json:
        json.dump(_to_json(report), sys.stdout, indent=2)
        print()
    else:
        print(format_report(report, show_terms=not args.brief))
    return 0
