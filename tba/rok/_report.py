"""Tables, summary and plot of the ROK curve (private module of :mod:`tba.rok`)."""

from __future__ import annotations

import csv
import statistics
import textwrap
from pathlib import Path
from typing import Any

CSV_COLUMNS = [
    "strategy", "batch_size", "status", "activation_peak_bytes", "step_time_s", "model_flops_per_s",
    "tokens_per_s", "cache_peak_resident_bytes", "cache_offloaded_bytes", "cache_kept_bytes",
    "cache_reloaded_bytes", "cache_stall_s", "cache_write_bytes_per_s", "cache_read_bytes_per_s",
    "activation_peak_step_delta_bytes", "baseline_bytes", "plan_activation_bytes", "model_flops_per_step",
    "peak_method",
]
_COLORS = {"keep": "tab:blue", "recompute": "tab:red", "offload-host": "tab:orange", "offload-ssd": "tab:green",
           "recompute+offload": "tab:purple"}


def _mib(num_bytes: float | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 2**20:.1f} MiB"


def _flops(value: float, cuda: bool) -> str:
    return f"{value / 1e12:.1f} TFLOP/s" if cuda else f"{value / 1e9:.2f} GFLOP/s"


def environment_header(env: dict[str, Any], config: dict[str, Any]) -> str:
    m = config["model"]
    dev = f"cuda ({env.get('gpu')}, {env.get('gpu_memory_bytes', 0) / 2**30:.0f} GiB)" if env["device"] == "cuda" \
        else (f"cpu ({env.get('cpu')}, {env.get('num_cpus')} cores), torch threads per worker "
              f"{config.get('num_threads') or env.get('torch_num_threads')}")
    lines = [
        "== ROK curve ==",
        f"device       {dev}",
        f"versions     python {env['python']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"tba {env['tba']}" + (f" (git {env['git_commit']})" if env.get("git_commit") else ""),
        f"platform     {env['platform']}",
        f"model        GPT-2: {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, seq {m['seq_len']}, "
        f"vocab {m['vocab']}, {config['dtype']}, attention {m.get('attn_implementation', 'eager')}",
        f"sweep        strategies {', '.join(config['strategies'])}; batches {config['batch_sizes']}; "
        f"{config['warmup_steps']} warm-up + {config['steps']} measured steps per point",
        f"tba          min_offload_bytes {config['min_offload_bytes']}, keep_last_modules "
        f"{config['keep_last_modules']}, adaptive {config['adaptive']}, ssd dir {config['ssd_dir'] or 'default'}",
        f"command      {env['command']}",
    ]
    return "\n".join(lines)


def point_line(row: dict[str, Any], cuda: bool) -> str:
    head = f"{row['strategy']:<18} b={row['batch_size']:<4}"
    if row.get("status") != "ok":
        return f"{head} {row.get('status')}"
    cache = row.get("cache_peak_resident_bytes")
    return (f"{head} peak {_mib(row['activation_peak_bytes']):>11}"
            + (f" (cache {_mib(cache)})" if cache is not None else "")
            + f"  step {row['step_time_s']:.3f} s  {_flops(row['model_flops_per_s'], cuda)}")


def _ok(rows: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in rows:
        if r.get("status") == "ok":
            out.setdefault(r["strategy"], {})[r["batch_size"]] = r
    return out


def summarize(rows: list[dict[str, Any]], budget_bytes: int | None) -> dict[str, Any]:
    """Relative peak/throughput vs keep at equal batch, and the largest batch within a budget."""
    ok = _ok(rows)
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    unavailable = {s: next(r["status"] for r in rows if r["strategy"] == s) for s in strategies if s not in ok}
    shared = sorted(set.intersection(*(set(v) for v in ok.values()))) if ok else []
    keep = ok.get("keep", {})
    relative: dict[str, dict[str, dict[str, float]]] = {}
    for s, points in ok.items():
        for b, r in points.items():
            if b in keep:
                relative.setdefault(s, {})[str(b)] = {
                    "peak_vs_keep": r["activation_peak_bytes"] / keep[b]["activation_peak_bytes"]
                    if keep[b]["activation_peak_bytes"] > 0 else float("nan"),
                    "throughput_vs_keep": r["model_flops_per_s"] / keep[b]["model_flops_per_s"],
                }
    budget_source = "--budget-bytes"
    if budget_bytes is None and keep:
        b_med = statistics.median_low(sorted(keep))
        budget_bytes, budget_source = keep[b_med]["activation_peak_bytes"], f"keep's peak at its median batch {b_med}"
    fits: dict[str, dict[str, Any]] = {}
    if budget_bytes is not None:
        for s, points in ok.items():
            within = [b for b, r in points.items() if r["activation_peak_bytes"] <= budget_bytes]
            best = max(within) if within else None
            fits[s] = {"largest_batch": best,
                       "model_flops_per_s": points[best]["model_flops_per_s"] if best else None}
    largest_shared = shared[-1] if shared else None
    return {"shared_batches": shared, "largest_shared_batch": largest_shared, "relative_to_keep": relative,
            "budget_bytes": budget_bytes, "budget_source": budget_source if budget_bytes is not None else None,
            "largest_batch_within_budget": fits, "unavailable": unavailable}


def format_summary(summary: dict[str, Any], rows: list[dict[str, Any]], cuda: bool) -> str:
    ok = _ok(rows)
    lines = ["", "== summary =="]
    rel = summary["relative_to_keep"]
    batches = sorted({b for pts in ok.values() for b in pts})
    if "keep" in ok:
        lines.append("activation peak and model throughput relative to keep at equal batch (peak / throughput):")
        lines.append(f"  {'strategy':<18}" + "".join(f"{'b=' + str(b):>16}" for b in batches))
        for s in ok:
            cells = []
            for b in batches:
                r = rel.get(s, {}).get(str(b))
                cells.append(f"{r['peak_vs_keep']:>7.0%} / {r['throughput_vs_keep']:<6.0%}" if r else f"{'-':>16}")
            lines.append(f"  {s:<18}" + "".join(f"{c:>16}" for c in cells))
    else:
        lines.append("keep did not run: no relative numbers")
    lines.append("absolute (peak, model throughput):")
    for s, pts in ok.items():
        lines.append(f"  {s:<18}" + "; ".join(f"b={b}: {_mib(r['activation_peak_bytes'])}, "
                                              f"{_flops(r['model_flops_per_s'], cuda)}" for b, r in sorted(pts.items())))
    if summary["budget_bytes"] is not None:
        lines.append(f"largest batch within a budget of {_mib(summary['budget_bytes'])} ({summary['budget_source']}):")
        for s, f in summary["largest_batch_within_budget"].items():
            lines.append(f"  {s:<18} " + (f"b={f['largest_batch']} at {_flops(f['model_flops_per_s'], cuda)}"
                                          if f["largest_batch"] else "none of the batches run"))
    for s, why in summary["unavailable"].items():
        lines.append(f"  {s:<18} {why}")
    b = summary["largest_shared_batch"]
    if b is not None and "keep" in ok:
        lines.append(f"at the largest batch all strategies share (b={b}):")
        for s in ok:
            if s != "keep":
                r = rel[s][str(b)]
                lines.append(f"  {s:<18} peak {r['peak_vs_keep']:.0%} of keep, throughput {r['throughput_vs_keep']:.0%}")
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in CSV_COLUMNS})


