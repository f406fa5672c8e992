"""The closed loop on scripted worlds, where the best boundary is known: how often a check
settles at the best boundary, one block below, lower, or above it, and in how many steps.

    python benchmarks/scripted_worlds.py --out /tmp/worlds.json       # the loop alone, 400 seeds
    python benchmarks/scripted_worlds.py --pass-confidence 0.8 --out /tmp/worlds_08.json
    python benchmarks/scripted_worlds.py --max-probe-steps 48 --out /tmp/worlds_48.json
    python benchmarks/scripted_worlds.py --cache --seeds 10 --kinds uniform,quiet \\
        --out /tmp/worlds_cache.json                                  # in a real cache

A world (``tba.testing.ScriptedWorld``; Note [Bracket search]) has 12 blocks, each 1 s forward
and 2 s backward (a keep step is 36 s), and offloading blocks ``[0, n)`` adds ``n * P``; ``P``
puts the 5% budget halfway between ``k`` and ``k + 1`` blocks, for every ``k`` from 1 to 11.
The best boundary is the largest ``n`` (up to 11: the kept tail) within the budget and worth
its saving. World kinds:

- ``uniform``: each block's time (and each transfer) times a factor uniform in +-2%, and 5%
  of steps 10-40% slower (the acceptance's worlds);
- ``uniform-clean``: the same without outlier steps; ``quiet``: +-0.2%, no outliers;
- ``gauss``: factors normal with a standard deviation of 2% (noisier: about 1.7x the
  uniform's), 5% outlier steps;
- ``convex``: uniform noise and outliers, the transfer time growing as ``n ** 1.5`` (each block
  dearer when more move, as measured on the 2-core CPU machine), ``P`` chosen the same way;
- ``drift``: uniform worlds with a best boundary of 8 to 11 (of ``--boundaries``) settle, then
  ``P`` doubles ten steady steps later: steps until the loop is settled at or below the new
  best.

By default the loop alone (``OverheadLoop``, step times computed from the model above, a few
milliseconds per world); ``--cache`` runs the uniform and quiet kinds in a real cache through
``ScriptedWorld`` (about 0.4 s a world on the 2-core CPU machine). Prints one row per kind and
writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

from tba.cache.policy.closed_loop import OverheadLoop  # noqa: E402
from tba.settings import (  # noqa: E402
    CLOSED_LOOP_MAX_PROBE_STEPS,
    CLOSED_LOOP_MIN_SAVING_PER_OVERHEAD,
    CLOSED_LOOP_PASS_CONFIDENCE,
)

from _environment import describe  # noqa: E402

KINDS = ("uniform", "uniform-clean", "quiet", "gauss", "convex", "drift")
_BLOCKS, _TOP, _KEEP_S, _BUDGET = 12, 11, 36.0, 0.05


def _shape(kind: str) -> float:
    return 1.5 if kind == "convex" else 1.0


def _best(cost: Callable[[int], float]) -> int:
    """The largest boundary within the budget and worth its saving (0: none)."""
    best = 0
    for n in range(1, _TOP + 1):
        if cost(n) <= min(_BUDGET, n / _BLOCKS / CLOSED_LOOP_MIN_SAVING_PER_OVERHEAD) + 1e-12:
            best = n
    return best


class _World:
    """Step times of a scripted world, without a cache (the model of ``ScriptedWorld``)."""

    def __init__(self, kind: str, boundary: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.noise = 0.002 if kind == "quiet" else 0.02
        self.outliers = 0.0 if kind in ("quiet", "uniform-clean") else 0.05
        self.gauss = kind == "gauss"
        self.shape = _shape(kind)
        # cost(n) = scale * n ** shape, with cost(boundary + 0.5) the budget
        self.scale = _BUDGET / (boundary + 0.5) ** self.shape

    def cost(self, n: int) -> float:
        """Overhead of blocks [0, n) over a keep step, without noise."""
        return float(self.scale * n ** self.shape)

    def _factor(self) -> float:
        if self.gauss:
            return 1.0 + self.rng.gauss(0.0, self.noise)
        return 1.0 + self.rng.uniform(-self.noise, self.noise)

    def step_s(self, n: int) -> float:
        """As ``ScriptedWorld`` times a step: a factor per block's forward, backward and
        transfer; an outlier adds 10-40% of the keep step."""
        seconds = sum(f * self._factor() for _ in range(_BLOCKS) for f in (1.0, 2.0))
        per_block = [_KEEP_S * (self.cost(i + 1) - self.cost(i)) for i in range(n)]
        seconds += sum(s * self._factor() for s in per_block)
        if self.rng.random() < self.outliers:
            seconds += _KEEP_S * self.rng.uniform(0.1, 0.4)
        return seconds


def _step(loop: OverheadLoop, world: _World, at: int) -> int:
    """One step at boundary ``at``; the next step's boundary."""
    next_at = loop.observe(at, world.step_s(at))
    assert next_at is not None, loop.reason  # no periodic re-check within these runs
    return next_at


