"""The timeline of ``adaptive_offload.py --long``: one pair of panels per run.

Upper panel: time of each tba step over its plain twin's (dots), per window (steps) and the
running total (line), against the budget (``max_step_overhead``, 1.05) and the acceptance
line (1.06); shaded where the injected noise was on. Lower panel: blocks offloaded at each
step (0: a keep step, nothing offloaded), the offloaded fraction per window (bars, right
axis), and the loop's decisions as markers at the boundary concerned: profile (grey line), a
boundary passing (green triangle) or failing (red triangle) its check, settling (green dot),
steady steps found over the keep baseline (orange dot), a re-check from a new profile
(purple dot).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot"]

_EVENTS = {  # kind: (colour, marker, legend)
    "pass": ("tab:green", "^", "passes check"),
    "fail": ("tab:red", "v", "fails check"),
    "settle": ("tab:green", "o", "settles"),
    "suspect": ("tab:orange", "o", "over keep baseline"),
    "recheck": ("tab:purple", "o", "re-check"),
}


def plot(results: list[dict], env: dict, window: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2 * len(results), 1, figsize=(12, 4.2 * len(results)), sharex=True,
                             gridspec_kw={"height_ratios": [3, 2] * len(results)}, squeeze=False)
    for index, result in enumerate(results):
        _panels(result, window, axes[2 * index][0], axes[2 * index + 1][0])
    axes[-1][0].set_xlabel("step")
    fig.suptitle(f"tba closed loop, long run: {env['device']}, torch {env['torch']}, tba {env['tba']}\n"
                 f"{env['command']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _panels(result: dict, window: int, top, bottom) -> None:
    steps = result["steps"]
    x = list(range(1, len(steps) + 1))
    ratios = [r["tba_s"] / r["plain_s"] for r in steps]
    running, plain_sum, tba_sum = [], 0.0, 0.0
    for r in steps:
        plain_sum, tba_sum = plain_sum + r["plain_s"], tba_sum + r["tba_s"]
        running.append(tba_sum / plain_sum)
    for n, r in enumerate(steps, start=1):
        if r["noise_on"] > 0.3:
            top.axvspan(n - 0.5, n + 0.5, color="tab:orange", alpha=0.12 * min(1.0, r["noise_on"] * 1.5), lw=0)
    top.plot(x, ratios, ".", color="0.5", ms=4, label="tba step / plain step")
    wx, wy = [], []
    for first in range(0, len(steps), window):
        chunk = steps[first:first + window]
        ratio = sum(r["tba_s"] for r in chunk) / sum(r["plain_s"] for r in chunk)
        wx += [first + 0.5, first + len(chunk) + 0.5]
        wy += [ratio, ratio]
    top.plot(wx, wy, color="tab:blue", lw=2, label=f"per {window} steps")
    top.plot(x, running, color="black", lw=1.2, label="running total")
    top.axhline(1.05, color="tab:green", ls="--", lw=1, label="budget 1.05")
    top.axhline(1.06, color="tab:red", ls=":", lw=1.2, label="acceptance 1.06")
    top.set_ylim(0.7, max(1.6, min(2.5, max(ratios) * 1.05)))
    top.set_ylabel("time / plain")
    top.set_title(f"{result['threads']} torch thread(s), noise: {result['noise']} (shaded: noise on) "
                  f"- total {result['ratio']:.3f}x plain, offloaded {result['offloaded_fraction']:.0%} "
                  f"of managed bytes, bit-identical: {result['bit_identical']}", fontsize=9)
    top.legend(loc="upper right", fontsize=7, ncol=5)
    tails = [r["tail_start"] if r["tail_start"] is not None else 0 for r in steps]
    bottom.step(x, tails, where="mid", color="tab:blue", lw=1.2, label="blocks offloaded")
    share = bottom.twinx()
    for first in range(0, len(steps), window):
        chunk = steps[first:first + window]
        managed = sum(r["managed_bytes"] for r in chunk)
        share.bar(first + (len(chunk) + 1) / 2, sum(r["offloaded_bytes"] for r in chunk) / managed
                  if managed else 0, width=len(chunk) * 0.9, color="tab:cyan", alpha=0.25)
    share.set_ylim(0, 1.05)
    share.set_ylabel("offloaded fraction", fontsize=8)
    top_blocks = max(tails + [1])
    for step in result["profiled_at"]:
        bottom.axvline(step, color="0.6", lw=1)
    for event in result["events"]:
        if event["kind"] in _EVENTS and event["step"] is not None:
            colour, marker, _ = _EVENTS[event["kind"]]
            bottom.plot([event["step"]], [event["tail_start"]], marker=marker, color=colour, ms=6,
                        ls="none")
    bottom.set_ylim(-0.5, top_blocks + 1.5)
    bottom.set_ylabel("blocks")
    handles = [bottom.lines[0]] + [bottom.plot([], [], marker=m, color=c, ls="none")[0]
                                   for c, m, _ in _EVENTS.values()]
    bottom.legend(handles, ["blocks offloaded (0: keep step)"] + [t for _, _, t in _EVENTS.values()],
                  loc="upper right", fontsize=7, ncol=6)
