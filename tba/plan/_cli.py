"""Command line of :mod:`tba.plan`: ``tba plan`` and ``python -m tba.plan`` (private module)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from tba.plan._estimate import PlanReport, plan
from tba.plan._hardware import DRIVES, GPU_PEAK_FLOPS, HOST_LINKS, Drive, HostLink, measure_host_link
from tba.plan._presets import PRESETS
from tba.plan._report import format_report, report_to_json
from tba.plan._types import Accounting, ModelShape

__all__ = ["main"]

_DTYPES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
_DEFAULT_MODEL = "llama3-8b"
_DEFAULT_DRIVE = "samsung-990pro-2tb"
_PCIE = {"3": "pcie3", "4": "pcie4", "5": "pcie5"}


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Activation bytes, write bandwidth and SSD lifetime of activation offloading for a "
                    "GPT/BERT/T5/Llama-style configuration.",
        epilog=f"Example: {prog} --model llama3-70b --batch-size 1 --gpu h100 --drive optane-p5800x-1.6tb "
               "--num-ssds 4. Method and options: docs/rok.md.")
    p.add_argument("--model", default=_DEFAULT_MODEL, choices=sorted(PRESETS),
                   help=f"shape preset (default {_DEFAULT_MODEL}); --list-presets shows them")
    p.add_argument("--list-presets", action="store_true", help="print model, drive, host-link and GPU presets and exit")
    g = p.add_argument_group("shape overrides")
    g.add_argument("--arch", choices=["gpt", "bert", "t5", "llama"])
    for flag, dest in (("--layers", "num_layers"), ("--hidden", "hidden_size"), ("--heads", "num_heads"),
                       ("--head-dim", "head_dim"), ("--ffn", "ffn_size"), ("--seq-len", "seq_len"),
                       ("--vocab", "vocab_size"), ("--decoder-layers", "num_decoder_layers"),
                       ("--decoder-seq-len", "decoder_seq_len")):
        g.add_argument(flag, dest=dest, type=int)
    g.add_argument("--kv-heads", dest="num_kv_heads", type=int,
                   help="llama: key/value heads of grouped-query attention (default: the preset's; --heads alone "
                        "resets it to multi-head)")
    g.add_argument("--activation", choices=["gelu", "gelu_unfused", "relu", "swiglu"])
    p.add_argument("-b", "--batch-size", type=int, default=1, help="micro-batch size (default 1)")
    a = p.add_argument_group("what is counted (defaults: today's LLM recipe)")
    a.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16",
                   help="activation dtype (default bf16: mixed precision with bf16 activations; norm statistics, "
                        "attention log-sum-exp/softmax and the loss stay fp32)")
    a.add_argument("--autocast", action="store_true",
                   help="fp32 weights under torch.autocast to --dtype (HF Trainer's bf16=True) instead of bf16 "
                        "weights: fp32 residual stream and norms, a cast copy of each projection's input and of "
                        "every weight is saved (llama, flash attention)")
    a.add_argument("--attention", choices=["flash", "eager"], default="flash",
                   help="flash: SDPA/flash kernel, no s^2 term (default); eager: materialised scores")
    a.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=False,
                   help="dropout on (masks are saved with eager attention; default off)")
    a.add_argument("--mask-bytes", type=int, default=None,
                   help="bytes per dropout-mask element (default 1, i.e. CUDA's bool mask; CPU: the dtype's)")
    a.add_argument("--softmax-bytes", type=int, default=None,
                   help="bytes per saved eager softmax element (default: the dtype's; 4 for llama)")
    a.add_argument("--norm", choices=["fused", "unfused"], default="fused",
                   help="fused norm kernel (input + rstd; default) or op by op as HF's RMSNorm (fp32 input copy, "
                        "normalised tensor, rstd)")
    a.add_argument("--no-head", action="store_true", help="count transformer layers only")
    a.add_argument("--korthikanti", action="store_true",
                   help="count exactly as Korthikanti et al. (fp16, eager, 1-byte masks, no stats, layers only)")
    t = p.add_argument_group("step time (give one)")
    t.add_argument("--step-time-s", type=float, help="measured step time")
    t.add_argument("--gpu", choices=sorted(GPU_PEAK_FLOPS), default="h100", help="peak FLOP/s preset (default h100)")
    t.add_argument("--peak-tflops", type=float, help="peak dense TFLOP/s, overrides --gpu")
    t.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation (default 0.4)")
    o = p.add_argument_group("offload target")
    o.add_argument("--offloader", choices=["ssd", "host"], default="ssd",
                   help="ssd: NVMe drives (default); host: pinned host memory through the host link")
    o.add_argument("--pcie-gen", choices=sorted(_PCIE), help="host link: PCIe generation of the GPU's x16 link")
    o.add_argument("--host-link-gbps", type=float, help="host link: device-to-host GB/s per GPU")
    o.add_argument("--measure-host-link", action="store_true", help="host link: measure it on this CUDA device")
    o.add_argument("--write-window", type=float, default=0.5, help="share of the step writes may take (default 0.5)")
    o.add_argument("--offload-fraction", type=float, default=1.0, help="share of activations written (default 1)")
    d = p.add_argument_group("SSD")
    d.add_argument("--drive", choices=sorted(DRIVES), help=f"drive preset (default {_DEFAULT_DRIVE}; printed in the "
                                                           "verdict)")
    d.add_argument("--drive-write", choices=["sustained", "burst"], default="sustained",
                   help="which write speed of the drive counts (default sustained: after its SLC cache fills)")
    d.add_argument("--pbw", type=float, help="custom drive: petabytes written rating")
    d.add_argument("--dwpd", type=float, help="custom drive: drive writes per day")
    d.add_argument("--capacity-tb", type=float, help="custom drive: capacity in TB (1e12 B)")
    d.add_argument("--warranty-years", type=float, default=5.0, help="custom drive: warranty (default 5)")
    d.add_argument("--drive-write-gbps", type=float, help="write GB/s per drive (overrides the drive's figure)")
    d.add_argument("--num-ssds", type=int, default=1, help="drives striped together (default 1)")
    d.add_argument("--waf", type=float, default=1.0, help="write amplification factor (default 1)")
    d.add_argument("--duty-cycle", type=float, default=1.0, help="fraction of time training (default 1)")
    p.add_argument("--brief", action="store_true", help="totals only, no per-tensor table")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _shape(args: argparse.Namespace) -> ModelShape:
    base = PRESETS[args.model]
    names = ("arch", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_size", "seq_len",
             "vocab_size", "num_decoder_layers", "decoder_seq_len", "activation")
    overrides = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if "hidden_size" in overrides or "num_heads" in overrides:
        overrides.setdefault("head_dim", None)
        overrides.setdefault("ffn_size", None)
    arch = overrides.get("arch", base.arch)
    if arch != "t5":
        overrides.update(num_decoder_layers=None, decoder_seq_len=None)
    if arch != "llama":
        overrides["num_kv_heads"] = None
    elif "num_heads" in overrides:
        overrides.setdefault("num_kv_heads", None)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields.update(overrides)
    if arch != base.arch:  # the preset's activation and ffn width belong to its arch
        for name in ("activation", "ffn_size"):
            if name not in overrides:
                fields[name] = None
    return ModelShape(**fields)


def _accounting(args: argparse.Namespace) -> Accounting:
    if args.korthikanti:
        return Accounting.korthikanti()
    return Accounting(dtype_bytes=_DTYPES[args.dtype], dropout=args.dropout,
                      dropout_mask_bytes=1 if args.mask_bytes is None else args.mask_bytes,
                      softmax_bytes=args.softmax_bytes, attention=args.attention, fused_norm=args.norm == "fused",
                      include_head=not args.no_head, autocast=args.autocast)


def _drive(args: argparse.Namespace) -> tuple[Drive, str]:
    if args.pbw or args.dwpd:
        if args.drive:
            raise ValueError("give --drive or a custom drive (--pbw/--dwpd), not both")
        if args.dwpd and not args.capacity_tb:
            raise ValueError("--dwpd needs --capacity-tb")
        drive = Drive(name="custom drive", capacity_bytes=int((args.capacity_tb or 1) * 1e12), pbw=args.pbw,
                      dwpd=None if args.pbw else args.dwpd, warranty_years=args.warranty_years)
        return drive, "custom drive: " + (f"--pbw {args.pbw:g}" if args.pbw else f"--dwpd {args.dwpd:g}")
    name = args.drive or _DEFAULT_DRIVE
    return DRIVES[name], f"--drive {name}" + ("" if args.drive else " (default)")


def _host_link(args: argparse.Namespace) -> tuple[HostLink | None, str | None]:
    given = [flag for flag, v in (("--pcie-gen", args.pcie_gen), ("--host-link-gbps", args.host_link_gbps),
                                  ("--measure-host-link", args.measure_host_link)) if v]
    if len(given) > 1:
        raise ValueError(f"give one of --pcie-gen, --host-link-gbps, --measure-host-link, not {', '.join(given)}")
    if args.pcie_gen:
        return HOST_LINKS[_PCIE[args.pcie_gen]], f"--pcie-gen {args.pcie_gen}"
    if args.host_link_gbps:
        return HostLink(name=f"{args.host_link_gbps:g} GB/s", bytes_per_s=args.host_link_gbps * 1e9), \
            f"--host-link-gbps {args.host_link_gbps:g}"
    if args.measure_host_link:
        return measure_host_link(), "--measure-host-link"
    if args.offloader == "host":
        raise ValueError("--offloader host needs the host link: --pcie-gen 3|4|5, --host-link-gbps GBPS "
                         "or --measure-host-link")
    return None, None


def _build(args: argparse.Namespace) -> tuple[PlanReport, str | None]:
    shape, acc = _shape(args), _accounting(args)
    link, link_label = _host_link(args)
    drive, drive_label = _drive(args)
    if args.offloader == "host":
        if args.drive or args.pbw or args.dwpd:
            raise ValueError("--offloader host writes no SSD: drop --drive/--pbw/--dwpd")
        label = link_label
    else:
        label = drive_label + (f", {link_label}" if link_label else "")
    peak = args.peak_tflops * 1e12 if args.peak_tflops else GPU_PEAK_FLOPS[args.gpu]
    report = plan(shape, args.batch_size, accounting=acc, step_time_s=args.step_time_s, peak_flops=peak, mfu=args.mfu,
                  offloader=args.offloader, drive=drive, drive_write=args.drive_write, num_drives=args.num_ssds,
                  host_link=link, write_amplification=args.waf, duty_cycle=args.duty_cycle,
                  offload_fraction=args.offload_fraction, write_window_fraction=args.write_window,
                  drive_write_bytes_per_s=args.drive_write_gbps * 1e9 if args.drive_write_gbps else None)
    return report, label


def _gbps(bytes_per_s: float | None) -> str:
    return "unknown" if bytes_per_s is None else f"{bytes_per_s / 1e9:g}"


def _list_presets() -> None:
    for name, shape in PRESETS.items():
        print(f"model {name:<14} {shape}")
    for name, drive in DRIVES.items():
        print(f"drive {name:<24} {drive.name}: {drive.endurance_bytes / 1e15:g} PBW, write "
              f"{_gbps(drive.sustained_write_bytes_per_s)} GB/s sustained, {_gbps(drive.burst_write_bytes_per_s)} "
              "GB/s burst")
    for name, link in HOST_LINKS.items():
        print(f"host  {name:<6} {link.name}: {link.bytes_per_s / 1e9:g} GB/s device-to-host")
    for name, flops in GPU_PEAK_FLOPS.items():
        print(f"gpu   {name:<6} {flops / 1e12:g} TFLOP/s dense fp16/bf16")


def main(argv: list[str] | None = None, *, prog: str = "python -m tba.plan") -> int:
    """Command-line entry point (``tba plan --help``); returns the exit status."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if args.list_presets:
        _list_presets()
        return 0
    try:
        report, label = _build(args)
    except (ValueError, RuntimeError) as e:
        parser.error(str(e))
    if args.json:
        json.dump(dict(report_to_json(report), target=label), sys.stdout, indent=2)
        print()
    else:
        print(format_report(report, show_terms=not args.brief, target_label=label))
    return 0
