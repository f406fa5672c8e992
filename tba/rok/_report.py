"""Header, progress lines, summary text and CSV files of the ROK curve (private module of :mod:`tba.rok`)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from tba.rok._summary import SPREAD_METRICS

__all__ = ["CSV_COLUMNS", "SAMPLE_COLUMNS", "environment_header", "format_summary", "sample_line", "write_csv"]

_SPREAD_COLUMNS = [f"{k}{x}" for k in SPREAD_METRICS for x in ("", "_mean", "_min", "_max", "_spread")]
CSV_COLUMNS = [
    "strategy", "batch_size", "status", "num_samples", "num_failed", *_SPREAD_COLUMNS,
    "cache_peak_resident_bytes", "cache_offloaded_bytes", "cache_kept_bytes", "cache_reloaded_bytes",
    "cache_stall_s", "cache_write_bytes_per_s", "cache_read_bytes_per_s", "cache_io_cpu_s", "activation_budget_bytes",
    "budget_met", "decision_tail_start", "decision_num_blocks", "warmup_steps_run", "activation_peak_step_delta_bytes",
    "baseline_bytes", "plan_activation_bytes", "model_flops_per_step", "load_avg_1min", "peak_method",
]
SAMPLE_COLUMNS = [
    "repeat", "strategy", "batch_size", "status", "activation_peak_bytes", "step_time_s", "model_flops_per_s",
    "tokens_per_s", "cache_peak_resident_bytes", "cache_offloaded_bytes", "cache_stall_s", "cache_io_cpu_s",
    "activation_budget_bytes", "budget_met", "decision_tail_start", "warmup_steps_run", "load_avg_1min", "started_s",
    "worker_wall_s", "worker_cpu_s",
]


def _mib(num_bytes: float | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 2**20:.1f} MiB"


def _flops(value: float, cuda: bool) -> str:
    return f"{value / 1e12:.2f} TFLOP/s" if cuda else f"{value / 1e9:.2f} GFLOP/s"


def strategy_notes(config: dict[str, Any]) -> list[str]:
    """What the adaptive and budget strategies are in this run (offloader, budget)."""
    notes = []
    offloader = config.get("policy_offloader")
    if "adaptive" in config["strategies"]:
        notes.append(f"adaptive = tba's default policy (adaptive=True, default options) with offloader "
                     f"{offloader!r}")
    if "budget" in config["strategies"]:
        notes.append(f"budget = activation_budget_bytes set to {config['budget_fraction']:.0%} of keep's "
                     f"cache-resident peak at the same batch, offloader {offloader!r}")
    return notes


def environment_header(env: dict[str, Any], config: dict[str, Any]) -> str:
    m = config["model"]
    dev = f"cuda ({env.get('gpu')}, {env.get('gpu_memory_bytes', 0) / 2**30:.0f} GiB)" if env["device"] == "cuda" \
        else (f"cpu ({env.get('cpu')}, {env.get('num_cpus')} cores), torch threads per worker "
              f"{config.get('num_threads') or env.get('torch_num_threads')}")
    load = env.get("load_avg_start")
    lines = [
        "== ROK curve ==",
        f"device       {dev}" + (f"; load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}" if load else ""),
        f"versions     python {env['python']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"tba {env['tba']}" + (f" (git {env['git_commit']})" if env.get("git_commit") else ""),
        f"platform     {env['platform']}",
        f"model        GPT-2: {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, seq {m['seq_len']}, "
        f"vocab {m['vocab']}, {config['dtype']}, attention {m.get('attn_implementation', 'eager')}",
        f"sweep        strategies {', '.join(config['strategies'])}; batches {config['batch_sizes']}; "
        f"{config['repeats']} interleaved passes, each point {config['warmup_steps']} warm-up + {config['steps']} "
        f"measured steps in a fresh process",
        f"tba          min_offload_bytes {config['min_offload_bytes']}, keep_last_modules "
        f"{config['keep_last_modules']}, adaptive {config['adaptive']} (offload-*), ssd dir "
        f"{config['ssd_dir'] or 'default'}",
        *(f"strategy     {n}" for n in strategy_notes(config)),
        f"command      {env['command']}",
    ]
    return "\n".join(lines)


def sample_line(row: dict[str, Any], cuda: bool) -> str:
    """One line per finished sample (the progress output)."""
    head = f"pass {row['repeat'] + 1} {row['strategy']:<18} b={row['batch_size']:<4}"
    if row.get("status") != "ok":
        return f"{head} {row.get('status')}"
    cache = row.get("cache_peak_resident_bytes")
    return (f"{head} peak {_mib(row['activation_peak_bytes']):>11}"
            + (f" (cache {_mib(cache)})" if cache is not None else "")
            + f"  step {row['step_time_s']:.3f} s  {_flops(row['model_flops_per_s'], cuda)}")


def _ratio(c: dict[str, Any] | None, percent: bool = False) -> str:
    if not c or not c["ratio"]:
        return "-"
    r = c["ratio"]
    flag = " ?" if c["warning"] else "  "
    if percent:
        return f"{r['median']:.0%} ({r['min']:.0%}..{r['max']:.0%}){flag}"
    return f"{r['median']:.2f}x ({r['min']:.2f}..{r['max']:.2f}){flag}"


def _table(title: str, batches: list[int], cells: dict[str, dict[int, str]]) -> list[str]:
    width = max([len(c) for row in cells.values() for c in row.values()] + [8]) + 2
    lines = [title, f"  {'strategy':<18}" + "".join(f"{'b=' + str(b):>{width}}" for b in batches)]
    for s, row in cells.items():
        lines.append(f"  {s:<18}" + "".join(f"{row.get(b, '-'):>{width}}" for b in batches))
    return lines


def format_summary(summary: dict[str, Any], points: list[dict[str, Any]], config: dict[str, Any],
                   cuda: bool) -> str:
    ok = [p for p in points if p["status"] == "ok"]
    batches = sorted({p["batch_size"] for p in ok})
    passes = config["repeats"]
    lines = ["", "== summary ==",
             f"{passes} interleaved passes; a ratio is per pass (strategy over keep, same pass), shown as median "
             f"(min..max); '?' = the spread makes the comparison meaningless (warnings below)"]
    eb = summary["equal_batch"]
    if any(p["strategy"] == "keep" for p in ok):
        lines += _table("overhead at equal batch: step time / keep's step time",
                        batches, {s: {int(b): _ratio(c["step_time_vs_keep"]) for b, c in v.items()}
                                  for s, v in eb.items()})
        lines += _table("activation peak / keep's at equal batch",
                        batches, {s: {int(b): _ratio(c["peak_vs_keep"], percent=True) for b, c in v.items()}
                                  for s, v in eb.items()})
    else:
        lines.append("keep did not run: no relative numbers")
    if summary["budget_bytes"] is not None:
        lines.append(f"throughput at equal activation budget: largest batch whose peak stays within "
                     f"{_mib(summary['budget_bytes'])} ({summary['budget_source']}) in every sample:")
        for s, f in summary["equal_budget"].items():
            if f["largest_batch"] is None:
                lines.append(f"  {s:<18} none of the batches run")
                continue
            t = f["model_flops_per_s"]
            rel = f.get("throughput_vs_keep")
            lines.append(f"  {s:<18} b={f['largest_batch']:<4} {_flops(t['median'], cuda)} "
                         f"({_flops(t['min'], cuda).split()[0]}..{_flops(t['max'], cuda).split()[0]})"
                         + (f"  {_ratio(rel)} keep's at b={summary['keep_batch_within_budget']}" if rel else ""))
    for s, why in summary["unavailable"].items():
        lines.append(f"  {s:<18} {why}")
    lines.append("points: median (min..max) over the samples that ran")
    for p in ok:
        lines.append(f"  {p['strategy']:<18} b={p['batch_size']:<4} n={p['num_samples']}"
                     + (f" ({p['num_failed']} failed)" if p["num_failed"] else "")
                     + f"  peak {_mib(p['activation_peak_bytes'])} ({p['activation_peak_bytes_min'] / 2**20:.1f}.."
                       f"{p['activation_peak_bytes_max'] / 2**20:.1f})"
                     + f"  step {p['step_time_s'] * 1e3:.0f} ms ({p['step_time_s_min'] * 1e3:.0f}.."
                       f"{p['step_time_s_max'] * 1e3:.0f})"
                     + (f"  budget {_mib(p['activation_budget_bytes'])} "
                        f"({'met' if p.get('budget_met') else 'not met in every sample'}: cache peak "
                        f"{_mib(p.get('cache_peak_resident_bytes'))})" if "activation_budget_bytes" in p else "")
                     + (f"  policy offloads {p['decision_tail_start']} of {p.get('decision_num_blocks', '?')} blocks"
                        if "decision_tail_start" in p else ""))
    warnings = summary["warnings"]
    if warnings:
        single = [w for w in warnings if "one sample" in w]
        lines.append(f"warnings ({len(warnings)}): comparisons the spread makes meaningless")
        if single and len(single) == len(warnings):
            lines.append("  every comparison rests on one sample per point: no spread, nothing can be told from "
                         "noise (run with --repeats >= 2)")
        else:
            lines += [f"  {w}" for w in warnings]
    else:
        lines.append("warnings: none (every comparison's spread is smaller than its difference, or within "
                     f"{summary['noise_floor']:.0%})")
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in columns})
