"""The verdict of ``benchmarks/gpu_suite.sh``: PASS / FAIL / SKIP rows with numbers.

The suite's stages write logs and JSON into one results directory; this script turns them into
rows, section by section, in the order the suite runs them (environment -> correctness ->
memory -> malloc hook -> performance), so a suite cut short by its time budget still has the
verdict of what ran. Each row says what was measured, the number, and the threshold it was held
to (or why it was skipped). It reads only files: no torch import except for the environment.

    python benchmarks/_verdict.py RESULTS env           # environment rows
    python benchmarks/_verdict.py RESULTS correctness   # from pytest-gpu.xml
    python benchmarks/_verdict.py RESULTS memory        # from memory.json
    python benchmarks/_verdict.py RESULTS hook          # from hook_on.json / hook_off.json
    python benchmarks/_verdict.py RESULTS performance   # from the benchmarks' JSON
    python benchmarks/_verdict.py RESULTS finish        # verdict.json + summary.txt; exit 1 on FAIL

Rows accumulate in RESULTS/rows.jsonl; the shell script records each stage's outcome in
RESULTS/stages.jsonl (``{"name", "status", "seconds"}``, status ``ok``, ``timeout after N s``,
``failed rc=N`` or ``skipped: REASON``), so a row whose input is missing says why.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Literal

Status = Literal["PASS", "FAIL", "SKIP"]
SECTIONS = ("environment", "correctness", "memory", "malloc_hook", "performance")
ROWS_FILE = "rows.jsonl"
STAGES_FILE = "stages.jsonl"


@dataclasses.dataclass(frozen=True)
class Row:
    section: str
    name: str
    status: Status
    value: Any = None
    detail: str = ""

    def __post_init__(self) -> None:
        assert self.section in SECTIONS, self.section
        assert self.status in ("PASS", "FAIL", "SKIP"), self.status


def judged(section: str, name: str, ok: bool, value: Any, detail: str) -> Row:
    return Row(section, name, "PASS" if ok else "FAIL", value, detail)


def stages(results: Path) -> dict[str, dict]:
    path = results / STAGES_FILE
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            stage = json.loads(line)
            out[stage["name"]] = stage
    return out


def load_json(results: Path, name: str) -> dict | None:
    path = results / name
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def missing(results: Path, section: str, name: str, stage: str, what: str) -> Row:
    """The row for a result file that is not there: SKIP when its stage was skipped (with the
    reason), FAIL when the stage failed, timed out or never ran."""
    info = stages(results).get(stage)
    if info is None:
        return Row(section, name, "FAIL", None, f"stage {stage} never ran, no {what}")
    status = info["status"]
    if status.startswith("skipped"):
        return Row(section, name, "SKIP", None, f"stage {stage} {status}")
    return Row(section, name, "FAIL", None, f"stage {stage}: {status}, no {what} (see {stage}.log)")


def add(results: Path, rows: list[Row]) -> None:
    with open(results / ROWS_FILE, "a") as f:
        for row in rows:
            f.write(json.dumps(dataclasses.asdict(row)) + "\n")


def read_rows(results: Path) -> list[Row]:
    path = results / ROWS_FILE
    if not path.exists():
        return []
    return [Row(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is None:
        return "-"
    return str(value)


def finish(results: Path) -> int:
    """Write verdict.json and summary.txt; return 1 if any row failed (or none exist)."""
    rows = sorted(read_rows(results), key=lambda r: SECTIONS.index(r.section))
    counts = {status: sum(r.status == status for r in rows) for status in ("PASS", "FAIL", "SKIP")}
    verdict = "FAIL" if counts["FAIL"] or not rows else "PASS"
    payload = {
        "verdict": verdict,
        "counts": counts,
        "sections": list(SECTIONS),
        "rows": [dataclasses.asdict(r) for r in rows],
        "stages": list(stages(results).values()),
    }
    (results / "verdict.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [f"verdict: {verdict}  ({counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP)"]
    section = None
    for r in rows:
        if r.section != section:
            section = r.section
            lines.append(f"\n[{section}]")
        lines.append(f"{r.status:<4}  {r.name:<44} {_format_value(r.value):>14}  {r.detail}")
    (results / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if verdict == "FAIL" else 0


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in ("env", "correctness", "memory", "hook", "performance", "finish"):
        print(__doc__, file=sys.stderr)
        return 2
    results = Path(argv[0])
    command = argv[1]
    if command == "finish":
        return finish(results)
    if command == "env":
        from _verdict_env import environment_rows

        add(results, environment_rows(results))
        return 0
    import _verdict_results

    builder = {
        "correctness": _verdict_results.correctness_rows,
        "memory": _verdict_results.memory_rows,
        "hook": _verdict_results.hook_rows,
        "performance": _verdict_results.performance_rows,
    }[command]
    add(results, builder(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