def _check(world: _World, pass_confidence: float, max_probe_steps: int) -> tuple[int, int]:
    """One check from the rule's boundary: where it settled and its measured steps."""
    loop = OverheadLoop(_BUDGET, pass_confidence=pass_confidence, max_probe_steps=max_probe_steps)
    at, num_steps = loop.start(_TOP, [1] * _BLOCKS), 0
    while loop.probing:
        at = _step(loop, world, at)
        num_steps += 1
    return loop.candidate, num_steps


def _drift(boundary: int, seed: int, pass_confidence: float,
           max_probe_steps: int) -> tuple[int, int | None]:
    """A world settles; ten steady steps later its transfer cost doubles. The new best, and the
    steps until the loop is settled at or below it (0: it already was; None: not within 150)."""
    world = _World("uniform", boundary, seed)
    loop = OverheadLoop(_BUDGET, pass_confidence=pass_confidence, max_probe_steps=max_probe_steps)
    at = loop.start(_TOP, [1] * _BLOCKS)
    while loop.probing:
        at = _step(loop, world, at)
    for _ in range(10):  # steady steps
        at = _step(loop, world, at)
    world.scale *= 2
    new_best = _best(world.cost)
    for num_steps in range(0, 151):
        if not loop.probing and loop.candidate <= new_best:
            return new_best, num_steps
        at = _step(loop, world, at)
    return new_best, None


def _cache_check(kind: str, boundary: int, seed: int) -> tuple[int, int, int]:
    from tba.testing import ScriptedWorld

    noise, outliers = (0.002, 0.0) if kind == "quiet" else (0.02, 0.0 if kind == "uniform-clean" else 0.05)
    with ScriptedWorld.with_budget_boundary(boundary, noise=noise, outlier_rate=outliers,
                                            seed=seed) as world:
        for _ in range(2 + 64):
            world.step()
            decision = world.cache.adaptive_decision
            if decision is not None and decision.settled_at_step is not None:
                assert decision.profiled_at_step is not None
                return (world.best_boundary(), decision.tail_start,
                        decision.settled_at_step - decision.profiled_at_step)
        return world.best_boundary(), -1, 10**6


def _row(kind: str, outcomes: list[tuple[int, int, int]]) -> dict[str, object]:
    """``outcomes``: (best, settled at, steps) per check."""
    diffs = [settled - best for best, settled, _ in outcomes]
    steps = sorted(s for _, _, s in outcomes)
    return {
        "kind": kind, "checks": len(outcomes),
        "at_best": sum(d == 0 for d in diffs), "one_below": sum(d == -1 for d in diffs),
        "lower": sum(d < -1 for d in diffs), "above": sum(d > 0 for d in diffs),
        "best_or_one_below": round(sum(-1 <= d <= 0 for d in diffs) / len(diffs), 4),
        "median_steps": statistics.median(steps), "p90_steps": steps[int(0.9 * (len(steps) - 1))],
        "max_steps": steps[-1], "over_60_steps": sum(s > 60 for s in steps),
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=400, help="seeds per best boundary")
    p.add_argument("--boundaries", default="1-11",
                   help="best boundaries (by the budget) of the worlds: a range a-b or a comma list")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, from {','.join(KINDS)}")
    p.add_argument("--pass-confidence", type=float, default=CLOSED_LOOP_PASS_CONFIDENCE)
    p.add_argument("--max-probe-steps", type=int, default=CLOSED_LOOP_MAX_PROBE_STEPS,
                   help="measured steps per check at most (the loop alone)")
    p.add_argument("--cache", action="store_true", help="in a real cache (ScriptedWorld): uniform, "
                                                        "uniform-clean and quiet kinds only")
    p.add_argument("--out", default="scripted_worlds.json")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    low, _, high = args.boundaries.partition("-")
    boundaries = (list(range(int(low), int(high) + 1)) if high
                  else [int(b) for b in args.boundaries.split(",")])
    bad = [k for k in kinds if k not in KINDS or (args.cache and k not in ("uniform", "uniform-clean", "quiet"))]
    if bad or args.seeds < 1 or not all(1 <= b <= _TOP for b in boundaries):
        p.error(f"unknown or unsupported kinds {bad}, --seeds < 1 or boundaries outside 1-{_TOP}")
    env = describe("cpu")
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    rows = []
    for kind in kinds:
        start = time.perf_counter()
        if kind == "drift":
            results = [_drift(b, 1000 * b + s, args.pass_confidence, args.max_probe_steps)
                       for b in boundaries if b >= 8 for s in range(args.seeds)]
            latencies = sorted(s if s is not None else 10**6 for _, s in results)
            row: dict[str, object] = {
                "kind": kind, "checks": len(results),
                "back_within_60": sum(s <= 60 for s in latencies),
                "median_steps": statistics.median(latencies), "max_steps": latencies[-1],
            }
        else:
            outcomes = []
            for boundary in boundaries:
                for seed in range(args.seeds):
                    if args.cache:
                        outcomes.append(_cache_check(kind, boundary, 1000 * boundary + seed))
                    else:
                        world = _World(kind, boundary, 1000 * boundary + seed)
                        settled, num_steps = _check(world, args.pass_confidence,
                                                    args.max_probe_steps)
                        outcomes.append((_best(world.cost), settled, num_steps))
            row = _row(kind, outcomes)
        row["wall_s"] = round(time.perf_counter() - start, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    out: dict[str, object] = {"environment": env, "args": vars(args), "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
