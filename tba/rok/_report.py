"""Header, progress lines, summary text and CSV files of the ROK curve (private module of :mod:`tba.rok`)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from tba.rok._summary import SPREAD_METRICS

__all__ = ["CSV_COLUMNS", "SAMPLE_COLUMNS", "device_caption", "environment_header", "format_summary",
           "passes_text", "sample_line", "write_csv"]

_SPREAD_COLUMNS = [f"{k}{x}" for k in SPREAD_METRICS for x in ("", "_mean", "_min", "_max", "_spread")]
# docs/rok.md describes every column.
CSV_COLUMNS = [
    "strategy", "batch_size", "status", "num_samples", "num_failed", "num_skipped", *_SPREAD_COLUMNS, "activation_peak_source",
    "counted_activation_peak_bytes", "counted_activation_peak_source", "counted_vs_allocator", "allocator_source",
    "meter_saved_bytes", "meter_recomputed_bytes", "meter_reloaded_bytes", "num_saved_storages",
    "cache_peak_resident_bytes", "cache_offloaded_bytes", "cache_kept_bytes", "cache_reloaded_bytes",
    "cache_num_family_entries", "cache_stall_s", "cache_write_bytes_per_s", "cache_read_bytes_per_s", "cache_io_cpu_s",
    "activation_budget_bytes", "budget_met", "decision_tail_start", "decision_num_blocks", "warmup_steps_run",
    "process_rss_step_delta_bytes", "process_rss_after_setup_bytes", "process_rss_method",
    "cuda_max_allocated_delta_bytes", "cuda_max_reserved_delta_bytes", "plan_activation_bytes",
    "model_flops_per_step", "load_avg_1min",
]
SAMPLE_COLUMNS = [
    "repeat", "strategy", "batch_size", "status", "activation_peak_bytes", "counted_activation_peak_bytes",
    "step_time_s", "model_flops_per_s",
    "tokens_per_s", "process_rss_peak_bytes", "cuda_max_allocated_delta_bytes", "cuda_max_reserved_delta_bytes",
    "cache_peak_resident_bytes", "cache_offloaded_bytes", "cache_stall_s", "cache_io_cpu_s",
    "activation_budget_bytes", "budget_met", "decision_tail_start", "warmup_steps_run", "load_avg_1min", "started_s",
    "worker_wall_s", "worker_cpu_s",
]


def device_caption(cuda: bool) -> str:
    """What "the training device" means for the activation peak, in one line."""
    if cuda:
        return ("training device = the GPU: the activation peak is the allocator's (max_memory_allocated in a step "
                "minus memory_allocated after set-up: activations and the step's temporaries), for every strategy; "
                "tba's own accounting beside it")
    return ("training device = host memory on CPU: the activation peak counts saved activations the training process "
            "holds at the step's peak, not those tba moved to its host pool or SSD")


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
                     f"activation peak at the same batch, offloader {offloader!r}")
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
    rss = row.get("process_rss_peak_bytes")
    return (f"{head} activations {_mib(row['activation_peak_bytes']):>11}"
            + (f" (accounting {_mib(row.get('counted_activation_peak_bytes'))})"
               if row.get("activation_peak_source") == "allocator" else "")
            + (f" (RSS {_mib(rss)})" if rss is not None else "")
            + f"  step {row['step_time_s']:.3f} s  {_flops(row['model_flops_per_s'], cuda)}")


def passes_text(num_run: int, num_planned: int) -> str:
    """The passes the numbers come from: those that ran, not those planned (a time budget or
    a signal stops a sweep between passes).

    Example:
        >>> passes_text(3, 3), passes_text(1, 3)
        ('3 interleaved passes', '1 pass of 3 planned (the others not run)')
    """
    ran = f"{num_run} interleaved passes" if num_run > 1 else "1 pass"
    return ran if num_run >= num_planned else f"{ran} of {num_planned} planned (the others not run)"


def _not_run(p: dict[str, Any]) -> str:
    """A point's samples that failed and that were not run, e.g. " (2 not run: time budget of
    138 s spent)"."""
    out = f" ({p['num_failed']} failed)" if p["num_failed"] else ""
    if p.get("num_skipped"):
        why = str(p.get("skipped_status", "")).removeprefix("skipped: ")
        out += f" ({p['num_skipped']} not run: {why})"
    return out


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


