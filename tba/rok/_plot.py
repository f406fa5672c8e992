"""The figure of the ROK curve (private module of :mod:`tba.rok`).

``plot_series`` turns points and summary into the numbers drawn (so tests can check them
without reading pixels); ``plot`` draws them: the curve (activation peak on the training
device against model throughput) with error bars on both axes, the overhead at equal batch
with its per-pass range, and the secondary memory measure (process RSS on CPU, PyTorch's
allocated-memory peak on CUDA) against batch size.

Where the activation axis is the allocator's (CUDA: Note [The allocator is the activation axis on
CUDA] in ``_allocator``), the secondary panel is tba's own accounting instead, and points whose
accounting differs from the allocator's by more than 10% are ringed in red and listed under the
main panel.

Points that coincide (a policy that kept every block measures keep's activations, at about
keep's throughput) are said so in the legend, and their batch labels go below the point, not
on top of the other strategy's label. The main panel's title names the passes that ran.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from tba.rok._allocator import TOLERANCE, accounting_gap

__all__ = ["plot", "plot_series"]

_COLORS = {"keep": "tab:blue", "recompute": "tab:red", "offload-host": "tab:orange", "offload-ssd": "tab:green",
           "recompute+offload": "tab:purple", "adaptive": "tab:brown", "budget": "tab:olive"}


def _err(median: list[float], lo: list[float], hi: list[float]) -> list[list[float]]:
    """matplotlib's asymmetric error: distances below and above the median."""
    return [[m - a for m, a in zip(median, lo)], [b - m for m, b in zip(median, hi)]]


# A point within these of an earlier strategy's point at the same batch is drawn on it: its
# label would cover the other's.
_SAME_X, _SAME_Y = 0.01, 0.10


def _on_points(curve: dict[str, dict[str, Any]]) -> None:
    """Per point, the earlier strategy whose point at the same batch it lies on (or None), and
    the legend entry saying so (with the batches where a policy kept every block)."""
    drawn: dict[int, list[tuple[str, float, float]]] = {}  # batch -> points drawn before
    for s, c in curve.items():
        at = list(zip(c["batch_sizes"], c["x"], c["y"]))
        c["on"] = [next((t for t, x0, y0 in drawn.get(b, []) if _near((x, y), (x0, y0))), None) for b, x, y in at]
        for b, x, y in at:
            drawn.setdefault(b, []).append((s, x, y))
        notes = []
        if c["kept_every_block"]:
            notes.append("kept every block at b=" + ", ".join(map(str, c["kept_every_block"])))
        for other in dict.fromkeys(t for t in c["on"] if t is not None):
            batches = [b for b, t in zip(c["batch_sizes"], c["on"]) if t == other]
            notes.append(f"on {other}'s points at b=" + ", ".join(map(str, batches)))
        c["legend"] = f"{s} ({'; '.join(notes)})" if notes else s


