"""Judgement and summary table of gpu_truth.py: no row passes on a run that moved nothing.

Pure functions of the rows the script measured (plain dicts, see ``ROW_KEYS``), so that the
rules are unit-tested on CPU (tests/benchmarks/test_gpu_truth.py):

- a row meant to offload (the forced strategies, budget mode) that moved 0 bytes in its
  measured steps, or sent nothing to the offloader in any one of them (a policy kept every
  block), or reloaded none, is FAIL; a step whose stores were all cancelled (backward needed
  the tensors first) is flagged;
- a tba row whose cache accounting (``peak_resident_bytes``) differs from the allocator's
  activation peak by more than ``ACCOUNTING_TOLERANCE`` is flagged (FLAG);
- a row whose policy decides (defaults, budget) must state its decision, else FAIL;
- a strategy that raised (OOM included) is ERROR with the exception.
"""

from __future__ import annotations

from typing import Any

ACCOUNTING_TOLERANCE = 0.10
HOST_PEAK_TARGET = 0.4
DEFAULTS_TIME_TARGET = 1.05
ROW_KEYS = ("phase", "name", "status", "meant_to_offload", "tba", "decides", "steps", "step_s", "act_peak_bytes",
            "cache_peak_bytes", "offloaded_bytes", "reloaded_bytes", "steps_sending_nothing", "steps_all_cancelled", "blocks", "stall_s", "decision")
GIB = 2**30


def accounting_ratio(row: dict[str, Any]) -> float | None:
    """The cache's peak resident bytes over the allocator's activation peak (None: no cache or
    no allocator peak to compare with)."""
    cache, alloc = row.get("cache_peak_bytes"), row.get("act_peak_bytes")
    if cache is None or alloc is None or alloc <= 0:
        return None
    return float(cache) / float(alloc)


def judge_row(row: dict[str, Any]) -> tuple[str, list[str]]:
    """``(verdict, reasons)``: verdict is ok, FLAG, FAIL or ERROR."""
    if row.get("status", "ok") != "ok":
        return "ERROR", [str(row["status"])]
    fails, flags = [], []
    if row.get("meant_to_offload"):
        if not row.get("offloaded_bytes"):
            fails.append(f"meant to offload but moved 0 bytes in {row.get('steps', 0)} measured steps")
        elif not row.get("reloaded_bytes"):
            fails.append("offloaded but reloaded 0 bytes")
        elif row.get("steps_sending_nothing"):  # a forced row offloads in every step, not some
            fails.append(f"sent nothing to the offloader in {row['steps_sending_nothing']} of {row.get('steps', 0)} "
                         "measured steps")
        if row.get("steps_all_cancelled"):  # sent, but backward needed every tensor before its store ran
            flags.append(f"every store cancelled in {row['steps_all_cancelled']} of {row.get('steps', 0)} measured "
                         "steps (backward needed the tensors first)")
    if row.get("decides") and not row.get("decision"):
        fails.append("the policy stated no decision")
    if row.get("tba"):
        ratio = accounting_ratio(row)
        if ratio is None:
            flags.append("no cache accounting to compare with the allocator's peak")
        elif abs(ratio - 1) > ACCOUNTING_TOLERANCE:
            flags.append(f"cache accounting {ratio:.2f}x the allocator's activation peak "
                         f"(more than {ACCOUNTING_TOLERANCE:.0%} off)")
    if fails:
        return "FAIL", fails + flags
    return ("FLAG", flags) if flags else ("ok", [])


def _by_name(rows: list[dict[str, Any]], phase: str) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in rows if r["phase"] == phase}


