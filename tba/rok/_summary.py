"""Points from repeated samples, and the summary in two framings (private module of :mod:`tba.rok`).

A *sample* is one run of one strategy at one batch in one pass (a row the worker returned,
plus ``repeat``); a *point* is every sample of one (strategy, batch) reduced to median, mean
and range. The summary compares each strategy with ``keep`` three ways:

  * **at the largest batch**: activation peak and model throughput over keep's and over
    recompute's, per pass, and the headline sentence made of them;
  * **overhead at equal batch**: step time, activation peak and (secondary) process RSS over
    keep's at the same batch, per pass (Note [When a comparison means nothing]), with the
    reason wherever a strategy holds more activations than keep;
  * **throughput at equal activation budget**: the largest batch whose activation peak stays
    within a budget in every sample, and its model throughput over keep's at keep's largest
    batch within the same budget, per pass.

The activation peak is the allocator's on CUDA (Note [The allocator is the activation axis on
CUDA] in ``_allocator``; tba's accounting beside it, and where the two differ by more than 10%
the summary lists the points) and Note [One measure of activation memory] (in ``_saved``) on
the CPU.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from tba.rok._allocator import TOLERANCE, accounting_gap
from tba.rok._spread import NOISE_FLOOR, comparison_warning, spread

__all__ = ["SPREAD_METRICS", "aggregate", "summarize"]

# Metrics reported with median, mean, min and max (and the relative range); other numbers of
# a sample are reported by their median.
SPREAD_METRICS = ("step_time_s", "model_flops_per_s", "tokens_per_s", "activation_peak_bytes",
                  "process_rss_peak_bytes")
_MEDIAN_ONLY = ("counted_activation_peak_bytes", "cache_peak_resident_bytes", "cache_offloaded_bytes", "cache_kept_bytes", "cache_reloaded_bytes",
                "cache_num_family_entries", "cache_stall_s", "cache_write_bytes_per_s", "cache_read_bytes_per_s",
                "cache_io_cpu_s", "meter_saved_bytes", "meter_recomputed_bytes", "meter_reloaded_bytes",
                "num_saved_storages", "process_rss_step_delta_bytes", "process_rss_after_setup_bytes",
                "cuda_max_allocated_delta_bytes", "cuda_max_reserved_delta_bytes", "activation_budget_bytes",
                "warmup_steps_run", "load_avg_1min")
_FIRST = ("plan_activation_bytes", "model_flops_per_step", "activation_peak_source",
          "counted_activation_peak_source", "allocator_source", "process_rss_method",
          "offloader", "adaptive", "decision_tail_start", "decision_num_blocks", "decision_reason",
          "decision_unsettled")
_ALL = ("budget_met",)  # booleans: true only when true in every sample


def _is_ok(sample: dict[str, Any]) -> bool:
    return sample.get("status") == "ok"


def _is_skipped(sample: dict[str, Any]) -> bool:
    """Not run (time budget, an earlier out-of-memory, a signal): no failure of its own."""
    return str(sample.get("status", "")).startswith("skipped:")


def aggregate(samples: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per (strategy, batch), in the order points first appear, from every sample of it."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault((s["strategy"], s["batch_size"]), []).append(s)
    points = []
    for (strategy, b), group in groups.items():
        ok = [s for s in group if _is_ok(s)]
        bad = [s for s in group if not _is_ok(s)]
        skipped = [s for s in bad if _is_skipped(s)]
        failed = [s for s in bad if not _is_skipped(s)]
        point: dict[str, Any] = {"strategy": strategy, "batch_size": b,
                                 "status": "ok" if ok else bad[0].get("status", "failed: no status"),
                                 "num_samples": len(ok), "num_failed": len(failed),
                                 "num_skipped": len(skipped)}
        if ok and failed:
            point["failed_status"] = failed[0].get("status")
        if ok and skipped:
            point["skipped_status"] = skipped[0]["status"]
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
        if point.get("activation_peak_source") == "allocator" and point.get("activation_peak_bytes") and \
                point.get("counted_activation_peak_bytes") is not None:
            point["counted_vs_allocator"] = point["counted_activation_peak_bytes"] / point["activation_peak_bytes"]
        points.append(point)
    return points


def _by_repeat(samples: Sequence[dict[str, Any]], strategy: str, b: int, key: str) -> dict[int, float]:
    return {s["repeat"]: s[key] for s in samples
            if s["strategy"] == strategy and s["batch_size"] == b and _is_ok(s) and s.get(key) is not None}


def _paired(samples: Sequence[dict[str, Any]], key: str, strategy: str, b: int, ref_b: int,
            ref: str = "keep") -> list[float]:
    """``strategy`` at ``b`` over ``ref`` at ``ref_b``, one ratio per pass that measured both."""
    mine, theirs = _by_repeat(samples, strategy, b, key), _by_repeat(samples, ref, ref_b, key)
    return [mine[r] / theirs[r] for r in sorted(mine) if r in theirs and theirs[r]]


def _comparison(samples: Sequence[dict[str, Any]], key: str, strategy: str, b: int, keep_b: int,
                noise_floor: float, ref: str = "keep") -> dict[str, Any]:
    ratios = _paired(samples, key, strategy, b, keep_b, ref)
    sp = spread(ratios)
    return {"ratio": sp.as_dict() if sp else None, "ratios": ratios,
            "warning": comparison_warning(ratios, noise_floor)}


def summarize(samples: Sequence[dict[str, Any]], points: Sequence[dict[str, Any]], budget_bytes: int | None,
              noise_floor: float = NOISE_FLOOR, tolerance: float = TOLERANCE) -> dict[str, Any]:
    """Both framings (module docstring) with their spreads and warnings; see Note [When a comparison means nothing].
    Where the activation axis is the allocator's, the points whose accounting differs from it
    by more than ``tolerance`` (``accounting_gaps``).

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
            rss = _comparison(samples, "process_rss_peak_bytes", s, b, b, noise_floor)
            equal_batch.setdefault(s, {})[str(b)] = {"step_time_vs_keep": step, "peak_vs_keep": peak,
                                                     "rss_vs_keep": rss}
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
    largest = _at_largest_batch(samples, ok, noise_floor)
    sources = {p.get("activation_peak_source") for pts in ok.values() for p in pts.values()}
    gaps = [gap for pts in ok.values() for p in pts.values() if (gap := accounting_gap(p, tolerance)) is not None]
    return {"noise_floor": noise_floor, "activation_source": "allocator" if "allocator" in sources else "accounting",
            "accounting_tolerance": tolerance, "accounting_gaps": gaps, "largest_batch": largest, "headline": headline(largest),
            "above_keep": above_keep(ok, equal_batch), "equal_batch": equal_batch, "budget_bytes": budget_bytes,
            "budget_source": budget_source if budget_bytes is not None else None, "equal_budget": equal_budget,
            "keep_batch_within_budget": equal_budget.get("keep", {}).get("largest_batch"),
            "unavailable": unavailable, "warnings": warnings,
            "num_passes_run": len({s.get("repeat") for s in samples if _is_ok(s)})}


