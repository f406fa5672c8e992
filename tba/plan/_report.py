"""Table and JSON rendering of a :class:`tba.plan.PlanReport` (private module)."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

from tba.plan._estimate import PlanReport

__all__ = ["format_report", "report_to_json"]


def _size(num_bytes: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def _rate(bytes_per_s: float | None) -> str:
    return "unknown" if bytes_per_s is None else f"{bytes_per_s / 1e9:.2f} GB/s"


def _lifetime(years: float) -> str:
    if math.isinf(years):
        return "unbounded"
    if years >= 0.1:
        return f"{years:.2f} years"
    if years * 365 >= 1:
        return f"{years * 365:.1f} days"
    return f"{years * 365 * 24:.1f} hours"


def _model_line(r: PlanReport) -> str:
    s = r.shape
    heads = f"{s.num_heads} heads x {s.head_dim}"
    if s.arch == "llama" and s.num_kv_heads != s.num_heads:
        heads += f" ({s.num_kv_heads} kv heads)"
    return (f"{s.arch}: {s.num_layers} layers"
            + (f" + {s.num_decoder_layers} decoder layers (seq {s.decoder_seq_len})" if s.arch == "t5" else "")
            + f", hidden {s.hidden_size}, {heads}, ffn {s.ffn_size}, seq {s.seq_len}, vocab {s.vocab_size}, "
              f"{s.activation}, ~{s.num_parameters / 1e6:,.0f}M params")


def format_report(report: PlanReport, *, show_terms: bool = True, target_label: str | None = None) -> str:
    """A readable table of ``report`` (what ``tba plan`` prints).

    ``target_label`` names where the offload target came from (the command line passes
    ``--drive NAME`` or ``--pcie-gen N``); it is printed in the verdict.
    """
    r, acc = report, report.accounting
    lines = [f"Model      {_model_line(r)}",
             f"Batch      micro-batch {r.batch_size} ({r.batch_size * r.shape.seq_len:,} tokens)",
             f"Counting   activations {acc.dtype_bytes} B/elem" + (" (autocast over fp32 weights)" if acc.autocast else "")
             + f", dropout {'on' if acc.dropout else 'off'}"
             + (f" (masks {acc.dropout_mask_bytes} B/elem)" if acc.dropout else "")
             + f", {acc.attention} attention, norm stats {'yes' if acc.norm_stats else 'no'}, "
               f"embeddings/head/loss {'yes' if acc.include_head else 'no'}; distinct storages, no parameters"]
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
    lines.append(f"Written per step          {_size(r.write_bytes_per_step)} (offload fraction {r.offload_fraction:g}, "
                 f"offloader {r.offloader})")
    lines.append(f"Required write bandwidth  {_rate(r.required_write_bytes_per_s)} "
                 f"(written bytes / ({r.write_window_fraction:g} x step time))")
    label = f" [{target_label}]" if target_label else ""
    if r.available_write_bytes_per_s is not None:
        verdict = "enough" if r.bandwidth_ok else "NOT enough: transfers would stall the step"
        lines.append(f"Available write bandwidth {_rate(r.available_write_bytes_per_s)} "
                     f"({r.bandwidth_source}){label}: {verdict}")
    else:
        lines.append(f"Available write bandwidth unknown ({r.bandwidth_source}){label}: no verdict")
    if r.drive is not None and r.drive.sustained_write_bytes_per_s is not None:
        other = "burst" if r.drive_write == "sustained" else "sustained"
        lines.append(f"  {r.drive.name}: sustained {_rate(r.drive.sustained_write_bytes_per_s)}, burst "
                     f"{_rate(r.drive.burst_write_bytes_per_s)} per drive; using {r.drive_write} "
                     f"(--drive-write {other} for the other)")
    if r.offloader == "host":
        lines.append(f"Host memory               {_size(r.write_bytes_per_step)} pinned per micro-batch in flight")
    if r.lifetime_years is not None and r.drive is not None:
        lines.append(f"SSD lifetime              {_lifetime(r.lifetime_years)} on {r.num_drives} x {r.drive.name} "
                     f"({r.drive.endurance_bytes / 1e15:g} PBW each), write amplification {r.write_amplification:g}, "
                     f"duty cycle {r.duty_cycle:g}")
    return "\n".join(lines)


def report_to_json(r: PlanReport) -> dict[str, Any]:
    """``report`` as plain JSON values (``tba plan --json``)."""
    out = dataclasses.asdict(r)
    out["terms"] = [dict(dataclasses.asdict(t), total_bytes=t.total_bytes) for t in r.terms]
    out["bandwidth_ok"] = r.bandwidth_ok
    if r.drive is not None:
        out["drive"]["endurance_bytes"] = r.drive.endurance_bytes
    if r.lifetime_years is not None and math.isinf(r.lifetime_years):
        out["lifetime_years"] = None
    return out