def target_rows(rows: list[dict[str, Any]], main_phases: list[str]) -> list[tuple[str, str, str]]:
    """The issue's acceptance targets as ``(target, PASS|FAIL|SKIP, detail)``."""
    out: list[tuple[str, str, str]] = []
    for phase in main_phases:
        got = _by_name(rows, phase)
        keep, host, defaults = got.get("keep"), got.get("host"), got.get("defaults")
        usable = keep is not None and keep["status"] == "ok" and keep.get("act_peak_bytes")
        if not usable or host is None or host["status"] != "ok":
            out.append((f"{phase}: host forced <= {HOST_PEAK_TARGET}x keep's activation peak", "SKIP",
                        "keep or host did not run: " + "; ".join(
                            str(r["status"]) for r in (keep, host) if r is not None and r["status"] != "ok")))
        else:
            assert keep is not None
            ratio = host["act_peak_bytes"] / keep["act_peak_bytes"]
            ok = ratio <= HOST_PEAK_TARGET and judge_row(host)[0] != "FAIL"
            out.append((f"{phase}: host forced <= {HOST_PEAK_TARGET}x keep's activation peak",
                        "PASS" if ok else "FAIL",
                        f"{ratio:.3f}x ({host['act_peak_bytes'] / GIB:.2f} / {keep['act_peak_bytes'] / GIB:.2f} GiB), "
                        f"moved {host['offloaded_bytes'] / GIB:.2f} GiB out"))
        if keep is None or keep["status"] != "ok" or defaults is None or defaults["status"] != "ok":
            out.append((f"{phase}: defaults <= {DEFAULTS_TIME_TARGET}x keep's step time, decision stated", "SKIP",
                        "keep or defaults did not run"))
        else:
            assert keep is not None
            ratio = defaults["step_s"] / keep["step_s"]
            ok = ratio <= DEFAULTS_TIME_TARGET and bool(defaults.get("decision"))
            out.append((f"{phase}: defaults <= {DEFAULTS_TIME_TARGET}x keep's step time, decision stated",
                        "PASS" if ok else "FAIL",
                        f"{ratio:.3f}x; decision: {defaults.get('decision') or 'NONE'}"))
    tba_rows = [r for r in rows if r.get("tba") and r["status"] == "ok"]
    off = [f"{r['phase']}/{r['name']} {accounting_ratio(r) or float('nan'):.3f}x" for r in tba_rows
           if accounting_ratio(r) is None or abs((accounting_ratio(r) or 0) - 1) > ACCOUNTING_TOLERANCE]
    out.append((f"cache accounting within {ACCOUNTING_TOLERANCE:.0%} of the allocator on every tba row",
                "SKIP" if not tba_rows else ("FAIL" if off else "PASS"),
                f"{len(tba_rows)} rows; off: {', '.join(off) or 'none'}"))
    moved_nothing = [f"{r['phase']}/{r['name']}" for r in rows if judge_row(r)[0] == "FAIL"]
    out.append(("no row meant to offload moved nothing; every deciding row stated its decision",
                "FAIL" if moved_nothing else "PASS", ", ".join(moved_nothing) or "none"))
    return out


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.3f}"


def format_table(rows: list[dict[str, Any]], phase: str) -> str:
    """One phase's rows as a markdown table, ratios against the phase's keep row."""
    got = [r for r in rows if r["phase"] == phase]
    keep = next((r for r in got if r["name"] in ("keep", "compiled keep") and r["status"] == "ok"), None)
    lines = ["| strategy | verdict | steps | step ms | x keep | alloc act peak GiB | x keep | cache peak GiB | "
             "cache/alloc | blocks offloaded | out GiB | back GiB | stall ms/step | notes |",
             "|" + "---|" * 14]
    for r in got:
        verdict, reasons = judge_row(r)
        ok = r["status"] == "ok"
        t = r.get("step_s") if ok else None
        peak = r.get("act_peak_bytes") if ok else None
        time_x = f"{t / keep['step_s']:.3f}" if keep and t else "-"
        peak_x = f"{peak / keep['act_peak_bytes']:.3f}" if keep and peak is not None and keep["act_peak_bytes"] else "-"
        ratio = accounting_ratio(r) if ok else None
        stall = "-" if not r.get("tba") or r.get("stall_s") is None else f"{r['stall_s'] * 1e3:.1f}"
        notes = reasons + ([f"decision: {r['decision']}"] if r.get("decision") else []) + r.get("notes", [])
        lines.append(
            f"| {r['name']} | {verdict} | {r.get('steps', 0)} | {'-' if t is None else f'{t * 1e3:.1f}'} | {time_x} | "
            f"{_gib(peak)} | {peak_x} | {_gib(r.get('cache_peak_bytes')) if ok else '-'} | "
            f"{'-' if ratio is None else f'{ratio:.3f}'} | {r.get('blocks', '-') if r.get('tba') else '-'} | "
            f"{_gib(r.get('offloaded_bytes')) if r.get('tba') else '-'} | "
            f"{_gib(r.get('reloaded_bytes')) if r.get('tba') else '-'} | "
            f"{stall} | "
            f"{'; '.join(n.replace('|', '/') for n in notes) or ''} |")
    return "\n".join(lines)