def _at_largest_batch(samples: Sequence[dict[str, Any]], ok: dict[str, dict[int, dict[str, Any]]],
                      noise_floor: float) -> dict[str, Any]:
    """Every strategy at keep's largest batch: activation peak and throughput over keep's and
    over recompute's, per pass."""
    keep = ok.get("keep", {})
    if not keep:
        return {"batch_size": None, "strategies": {}}
    b = max(keep)
    found: dict[str, dict[str, Any]] = {}
    for s, pts in ok.items():
        if b not in pts:
            continue
        found[s] = {}
        for ref in ("keep", "recompute"):
            if s == ref or b not in ok.get(ref, {}):
                continue
            found[s][f"peak_vs_{ref}"] = _comparison(samples, "activation_peak_bytes", s, b, b, noise_floor, ref)
            found[s][f"throughput_vs_{ref}"] = _comparison(samples, "model_flops_per_s", s, b, b, noise_floor, ref)
    return {"batch_size": b, "strategies": found}


def headline(largest: dict[str, Any]) -> str | None:
    """One sentence from the measured ratios at the largest batch, e.g. "at b=8: offload-ssd:
    0.19x keep's device activations at 0.79x keep's throughput; recompute: ...".

    Example:
        >>> c = lambda r: {"ratio": {"median": r}}
        >>> headline({"batch_size": 8, "strategies": {"offload-ssd": {"peak_vs_keep": c(0.19),
        ...     "throughput_vs_keep": c(0.79)}}})
        "at b=8: offload-ssd: 0.19x keep's device activations at 0.79x keep's throughput"
    """
    parts = []
    for s, comps in largest["strategies"].items():
        peak, throughput = comps.get("peak_vs_keep"), comps.get("throughput_vs_keep")
        if peak and peak["ratio"] and throughput and throughput["ratio"]:
            parts.append(f"{s}: {peak['ratio']['median']:.2f}x keep's device activations at "
                         f"{throughput['ratio']['median']:.2f}x keep's throughput")
    return f"at b={largest['batch_size']}: " + "; ".join(parts) if parts else None


def above_keep(ok: dict[str, dict[int, dict[str, Any]]], equal_batch: dict[str, dict[str, Any]]) -> list[str]:
    """Why, wherever a strategy's activation peak is above keep's at the same batch (median of
    the per-pass ratios above 1), from what the point measured."""
    lines = []
    for s, by_b in equal_batch.items():
        for b_text, comps in by_b.items():
            r = comps["peak_vs_keep"]["ratio"]
            if r is None or r["median"] <= 1.0:
                continue
            p, keep = ok[s][int(b_text)], ok["keep"][int(b_text)]
            mib = 2**20
            head = (f"{s} b={b_text}: {p['activation_peak_bytes'] / mib:.1f} MiB, {r['median']:.2f}x keep's "
                    f"{keep['activation_peak_bytes'] / mib:.1f} MiB: ")
            source = p.get("counted_activation_peak_source", p.get("activation_peak_source"))
            if p.get("activation_peak_source") == "allocator":
                head += (f"tba's accounting ({source}) {p.get('counted_activation_peak_bytes', 0) / mib:.1f} MiB, "
                         f"keep's {keep.get('counted_activation_peak_bytes', 0) / mib:.1f} MiB; ")
            if source == "meter":
                why = (f"at its peak {p.get('meter_saved_bytes', 0) / mib:.1f} MiB saved in forward, "
                       f"{p.get('meter_recomputed_bytes', 0) / mib:.1f} MiB saved again by a checkpointed block's "
                       f"recomputation in backward, {p.get('meter_reloaded_bytes', 0) / mib:.1f} MiB read back")
            else:
                why = (f"the cache kept {p.get('cache_kept_bytes', 0) / mib:.1f} MiB in memory"
                       + (f" (its policy offloads {p['decision_tail_start']} of {p.get('decision_num_blocks')} "
                          f"blocks)" if p.get("decision_tail_start") is not None else "")
                       + "; the rest of its peak is tensors whose stores had not finished or that were read back "
                         "for backward")
                if p.get("cache_num_family_entries"):
                    why += (f"; {p['cache_num_family_entries']:.0f} storages saved through several tensor families "
                            f"count once per family")
            if r["min"] <= 1.0:
                why += f" (the passes range {r['min']:.2f}..{r['max']:.2f}x: within the spread)"
            lines.append(head + why)
    return lines
