"""The default adaptive policy on GPU worlds (``tba.testing.GpuWorld``; Note [A GPU world on
scripted time]): how often it settles at the physical bound, one block below, lower or above
it, whether it stays there, and how it follows a drift. The real cache, rule and closed loop
run; only time is scripted.

    python benchmarks/gpu_worlds.py --seeds 10 --steady 500 \
        --out benchmarks/results/cpu/gpu_worlds.json | tee benchmarks/results/cpu/gpu_worlds.txt

(the JSON, every run's outcome, is not committed: the results folder ignores JSON).

Worlds: H100 compute (77 ms keep step, 12 blocks, a third forward), 0.6 GB per block, pinned
pool growth 0.65 s per GB, noise +-2% per block, 5% outlier steps (10-40% slower), the link's
bandwidth putting the knee halfway between ``bound`` and ``bound + 1`` blocks for every bound
from 1 to 11, a 2% step-time budget (one block past the knee exposes half a block's transfer:
1.9% of the step at bound 10, 2.3% at 9, 2.9% at 8; under a knee a boundary may cost no more
than its last block is worth, 1.7%: Note [Worth it past a knee]). Rows:

- ``settle``: settled at the bound or one below within 60 measured steps, above it, and
  whether the settled boundary changed in ``--steady`` further steps (the loop's keep runs and
  runs above it, Note [Looking up], are measurements, not changes);
- ``halve``: settled, then the bound halves (bounds 2-11): back at the new bound or one
  below within 60 steps of the drift;
- ``double``: settled, then the bound doubles (bounds 1-5): back at the new bound or one
  below within 60 steps of the drift.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))

from tba.testing import GpuWorld  # noqa: E402

from _environment import describe  # noqa: E402

OPTIONS: dict[str, Any] = dict(noise=0.02, outlier_rate=0.05, max_step_overhead=0.02)


def settled_boundary(world: GpuWorld, max_steps: int) -> tuple[int | None, int]:
    """Run until the loop settles (within ``max_steps`` steps from now); (boundary, steps)."""
    for taken in range(1, max_steps + 1):
        world.step()
        decision = world.cache.adaptive_decision
        if decision is not None and decision.settled_at_step is not None and not _probing(world):
            return decision.tail_start, taken
    return None, max_steps


def _probing(world: GpuWorld) -> bool:
    decision = world.cache.adaptive_decision
    return decision is None or decision.settled_at_step is None


def run_settle(bound: int, seed: int, steady: int) -> dict[str, Any]:
    with GpuWorld.with_bound(bound, seed=seed, **OPTIONS) as world:
        at, steps = settled_boundary(world, 62)  # profile + 60 measured steps
        changes = 0
        if at is not None and steady:
            last = at
            for _ in range(steady):
                world.step()
                decision = world.cache.adaptive_decision
                if not _probing(world) and decision is not None and decision.tail_start != last:
                    changes += 1
                    last = decision.tail_start
        final = world.cache.adaptive_decision.tail_start if world.cache.adaptive_decision else 0
        return dict(bound=bound, seed=seed, at=at, steps=steps, changes=changes, final=final,
                    pool_given_back=world.num_pool_given_back)


def run_drift(bound: int, new_bound: int, seed: int) -> dict[str, Any]:
    with GpuWorld.with_bound(bound, seed=seed, **OPTIONS) as world:
        at, _ = settled_boundary(world, 62)
        world.run(10)
        world.bytes_per_s = world.read_bytes_per_s = world.bandwidth_for(new_bound)
        back = None
        for taken in range(1, 61):
            ran = world.step()
            if ran in (new_bound, new_bound - 1) and not _probing(world):
                back = taken
                break
        return dict(bound=bound, new_bound=new_bound, seed=seed, settled=at, back=back)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--steady", type=int, default=500)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    start = time.time()
    settle = [run_settle(b, s, args.steady) for b in range(1, 12) for s in range(args.seeds)]
    halve = [run_drift(b, b // 2, s) for b in range(2, 12) for s in range(args.seeds)]
    double = [run_drift(b, 2 * b, s) for b in range(1, 6) for s in range(args.seeds)]
    n = len(settle)
    ok = sum(r["at"] is not None and r["bound"] - 1 <= r["at"] <= r["bound"] for r in settle)
    above = sum(r["at"] is not None and r["at"] > r["bound"] for r in settle)
    stayed = sum(r["changes"] == 0 for r in settle)
    kept = sum(r["at"] is not None and r["bound"] - 1 <= r["final"] <= r["bound"] for r in settle)
    rows = [
        ("settle (bound or one below, <= 60 steps)", f"{ok}/{n}", f"{100 * ok / n:.1f}%"),
        ("settle above the bound", f"{above}/{n}", f"{100 * above / n:.1f}%"),
        (f"no change in {args.steady} steady steps", f"{stayed}/{n}", f"{100 * stayed / n:.1f}%"),
        (f"at the bound or one below after {args.steady} steps", f"{kept}/{n}",
         f"{100 * kept / n:.1f}%"),
    ]
    for name, runs in (("halve", halve), ("double", double)):
        back = sum(r["back"] is not None for r in runs)
        rows.append((f"{name}: back at new bound or one below, <= 60 steps", f"{back}/{len(runs)}",
                     f"{100 * back / len(runs):.1f}%"))
    print(describe("cpu (scripted GPU time)"))
    print(f"command: python benchmarks/gpu_worlds.py --seeds {args.seeds} --steady {args.steady}")
    for row in rows:
        print(f"{row[0]:<55} {row[1]:>9} {row[2]:>7}")
    print(f"({time.time() - start:.0f} s)")
    if args.out:
        args.out.write_text(json.dumps(dict(environment=describe("cpu (scripted GPU time)"), rows=rows, settle=settle,
                                            halve=halve, double=double), indent=1))


if __name__ == "__main__":
    main()