def _largest_batch(summary: dict[str, Any]) -> list[str]:
    largest = summary["largest_batch"]
    if not largest["strategies"]:
        return []
    columns = [("activations/keep", "peak_vs_keep"), ("activations/recompute", "peak_vs_recompute"),
               ("throughput/keep", "throughput_vs_keep"), ("throughput/recompute", "throughput_vs_recompute")]
    cells = {s: [_ratio(comps.get(key)) for _, key in columns] for s, comps in largest["strategies"].items()}
    width = max([len(c) for row in cells.values() for c in row] + [len(t) for t, _ in columns]) + 2
    lines = [f"at the largest batch (b={largest['batch_size']}): activation peak and model throughput over keep's "
             f"and over recompute's",
             f"  {'strategy':<18}" + "".join(f"{title:>{width}}" for title, _ in columns)]
    lines += [f"  {s:<18}" + "".join(f"{c:>{width}}" for c in row) for s, row in cells.items()]
    return lines


def format_summary(summary: dict[str, Any], points: list[dict[str, Any]], config: dict[str, Any],
                   cuda: bool) -> str:
    ok = [p for p in points if p["status"] == "ok"]
    batches = sorted({p["batch_size"] for p in ok})
    passes = passes_text(summary["num_passes_run"], config["repeats"])
    lines = ["", "== summary ==", device_caption(cuda),
             f"{passes}; a ratio is per pass (strategy over keep, same pass), shown as median "
             f"(min..max); '?' = the spread makes the comparison meaningless (warnings below)"]
    if summary.get("headline"):
        lines.append(f"headline, {summary['headline']}")
    lines += _largest_batch(summary)
    eb = summary["equal_batch"]
    if any(p["strategy"] == "keep" for p in ok):
        lines += _table("overhead at equal batch: step time / keep's step time",
                        batches, {s: {int(b): _ratio(c["step_time_vs_keep"]) for b, c in v.items()}
                                  for s, v in eb.items()})
        lines += _table("activation peak / keep's at equal batch",
                        batches, {s: {int(b): _ratio(c["peak_vs_keep"], percent=True) for b, c in v.items()}
                                  for s, v in eb.items()})
        above = summary.get("above_keep", [])
        lines.append("above keep's activation peak: " + ("none" if not above else f"{len(above)}, why:"))
        lines += [f"  {line}" for line in above]
        if any(p.get("process_rss_peak_bytes") is not None for p in ok):
            lines += _table("process RSS peak / keep's at equal batch (secondary: the whole process's memory growth "
                            "in a step" + (": on CPU also the host pool, the SSD's staging buffers and the step's "
                                           "temporaries" if not cuda else "") + ")",
                            batches, {s: {int(b): _ratio(c["rss_vs_keep"], percent=True) for b, c in v.items()}
                                      for s, v in eb.items() if "rss_vs_keep" in next(iter(v.values()))})
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
        rss = p.get("process_rss_peak_bytes")
        lines.append(f"  {p['strategy']:<18} b={p['batch_size']:<4} n={p['num_samples']}" + _not_run(p)
                     + f"  activations {_mib(p['activation_peak_bytes'])} ({p['activation_peak_bytes_min'] / 2**20:.1f}.."
                       f"{p['activation_peak_bytes_max'] / 2**20:.1f})"
                     + (f"  accounting {_mib(p.get('counted_activation_peak_bytes'))} "
                        f"({p.get('counted_activation_peak_source')}, {p['counted_vs_allocator']:.2f}x)"
                        if "counted_vs_allocator" in p else "")
                     + (f"  RSS {_mib(rss)}" if rss is not None else "")
                     + f"  step {p['step_time_s'] * 1e3:.0f} ms ({p['step_time_s_min'] * 1e3:.0f}.."
                       f"{p['step_time_s_max'] * 1e3:.0f})"
                     + (f"  budget {_mib(p['activation_budget_bytes'])} "
                        f"({'met' if p.get('budget_met') else 'not met in every sample'})"
                        if "activation_budget_bytes" in p else "")
                     + (f"  policy offloads {p['decision_tail_start']} of {p.get('decision_num_blocks', '?')} blocks"
                        if "decision_tail_start" in p else ""))
    lines += _accounting_lines(summary)
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


def _accounting_lines(summary: dict[str, Any]) -> list[str]:
    """Where the activation axis is the allocator's: the points whose accounting differs from it
    by more than the tolerance (Note [The allocator is the activation axis on CUDA])."""
    if summary.get("activation_source") != "allocator":
        return []
    tolerance = summary["accounting_tolerance"]
    gaps = summary["accounting_gaps"]
    if not gaps:
        return [f"allocator vs tba's accounting: within {tolerance:.0%} at every point"]
    return [f"WARNING allocator vs tba's accounting differ by more than {tolerance:.0%} at {len(gaps)} points "
            f"(the step's temporaries, or memory tba's books miss: the allocator's figure is the one to believe):",
            *(f"  {gap}" for gap in gaps)]


def write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in columns})