def _near(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return abs(a[0] - b[0]) <= _SAME_X * abs(b[0]) and abs(a[1] - b[1]) <= _SAME_Y * abs(b[1])


def plot_series(points: list[dict[str, Any]], summary: dict[str, Any], cuda: bool,
                planned_passes: int | None = None) -> dict[str, Any]:
    """The plotted numbers: medians and (min, max) error bars per strategy, in MiB and FLOP/s
    units; per point the strategy it lies on (``on``), per strategy its legend entry, and the
    main panel's title (the passes that ran, of ``planned_passes``)."""
    from tba.rok._report import passes_text

    scale = 1e12 if cuda else 1e9
    curve: dict[str, dict[str, Any]] = {}
    allocator = summary.get("activation_source") == "allocator"
    secondary_key = ("counted_activation_peak_bytes" if allocator else
                     "cuda_max_allocated_delta_bytes" if cuda else "process_rss_peak_bytes")
    secondary: dict[str, dict[str, Any]] = {}
    for p in sorted((p for p in points if p["status"] == "ok"), key=lambda p: p["batch_size"]):
        c = curve.setdefault(p["strategy"], {"batch_sizes": [], "n": [], "x": [], "x_min": [], "x_max": [], "y": [],
                                             "y_min": [], "y_max": [], "kept_every_block": [], "gaps": []})
        c["batch_sizes"].append(p["batch_size"])
        c["gaps"].append(accounting_gap(p, summary.get("accounting_tolerance", TOLERANCE)) is not None)
        if p.get("decision_tail_start") == 0:  # a policy's decision: no block offloaded
            c["kept_every_block"].append(p["batch_size"])
        c["n"].append(p["num_samples"])
        for axis, key, unit in (("x", "activation_peak_bytes", 2**20), ("y", "model_flops_per_s", scale)):
            for suffix in ("", "_min", "_max"):
                c[axis + suffix].append(p[key + suffix] / unit)
        if p.get(secondary_key) is not None:
            k = secondary.setdefault(p["strategy"], {"batch_sizes": [], "y": []})
            k["batch_sizes"].append(p["batch_size"])
            k["y"].append(p[secondary_key] / 2**20)
    for c in curve.values():
        c["xerr"], c["yerr"] = _err(c["x"], c["x_min"], c["x_max"]), _err(c["y"], c["y_min"], c["y_max"])
    curve = {s: curve[s] for s in dict.fromkeys(p["strategy"] for p in points) if s in curve}  # drawing order
    _on_points(curve)
    run = summary["num_passes_run"]
    title = "batch size grows along each line; " + (
        f"median of {passes_text(run, planned_passes or run)}, bars = min..max" if run > 1
        else f"{passes_text(run, planned_passes or run)}: no spread")
    overhead: dict[str, dict[str, Any]] = {}
    for s, by_b in summary["equal_batch"].items():
        o = overhead.setdefault(s, {"batch_sizes": [], "y": [], "y_min": [], "y_max": [], "meaningless": []})
        for b, comp in sorted(by_b.items(), key=lambda kv: int(kv[0])):
            r = comp["step_time_vs_keep"]["ratio"]
            if r is None:
                continue
            o["batch_sizes"].append(int(b))
            o["y"].append(r["median"])
            o["y_min"].append(r["min"])
            o["y_max"].append(r["max"])
            o["meaningless"].append(comp["step_time_vs_keep"]["warning"] is not None)
        o["yerr"] = _err(o["y"], o["y_min"], o["y_max"])
    gaps = summary.get("accounting_gaps", [])
    warning = (f"WARNING (red rings): allocator and tba's accounting differ by more than "
               f"{summary['accounting_tolerance']:.0%} at " + "; ".join(gaps)) if gaps else None
    return {"curve": curve, "overhead": overhead, "secondary": secondary, "secondary_key": secondary_key,
            "throughput_unit": "TFLOP/s" if cuda else "GFLOP/s", "title": title, "allocator": allocator,
            "accounting_warning": warning}


def plot(path: Path, points: list[dict[str, Any]], summary: dict[str, Any], env: dict[str, Any],
         config: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """Draw the figure into ``path``; returns :func:`plot_series`'s numbers (also saved in the JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from tba.rok._report import device_caption

    cuda = env["device"] == "cuda"
    series = plot_series(points, summary, cuda, config["repeats"])
    fig, (ax, ax_o, ax_p) = plt.subplots(1, 3, figsize=(18, 7), gridspec_kw={"width_ratios": [5, 3, 3]})
    for s in dict.fromkeys(p["strategy"] for p in points):
        color = _COLORS.get(s)
        c = series["curve"].get(s)
        if c is None:
            why = summary["unavailable"].get(s, "no points")
            ax.plot([], [], "x", color=color, label=f"{s}: {why[:60]}")
            continue
        ax.errorbar(c["x"], c["y"], xerr=c["xerr"], yerr=c["yerr"], fmt="o-", color=color, label=c["legend"], lw=2,
                    ms=5, capsize=3, elinewidth=1)
        ringed = [(xi, yi) for xi, yi, gap in zip(c["x"], c["y"], c["gaps"]) if gap]
        if ringed:
            ax.plot(*zip(*ringed), "o", ms=14, mfc="none", mec="red", mew=1.5)
        for b, xi, yi, on in zip(c["batch_sizes"], c["x"], c["y"], c["on"]):
            ax.annotate(f"b={b}", (xi, yi), textcoords="offset points", xytext=(4, -11 if on else 5), fontsize=7,
                        color=color)
        o = series["overhead"].get(s)
        if o and o["y"]:
            ax_o.errorbar(o["batch_sizes"], o["y"], yerr=o["yerr"], fmt="-", color=color, capsize=3, lw=1.5, label=s)
            for b, y, bad in zip(o["batch_sizes"], o["y"], o["meaningless"]):
                ax_o.plot([b], [y], "o", color=color, mfc="none" if bad else color, ms=6)
        k = series["secondary"].get(s)
        if k:
            ax_p.plot(k["batch_sizes"], k["y"], "o-", color=color, label=s)
    if summary.get("budget_bytes"):
        ax.axvline(summary["budget_bytes"] / 2**20, color="gray", ls=":", lw=1)
        ax.text(summary["budget_bytes"] / 2**20, ax.get_ylim()[0], " equal-budget line of the summary", color="gray",
                fontsize=8, va="bottom")
    # Batch sizes double along a line: a log axis spaces every strategy's points alike.
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("activation peak from the allocator, MiB, log scale (left is better)\n(max_memory_allocated in "
                  "a step - after set-up)" if series["allocator"] else
                  "activation peak on the training device, MiB, log scale (left is better)")
    ax.set_ylabel(f"model throughput, {series['throughput_unit']} (recompute not counted; up is better)")
    ax.set_title(series["title"], fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax_o.axhline(1.0, color="tab:blue", lw=1)
    batches = sorted({p["batch_size"] for p in points})
    for a in (ax_o, ax_p):
        a.set_xscale("log", base=2)
        a.set_xticks(batches, [str(b) for b in batches])
        a.set_xlabel("micro-batch size")
        a.grid(alpha=0.3)
    ax_o.set_ylabel("step time / keep's (same pass)")
    ax_o.set_title("overhead at equal batch: median, bars = min..max over passes;\nhollow = spread makes the "
                   "comparison meaningless", fontsize=9)
    if series["allocator"]:
        ax_p.set_ylabel("tba's accounting of saved activations, MiB")
        ax_p.set_title("secondary: tba's accounting\n(cache peak resident; meter: keep, recompute)",
                       fontsize=9)
    elif cuda:
        ax_p.set_ylabel("max_memory_allocated in a step - after set-up, MiB")
        ax_p.set_title("secondary: PyTorch's allocated GPU memory peak\n(activations and the step's temporaries)",
                       fontsize=9)
    else:
        ax_p.set_ylabel("process RSS peak in a step - RSS after set-up, MiB")
        ax_p.set_title("secondary: process RSS peak (also the host pool,\nSSD staging buffers, the step's "
                       "temporaries)", fontsize=9)
    ax_p.set_ylim(bottom=0)
    ax_p.legend(fontsize=7, loc="upper left")
    m = config["model"]
    device = f"{env.get('gpu')} (CUDA {env.get('cuda')})" if cuda else f"CPU: {env.get('cpu')} x{env.get('num_cpus')}"
    fig.suptitle(f"ROK curve, GPT-2 {m['layers']}L h{m['hidden']} s{m['seq_len']} V{m['vocab']} {config['dtype']}"
                 f" on {device}", fontsize=12)
    load = env.get("load_avg_start")
    foot = (f"torch {env['torch']}, tba {env['tba']}" + (f" ({env['git_commit']})" if env.get("git_commit") else "")
            + f", transformers {env['transformers']}, python {env['python']}; each sample: median of "
              f"{config['steps']} steps after {config['warmup_steps']} warm-up in a fresh process"
            + (f"; torch threads {config['num_threads']}" if config.get("num_threads") else "")
            + (f"; load average at start {load[0]:.2f}" if load else "")
            + "; " + "; ".join(notes) + f"; command: {env['command']}")
    fig.text(0.01, 0.01, "\n".join(textwrap.wrap(foot, 220)), fontsize=7, va="bottom", family="monospace")
    warning = series["accounting_warning"]
    bottom = 0.17 if warning else 0.12  # room for the warning between the caption and the footer
    fig.tight_layout(rect=(0, bottom, 1, 0.95))
    # The caption under the main panel: what "the training device" is in this run.
    fig.text(ax.get_position().x0, bottom - 0.02, device_caption(cuda), fontsize=8.5, va="top", style="italic")
    if warning:
        fig.text(ax.get_position().x0, bottom - 0.05, "\n".join(textwrap.wrap(warning, 200)),
                 fontsize=8, va="top", color="red")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return series