def plot(path: Path, rows: list[dict[str, Any]], summary: dict[str, Any], env: dict[str, Any],
         config: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cuda = env["device"] == "cuda"
    scale, unit = (1e12, "TFLOP/s") if cuda else (1e9, "GFLOP/s")
    ok = _ok(rows)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 6.2), gridspec_kw={"width_ratios": [3, 2]})
    for s in dict.fromkeys(r["strategy"] for r in rows):
        color = _COLORS.get(s)
        pts = sorted(ok.get(s, {}).items())
        if not pts:
            why = summary["unavailable"].get(s, "no points")
            ax.plot([], [], "x", color=color, label=f"{s}: {why[:60]}")
            continue
        x = [r["activation_peak_bytes"] / 2**20 for _, r in pts]
        y = [r["model_flops_per_s"] / scale for _, r in pts]
        ax.plot(x, y, "o-", color=color, label=s, lw=2, ms=6)
        for (b, _), xi, yi in zip(pts, x, y):
            ax.annotate(f"b={b}", (xi, yi), textcoords="offset points", xytext=(4, 5), fontsize=7, color=color)
        bs = [b for b, _ in pts]
        ax2.plot(bs, x, "o-", color=color, label=f"{s} (measured peak)")
        cache = [r.get("cache_peak_resident_bytes") for _, r in pts]
        if all(c is not None for c in cache):
            ax2.plot(bs, [c / 2**20 for c in cache], "s--", color=color, alpha=0.6, mfc="none",
                     label=f"{s} (cache-resident)")
    if summary.get("budget_bytes"):
        ax.axvline(summary["budget_bytes"] / 2**20, color="gray", ls=":", lw=1)
        ax.text(summary["budget_bytes"] / 2**20, ax.get_ylim()[0], " budget", color="gray", fontsize=8,
                va="bottom")
    peak_what = "max_memory_allocated - baseline" if cuda else "RSS high-water - baseline"
    ax.set_xlabel(f"activation peak, MiB ({peak_what})")
    ax.set_ylabel(f"model throughput, {unit} (recompute not counted)")
    ax.set_title("ROK curve: each point is one run; batch size grows along a curve", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("micro-batch size")
    ax2.set_ylabel("activation peak, MiB")
    ax2.set_title("peak vs batch: measured (solid) and cache-resident activations (dashed)", fontsize=9)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7, loc="upper left")
    m = config["model"]
    device = f"{env.get('gpu')} (CUDA {env.get('cuda')})" if cuda else f"CPU: {env.get('cpu')} x{env.get('num_cpus')}"
    fig.suptitle(f"ROK curve, GPT-2 {m['layers']}L h{m['hidden']} s{m['seq_len']} V{m['vocab']} {config['dtype']}"
                 f" on {device}", fontsize=12)
    foot = (f"torch {env['torch']}, tba {env['tba']}" + (f" ({env['git_commit']})" if env.get("git_commit") else "")
            + f", transformers {env['transformers']}, python {env['python']}; median of {config['steps']} steps "
              f"after {config['warmup_steps']} warm-up"
            + (f"; torch threads {config['num_threads']}" if config.get("num_threads") else "")
            + f"; command: {env['command']}")
    fig.text(0.01, 0.01, "\n".join(textwrap.wrap(foot, 170)), fontsize=7, va="bottom", family="monospace")
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)
