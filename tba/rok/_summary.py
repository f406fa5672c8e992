"""Points from repeated samples, and the summary in two framings (private module of :mod:`tba.rok`).

A *sample* is one run of one strategy at one batch in one pass (a row the worker returned,
plus ``repeat``); a *point* is every sample of one (strategy, batch) reduced to median, mean
and range. The summary compares each strategy with ``keep`` two ways:

  * **overhead at equal batch**: step time and activation peak over keep's at the same batch,
    per pass (Note [When a comparison means nothing]);
  * **throughput at equal activation budget**: the largest batch whose activation peak stays
    within a budget in every sample, and its model throughput over keep's at keep's largest
    batch within the same budget, per pass.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from tba.rok._spread import NOISE_FLOOR, comparison_warning, spread

__all__ = ["SPREAD_METRICS", "aggregate", "summarize"]

# Metrics reported with median, mean, min and max (and the relative range); other numbers of
# a sample are reported by their median.
SPREAD_METRICS = ("step_time_s", "model_flops_per_s", "tokens_per_s", "activation_peak_bytes")
_MEDIAN_ONLY = ("cache_peak_resident_bytes", "cache_offloaded_bytes", "cache_kept_bytes", "cache_reloaded_bytes",
                "cache_stall_s", "cache_write_bytes_per_s", "cache_read_bytes_per_s", "cache_io_cpu_s",
                "activation_peak_step_delta_bytes", "baseline_bytes", "activation_budget_bytes",
                "warmup_steps_run", "load_avg_1min")
_FIRST = ("plan_activation_bytes", "model_flops_per_step", "peak_method", "offloader", "adaptive",
          "decision_tail_start", "decision_num_blocks", "decision_reason", "decision_unsettled")
_ALL = ("budget_met",)  # booleans: true only when true in every sample


def _is_ok(sample: dict[str, Any]) -> bool:
    return sample.get("status") == "ok"


def aggregate(samples: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per (strategy, batch), in the order points first appear, from every sample of it."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault((s["strategy"], s["batch_size"]), []).append(s)
    points = []
    for (strategy, b), group in groups.items():
        ok = [s for s in group if _is_ok(s)]
        bad = [s for s in group if not _is_ok(s)]
        point: dict[str, Any] = {"strategy": strategy, "batch_size": b,
                                 "status": "ok" if ok else bad[0].get("status", "failed: no status"),
                                 "num_samples": len(ok), "num_failed": len(bad)}
        if ok and bad:
            point["failed_status"] = bad[0].get("status")
        for key in SPREAD_METRICS:
            sp = spread([s[key] for s in ok if s.get(key) is not None])
            if sp is not None:
                point.update({key: sp.median, f"{key}_mean": sp.mean, f"{key}_min": sp.min, f"{key}_max": sp.max,
                              f"{key}_spread": sp.relative})
        for key in _MEDIAN_ONLY:
            vals = [s[key] for s in ok if isinstance(s.get(key), (int, float))]
            if vals:
                point[key] = statistics.median(vals)
        for key in _FIRST:
            val = next((s[key] for s in ok if s.get(key) is not None), None)
            if val is not None:
                point[key] = val
        for key in _ALL:
            vals = [s[key] for s in ok if s.get(key) is not None]
            if vals:
                point[key] = all(vals)
        points.append(point)
    return points


def _by_repeat(samples: Sequence[dict[str, Any]], strategy: str, b: int, key: str) -> dict[int, float]:
    return {s["repeat"]: s[key] for s in samples
            if s["strategy"] == strategy and s["batch_size"] == b and _is_ok(s) and s.get(key) is not None}


def _paired(samples: Sequence[dict[str, Any]], key: str, strategy: str, b: int, keep_b: int) -> list[float]:
    """``strategy`` at ``b`` over ``keep`` at ``keep_b``, one ratio per pass that measured both."""
    mine, keep = _by_repeat(samples, strategy, b, key), _by_repeat(samples, "keep", keep_b, key)
    return [mine[r] / keep[r] for r in sorted(mine) if r in keep and keep[r]]


def _comparison(samples: Sequence[dict[str, Any]], key: str, strategy: str, b: int, keep_b: int,
                noise_floor: float) -> dict[str, Any]:
    ratios = _paired(samples, key, strategy, b, keep_b)
    sp = spread(ratios)
    return {"ratio": sp.as_dict() if sp else None, "ratios": ratios,
            "warning": comparison_warning(ratios, noise_floor)}


def summarize(samples: Sequence[dict[str, Any]], points: Sequence[dict[str, Any]], budget_bytes: int | None,
              noise_floor: float = NOISE_FLOOR) -> dict[str, Any]:
    """Both framings (module docstring) with their spreads and warnings; see Note [When a comparison means nothing].

    ``budget_bytes`` None: keep's peak at keep's median batch (the largest of its samples).
    """
    ok: dict[str, dict[int, dict[str, Any]]] = {}  # strategy -> batch size -> point
    for p in points:
        if p["status"] == "ok":
            ok.setdefault(p["strategy"], {})[p["batch_size"]] = p
    strategies = list(dict.fromkeys(p["strategy"] for p in points))
    unavailable = {s: next(p["status"] for p in points if p["strategy"] == s) for s in strategies if s not in ok}
    keep = ok.get("keep", {})
    warnings: list[str] = [f"{p['strategy']} b={p['batch_size']}: {p['decision_unsettled']}; its samples may time "
                           f"the policy's own measurements" for p in points if p.get("decision_unsettled")]

    b: int | None  # a batch size; below, None where no batch fits the budget
    equal_batch: dict[str, dict[str, Any]] = {}
    for s, pts in ok.items():
        if s == "keep":
            continue
        for b in sorted(pts):
            if b not in keep:
                continue
            step = _comparison(samples, "step_time_s", s, b, b, noise_floor)
            peak = _comparison(samples, "activation_peak_bytes", s, b, b, noise_floor)
            equal_batch.setdefault(s, {})[str(b)] = {"step_time_vs_keep": step, "peak_vs_keep": peak}
            for what, c in (("step time", step), ("activation peak", peak)):
                if c["warning"]:
                    warnings.append(f"{s} b={b}, {what} vs keep: {c['warning']}")

    budget_source = "--budget-bytes"
    if budget_bytes is None and keep:
        b_med = statistics.median_low(sorted(keep))
        budget_bytes = int(keep[b_med]["activation_peak_bytes_max"])  # keep fits its own batch in every sample
        budget_source = f"keep's activation peak at its median batch {b_med}, the largest of its samples"
    equal_budget: dict[str, dict[str, Any]] = {}
    if budget_bytes is not None:
        # A batch fits when its peak stays within the budget in every sample, not just the median.
        fits = {s: max((b for b, p in pts.items() if p["activation_peak_bytes_max"] <= budget_bytes), default=None)
                for s, pts in ok.items()}
        keep_b = fits.get("keep")
        for s, b in fits.items():
            entry: dict[str, Any] = {"largest_batch": b}
            if b is not None:
                p = ok[s][b]
                entry["model_flops_per_s"] = {k: p[f"model_flops_per_s{x}"] for k, x in
                                              (("median", ""), ("mean", "_mean"), ("min", "_min"), ("max", "_max"))}
                if keep_b is not None and s != "keep":
                    entry["throughput_vs_keep"] = _comparison(samples, "model_flops_per_s", s, b, keep_b, noise_floor)
                    if entry["throughput_vs_keep"]["warning"]:
                        warnings.append(f"{s} b={b} vs keep b={keep_b} within the budget, throughput: "
                                        f"{entry['throughput_vs_keep']['warning']}")
            equal_budget[s] = entry
    return {"noise_floor": noise_floor, "equal_batch": equal_batch, "budget_bytes": budget_bytes,
            "budget_source": budget_source if budget_bytes is not None else None, "equal_budget": equal_budget,
            "keep_batch_within_budget": equal_budget.get("keep", {}).get("largest_batch"),
            "unavailable": unavailable, "warnings": warnings}
